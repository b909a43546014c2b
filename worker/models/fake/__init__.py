"""The built-in fake models, which read and write the real paged KV cache, and their references:
each one's tokens computed without paging. Never imports the checkpoint decoder (models/hf/)."""
