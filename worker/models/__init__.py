"""Fake models that read and write the real paged KV cache."""
