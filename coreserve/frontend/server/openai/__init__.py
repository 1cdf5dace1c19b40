"""OpenAI's dialect with vLLM's extensions (frontend process, HTTP server): /v1/completions,
/v1/chat/completions, their request bodies, unsupported fields, structured outputs and prompt scoring."""
