"""Structured outputs: the engine's one owner of each constrained request's grammar state."""
