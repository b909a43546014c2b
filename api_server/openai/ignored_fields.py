"""IgnoredFields: the fields of a request body that kvserve does not know. They are accepted and
ignored, as SDKs, proxies and agent frameworks send extra keys on every request, and each name
is logged at WARNING once per process. It only reads bodies; it never refuses one.
"""

import logging
import re
from dataclasses import dataclass

import msgspec
from msgspec import inspect

from api_server.openai.errors import quoted

logger = logging.getLogger(__name__)

# Distinct names remembered (and logged) at most: clients that send random keys must not grow
# the set, or the log, without end
MAX_LOGGED_NAMES = 256
INDEX = re.compile(r"\[\d")
RAW_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])
RAW_ARRAY = msgspec.json.Decoder(list[msgspec.Raw])


class IgnoredFields:
    """Finds a body's unknown fields, at any depth the request Structs declare, by walking its
    JSON as raw slices (objects and arrays are split, no string is decoded), and logs each new
    name once.

    Invariants: `logged` only grows, up to MAX_LOGGED_NAMES names, and its names write list
    positions as `[]`, never as an index, so that one field of every message is one name."""

    def __init__(self) -> None:
        self.logged: set[str] = set()
        self._shapes: dict[type, _Shape] = {}  # per request Struct

    def note(self, body: bytes, struct_type: type) -> list[str]:
        """The unknown fields of `body` (a JSON object that decoded as `struct_type`), as
        paths like `messages[].refusal`; the names not seen before are logged."""
        shape = self._shapes.get(struct_type)
        if shape is None:
            shape = _shape(inspect.type_info(struct_type))
            assert shape is not None  # a Struct always has a shape
            self._shapes[struct_type] = shape
        found: list[str] = []
        _walk(msgspec.Raw(body), shape, "", found)
        for name in found:
            if name in self.logged or len(self.logged) >= MAX_LOGGED_NAMES:
                continue
            self.logged.add(name)
            logger.warning("ignoring unknown request field %s (logged once per name)", quoted(name))
            if len(self.logged) == MAX_LOGGED_NAMES:
                logger.warning("%d unknown field names logged: no more will be", MAX_LOGGED_NAMES)
        return found

    def check_invariants(self) -> None:
        assert len(self.logged) <= MAX_LOGGED_NAMES, len(self.logged)
        for name in self.logged:
            assert name and INDEX.search(name) is None, f"logged name {name!r} has an index"


@dataclass(frozen=True, slots=True)
class _Shape:
    """Where a JSON value may hold fields to check, worked out once per request Struct."""

    fields: dict[str, "_Shape | None"] | None = None  # as an object: known keys; None: free
    item: "_Shape | None" = None  # as an array: where its items may hold fields


def _shape(info: inspect.Type) -> _Shape | None:
    """The shape of `info`; None where no Struct is reachable (a value not to look into)."""
    if isinstance(info, inspect.Metadata):
        return _shape(info.type)
    if isinstance(info, inspect.StructType):
        return _Shape(fields={field.encode_name: _shape(field.type) for field in info.fields})
    if isinstance(info, inspect.ListType):
        item = _shape(info.item_type)
        return None if item is None else _Shape(item=item)
    if isinstance(info, inspect.UnionType):
        shapes = [shape for shape in map(_shape, info.types) if shape is not None]
        fields = next((shape.fields for shape in shapes if shape.fields is not None), None)
        item = next((shape.item for shape in shapes if shape.item is not None), None)
        return None if fields is None and item is None else _Shape(fields, item)
    return None


def _walk(raw: msgspec.Raw, shape: _Shape, path: str, found: list[str]) -> None:
    """Appends to `found` the keys of `raw` that `shape` does not declare."""
    first = memoryview(raw)[:1]
    if shape.fields is not None and first == b"{":
        for key, value in RAW_OBJECT.decode(raw).items():
            name = f"{path}.{key}" if path else key
            if key not in shape.fields:
                found.append(name)
                continue
            inner = shape.fields[key]
            if inner is not None:
                _walk(value, inner, name, found)
    elif shape.item is not None and first == b"[":
        item_path = f"{path}[]"
        for item in RAW_ARRAY.decode(raw):
            _walk(item, shape.item, item_path, found)
