"""The pooling routes (runner="pooling"): embeddings, pooling, classification, vLLM's score and rerank."""
