"""The client library of the engine: blocking and asyncio clients; never the engine's internals."""
