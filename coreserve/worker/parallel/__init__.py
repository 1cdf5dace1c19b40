"""Tensor parallelism (engine-core process and its rank processes): the executor that drives the ranks,
the rank process, their messages, the process group and how a model splits over the ranks."""
