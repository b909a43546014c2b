"""The OpenAI-compatible HTTP front end: routes, request models, tokenizer, the engine pool and
its routing.

It reaches engines only through engine_client (requests and utility calls) and their KV-event
streams (kv_event_subscriber.py, on sockets engine_client.connection configures); it never
imports the engine's internals, the workers or deploy/.
"""
