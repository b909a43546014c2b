"""The engine side: block pool, KV-cache managers, scheduler and the engine process. Never imports torch."""
