"""Tokenizers of the front end: loading a checkpoint's tokenizer (tokenizer.json, or a GGUF
file's vocabulary), the byte-level tokenizer shipped for the built-in models (tokenizer_files/),
and the chat template each tokenizer renders prompts with.

It knows nothing of the OpenAI protocol nor of the engines: api_server.openai and the offline API
hand it text and messages and get token ids back.
"""
