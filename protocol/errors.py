"""ProtocolError: raised when a frame cannot be decoded into the messages its socket allows."""


class ProtocolError(ValueError):
    """A malformed or unexpected message arrived at a socket boundary."""
