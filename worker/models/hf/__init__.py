"""Hugging Face checkpoints served over the paged KV cache: config and weight checks, per-rank
memory-mapped loading, and the decoder (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 text,
Phi-3, and the mixtures of experts Qwen3-MoE and Mixtral). No transformers import."""
