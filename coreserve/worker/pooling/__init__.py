"""The pooling runner's worker side (runner="pooling"): what a model pools to, read at load, and the pooler."""
