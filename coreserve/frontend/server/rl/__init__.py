"""The RL dialects (frontend process, HTTP server): the control verbs under vLLM's and SGLang's names,
SGLang's /generate and vLLM's /inference/v1/generate (token ids in and out)."""
