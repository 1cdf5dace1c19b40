"""Parsers of a model's generated text into OpenAI's message parts: tool calls in the formats real
checkpoints write, and reasoning apart from the answer (frontend process, HTTP server; docs/serving.md)."""
