"""TierIndex: one lower tier's map from prefix-cache key to slot, in LRU order (DESIGN.md §3.5).

Plain bookkeeping for the engine: which key each slot of the host or disk tier holds, which
slots are free, and which may not be evicted now. It never copies, and never decides a move.
"""

from collections import OrderedDict

from engine_core.kv_cache.hashing import BlockHashWithGroupId


class TierIndex:
    """The slots of one tier: each holds one key or is free; the least recently used key is the
    first eviction candidate.

    A slot is `pinned` while the step being planned reads or writes it (the copies of a step run
    in one fixed order, so a slot written by the step must not be evicted, and so read, by the
    same step's earlier list); `pending` while a copy into it is unconfirmed (a disk read whose
    checksum the ranks have not yet reported): a pending slot is neither a hit nor a victim.

    Invariants:
    1. Every slot in `[0, num_slots)` is free (in `_free`, once) or holds exactly one key.
    2. A key lives in at most one slot: `_slot_of` and `_key_of` are inverse maps.
    3. Pending slots hold keys.
    """

    def __init__(self, num_slots: int, medium: str) -> None:
        if num_slots < 1:
            raise ValueError(f"a {medium} tier needs at least 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self.medium = medium  # the KV events' name of the tier: "CPU" or "DISK"
        self._slot_of: OrderedDict[BlockHashWithGroupId, int] = OrderedDict()  # LRU first
        self._key_of: dict[int, BlockHashWithGroupId] = {}
        # Free slots, the lowest handed out first (popped from the end), so runs stay short.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.pinned: set[int] = set()
        self.pending: set[int] = set()

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: BlockHashWithGroupId) -> bool:
        return key in self._slot_of

    def slot_of(self, key: BlockHashWithGroupId) -> int | None:
        """The slot holding `key`, pending or not, or None."""
        return self._slot_of.get(key)

    def key_of(self, slot: int) -> BlockHashWithGroupId | None:
        return self._key_of.get(slot)

    def lookup(self, key: BlockHashWithGroupId) -> int | None:
        """The slot of a readable copy of `key` (held and not pending), marked most recent."""
        slot = self._slot_of.get(key)
        if slot is None or slot in self.pending:
            return None
        self._slot_of.move_to_end(key)
        return slot

    def touch(self, key: BlockHashWithGroupId) -> None:
        """Mark a held key most recently used."""
        self._slot_of.move_to_end(key)

    def has_free_slot(self) -> bool:
        return bool(self._free)

    def find_victim(self) -> tuple[BlockHashWithGroupId, int] | None:
        """The least recently used key whose slot is neither pinned nor pending, or None."""
        pinned, pending = self.pinned, self.pending
        for key, slot in self._slot_of.items():
            if slot not in pinned and slot not in pending:
                return key, slot
        return None

    def insert(self, key: BlockHashWithGroupId) -> int:
        """Put `key` in a free slot, most recently used, and pin it for this step."""
        if key in self._slot_of:
            raise ValueError(f"{self.medium} tier already holds {key.hex()}: one slot per key")
        if not self._free:
            raise ValueError(f"{self.medium} tier has no free slot of {self.num_slots}")
        slot = self._free.pop()
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self.pinned.add(slot)
        return slot

    def remove(self, key: BlockHashWithGroupId) -> int:
        """Forget `key`; its slot becomes free. The slot stays pinned if it was."""
        slot = self._slot_of.pop(key)
        del self._key_of[slot]
        self.pending.discard(slot)
        self._free.append(slot)
        return slot

    def held_keys(self) -> list[BlockHashWithGroupId]:
        return list(self._slot_of)

    def clear(self) -> None:
        """Forget every key: the tier's memory is gone or no longer trusted."""
        self._slot_of.clear()
        self._key_of.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.pinned.clear()
        self.pending.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError naming the slot or key that breaks an invariant."""
        assert len(self._slot_of) == len(self._key_of), (
            f"{self.medium}: {len(self._slot_of)} keys but {len(self._key_of)} slots held"
        )
        for key, slot in self._slot_of.items():
            assert self._key_of.get(slot) == key, f"{self.medium} slot {slot} is not {key.hex()}"
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.medium}: a free slot is listed twice"
        assert not free & set(self._key_of), f"{self.medium}: slots both free and held"
        assert len(free) + len(self._key_of) == self.num_slots, (
            f"{self.medium}: {len(free)} free + {len(self._key_of)} held != {self.num_slots}"
        )
        assert all(0 <= slot < self.num_slots for slot in free | set(self._key_of))
        assert self.pending <= set(self._key_of), (
            f"{self.medium}: pending slots {sorted(self.pending - set(self._key_of))} hold no key"
        )
