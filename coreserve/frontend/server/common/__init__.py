"""What every room of the server shares (frontend process, HTTP server): errors, the JSON response,
SSE transport, one HTTP request's engine requests (`Generation`), admission and body limits, prompt checks,
the one SamplingParams builder, the one delta accumulator, logprob JSON and the metrics table."""
