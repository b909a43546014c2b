"""Bounds checks of Structs built in-process: msgspec checks declared bounds only on decode.

It raises msgspec.ValidationError and never words the error; each caller names its own object.
"""

from typing import TypeVar

import msgspec

S = TypeVar("S", bound=msgspec.Struct)


def checked_copy(value: S) -> S:
    """A copy of `value` rebuilt through msgspec's validation, so every declared bound is checked.

    Raises msgspec.ValidationError naming the first field out of bounds.
    """
    return msgspec.convert(msgspec.to_builtins(value), type(value))
