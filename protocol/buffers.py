"""Packing of int32 columns for the wire: little-endian int32 bytes, never lists of Python ints.

The engine reads them with `array('i')`, the worker with `numpy.frombuffer(data, '<i4')`; float32
columns (logprobs) likewise with `array('f')` and '<f4'.
"""

import sys
from array import array
from collections.abc import Iterable

_IS_LITTLE_ENDIAN = sys.byteorder == "little"


def pack_int32(values: Iterable[int] | array) -> bytes:
    """Encode integers as little-endian int32 bytes."""
    column = values if isinstance(values, array) and values.typecode == "i" else array("i", values)
    if not _IS_LITTLE_ENDIAN:
        column = array("i", column)
        column.byteswap()
    return column.tobytes()


def unpack_int32(data: bytes) -> array:
    """Decode little-endian int32 bytes into an `array('i')`."""
    if len(data) % 4:
        raise ValueError(f"int32 buffer of {len(data)} bytes is not a multiple of 4")
    column = array("i")
    column.frombytes(data)
    if not _IS_LITTLE_ENDIAN:
        column.byteswap()
    return column


def unpack_float32(data: bytes) -> array:
    """Decode little-endian float32 bytes into an `array('f')`."""
    if len(data) % 4:
        raise ValueError(f"float32 buffer of {len(data)} bytes is not a multiple of 4")
    column = array("f")
    column.frombytes(data)
    if not _IS_LITTLE_ENDIAN:
        column.byteswap()
    return column
