"""Sampling and logprobs on the device (engine-core process): the per-step metadata (`metadata.py`), the
logit rules and grammar mask, the sampler, logprob rows over a backend's sampling ops (`logprobs.py`)
and prompt logprobs (`prompt_logprobs.py`)."""
