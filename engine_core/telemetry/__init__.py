"""What the engine tells the outside while it serves: Prometheus metrics and KV-cache events."""
