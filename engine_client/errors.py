"""The errors a client of the engine raises: a vanished engine, a dropped connection, a frame the
engine would refuse, and a failed utility call. Only the types; nothing here touches a socket.
"""


class EngineDeadError(RuntimeError):
    """The engine closed the connection or stopped answering."""


class EngineConnectionLost(EngineDeadError):
    """The connection dropped under a request or call in flight, which is lost with it; the
    client reconnects, so only what was in flight fails (EngineDeadError if it cannot)."""


class FrameTooLargeError(ValueError):
    """A request whose frame the engine's client socket would refuse, dropping the connection."""


class UtilityCallError(RuntimeError):
    """The engine answered a utility call with ok=False; the message is its reason."""
