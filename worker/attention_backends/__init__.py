"""Attention backends: the ways a model's layer reads and writes the paged KV cache."""
