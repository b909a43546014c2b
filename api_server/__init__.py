"""The OpenAI-compatible HTTP front end: routes, request models, tokenizer and the engine pool.

It reaches engines only through engine_client; it never imports the engine's internals,
the workers or deploy/.
"""
