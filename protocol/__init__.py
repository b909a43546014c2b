"""Wire types of kvserve: msgspec Structs, enums, constants and per-socket codecs.

Imports only the standard library and msgspec. No sockets, no policy.
"""

PROTOCOL_VERSION = 4
