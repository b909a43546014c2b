"""Block hashing, the one home both sides use: the engine keys its prefix cache with it, and the
HTTP front end hashes requests with it to route them by the engines' KV events.

Imports only the standard library, msgspec, xxhash and protocol/; never an engine or a socket.
"""
