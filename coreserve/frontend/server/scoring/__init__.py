"""Scoring routes (frontend process, HTTP server): label scores (SGLang's /v1/score, vLLM's
/generative_scoring) and TRL's /get_sequence_logprobs."""
