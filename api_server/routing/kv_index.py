"""KVBlockIndex: block hash -> the engines holding it, and on which medium, rebuilt from each
engine's KV-event stream in sequence order. Pure state: no sockets, no awaits, no clock.

The subscriber (kv_event_subscriber.py) feeds it batches; the router asks it how long a prefix
of a request each engine holds. Each engine's slice (its keys, its next seq, its counts) lives in
its EngineRecord's `kv_events`; the index keeps only the map from a key to its holders.
"""

import enum
import logging
from collections.abc import Sequence

from api_server.routing.engine_record import EngineRecord
from protocol.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)

GROUP_ID_NUM_BYTES = 4  # a key is the block hash followed by the group id, as the engine keys it
# What a cached block saves a request, by where it lives: a GPU block is read in place; a block
# in host memory or on disk must be copied up first (issue 35's tiers), which costs part of the
# prefill it saves. A medium not listed counts as the least useful one.
DEFAULT_MEDIUM_WEIGHTS = {MEDIUM_GPU: 1.0, "CPU": 0.5, "DISK": 0.25}


class Offer(enum.Enum):
    """What `offer` did with a batch."""

    APPLIED = "applied"  # it was the next one: the index now includes it
    STALE = "stale"  # already applied (a replay overlapping the live stream): ignored
    GAP = "gap"  # batches before it are missing: ignored until a replay brings them


def index_key(block_hash: bytes, group_idx: int | None) -> bytes:
    """The engine's prefix-cache key of a hash: `block_hash_with_group_id` (group 0 if unset)."""
    return block_hash + (group_idx or 0).to_bytes(GROUP_ID_NUM_BYTES, "big")


class KVBlockIndex:
    """Which of the engines of `records` hold each block, from their events, by medium.

    Invariants: `_media[key][engine_idx]` is a non-empty set exactly when `key` is in
    `records[engine_idx].kv_events.keys`; that record's `next_seq` is one past the last batch
    applied for the engine (0 before any). Decisions read only this state, so equal event
    streams give equal answers.
    """

    def __init__(self, records: list[EngineRecord]) -> None:
        if not records:
            raise ValueError("index over 0 engines: expected at least one")
        self.records = records
        self.num_engines = len(records)
        self._media: dict[bytes, dict[int, set[str]]] = {}  # key -> engine_idx -> media

    def offer(self, engine_idx: int, seq: int, batch: KVEventBatch) -> Offer:
        """Apply batch `seq` of an engine if it is the next one."""
        stream = self.records[engine_idx].kv_events
        if seq < stream.next_seq:
            return Offer.STALE
        if seq > stream.next_seq:
            return Offer.GAP
        for event in batch.events:
            self._apply(engine_idx, event)
        stream.next_seq = seq + 1
        stream.num_batches += 1
        return Offer.APPLIED

    def skip_to(self, engine_idx: int, seq: int) -> None:
        """Accept that the batches before `seq` are lost for good (the engine's replay buffer no
        longer holds them): what they stored may stay unknown until it is used again."""
        stream = self.records[engine_idx].kv_events
        if seq < stream.next_seq:
            raise ValueError(f"skip of engine {engine_idx} back to seq {seq}: it is past it")
        stream.next_seq = seq

    def restart(self, engine_idx: int) -> None:
        """The engine's publisher started over (a new engine process): forget all it held and
        expect its stream from seq 0."""
        self.clear(engine_idx)
        self.records[engine_idx].kv_events.next_seq = 0

    def clear(self, engine_idx: int) -> None:
        """Forget every block of one engine, as its AllBlocksCleared says."""
        stream = self.records[engine_idx].kv_events
        for key in stream.keys:
            holders = self._media[key]
            del holders[engine_idx]
            if not holders:
                del self._media[key]
        stream.keys = set()
        stream.num_clears += 1

    def _apply(self, engine_idx: int, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        match event:
            case BlockStored():
                medium = event.medium or MEDIUM_GPU
                keys = self.records[engine_idx].kv_events.keys
                for block_hash in event.block_hashes:
                    key = index_key(block_hash, event.group_idx)
                    self._media.setdefault(key, {}).setdefault(engine_idx, set()).add(medium)
                    keys.add(key)
            case BlockRemoved():
                medium = event.medium or MEDIUM_GPU
                for block_hash in event.block_hashes:
                    self._remove(engine_idx, index_key(block_hash, event.group_idx), medium)
            case AllBlocksCleared():
                self.clear(engine_idx)

    def _remove(self, engine_idx: int, key: bytes, medium: str) -> None:
        stream = self.records[engine_idx].kv_events
        media = self._media.get(key, {}).get(engine_idx)
        if media is None or medium not in media:
            stream.num_unknown_removals += 1  # a batch lost for good stored it
            return
        media.discard(medium)
        if not media:
            del self._media[key][engine_idx]
            if not self._media[key]:
                del self._media[key]
            stream.keys.discard(key)

    def num_blocks(self, engine_idx: int) -> int:
        """Keys the engine holds on any medium."""
        return len(self.records[engine_idx].kv_events.keys)

    def engine_keys(self, engine_idx: int) -> set[bytes]:
        """A copy of the keys the engine holds: what its get_cached_block_hashes should match."""
        return set(self.records[engine_idx].kv_events.keys)

    def prefix_hits(
        self, keys: Sequence[bytes], medium_weights: dict[str, float] = DEFAULT_MEDIUM_WEIGHTS
    ) -> list[tuple[int, float]]:
        """Per engine: how many of `keys` (a request's blocks, in order) it holds consecutively
        from block 0, and that run weighted by the best medium of each block."""
        num_held = [0] * self.num_engines
        weighted = [0.0] * self.num_engines
        live = set(range(self.num_engines))
        least = min(medium_weights.values(), default=0.0)
        for key in keys:
            holders = self._media.get(key)
            if holders is None:
                break
            live &= holders.keys()
            if not live:
                break
            for engine_idx in live:
                num_held[engine_idx] += 1
                weighted[engine_idx] += max(
                    medium_weights.get(m, least) for m in holders[engine_idx]
                )
        return list(zip(num_held, weighted, strict=True))

    def check_invariants(self) -> None:
        for key, holders in self._media.items():
            assert holders, f"key {key.hex()} held by no engine"
            for engine_idx, media in holders.items():
                assert media, f"key {key.hex()} on engine {engine_idx} with no medium"
                is_listed = key in self.records[engine_idx].kv_events.keys
                assert is_listed, f"key {key.hex()} not listed for {engine_idx}"
        for engine_idx, record in enumerate(self.records):
            stream = record.kv_events
            stray = [key.hex() for key in stream.keys if engine_idx not in self._media.get(key, {})]
            assert not stray, f"engine {engine_idx} lists keys it holds on no medium: {stray}"
            assert stream.next_seq >= 0, f"engine {engine_idx} seq {stream.next_seq}"
