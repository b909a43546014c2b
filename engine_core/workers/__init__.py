"""The engine side of its worker ranks: the handshake, the step transport, and rank liveness."""
