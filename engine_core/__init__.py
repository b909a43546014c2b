"""The engine side: block pool, KV-cache managers, scheduler, engine process; never torch."""
