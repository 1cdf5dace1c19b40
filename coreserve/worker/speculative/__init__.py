"""Speculative decoding, the worker's side: the proposers (prompt lookup, a draft model) and the
verification of their proposals (engine-core process; docs/speculative.md)."""
