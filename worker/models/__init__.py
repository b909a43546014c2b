"""The models a rank runs: the built-in fake models (fake/), Hugging Face checkpoints (hf/), and
the registry that builds either by name."""
