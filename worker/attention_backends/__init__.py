"""Attention backends: kernels that read and write the paged KV cache through the block table."""
