"""The worker: model, paged KV cache, sampler and logprobs. Runs in the engine-core process."""
