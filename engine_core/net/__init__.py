"""The engine's addresses, the binding of its sockets, and CURVE on them; no engine logic."""
