"""A Hypothesis state machine drives BlockPool against a plain dict-and-list reference model.

Requests use a two-token vocabulary and blocks of 2 tokens, so prefixes collide often: hits,
duplicates, evictions of cached blocks and false-hit risks all come up within a few steps.
"""

from dataclasses import dataclass

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHasher, make_block_hash_with_group_id
from engine_core.kv_cache.spec import cdiv
from engine_core.sched.request import Request
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from protocol.sampling import SamplingParams

BLOCK_SIZE = 2
NUM_BLOCKS = 10
HASHER = BlockHasher(BLOCK_SIZE)
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=9)


class ReferencePool:
    """The pool's contract as plain data: ref counts, the free order, and key -> [block ids]."""

    def __init__(self, num_blocks: int) -> None:
        self.ref_cnt = dict.fromkeys(range(1, num_blocks), 0)
        self.free = list(range(1, num_blocks))  # head first
        self.hash_of: dict[int, bytes] = {}
        self.by_key: dict[bytes, list[int]] = {}  # insertion order: the first is the one returned
        self.events: list[tuple] = []

    def lookup(self, key: bytes) -> int | None:
        return self.by_key[key][0] if key in self.by_key else None

    def allocate(self, num_blocks: int) -> list[int]:
        popped, self.free = self.free[:num_blocks], self.free[num_blocks:]
        for block_id in popped:
            if block_id in self.hash_of:
                self.drop_hash(block_id)
            self.ref_cnt[block_id] = 1
        return popped

    def drop_hash(self, block_id: int) -> None:
        key = self.hash_of.pop(block_id)
        self.by_key[key].remove(block_id)
        if not self.by_key[key]:  # routers hear of a hash's removal with its last copy only
            del self.by_key[key]
            self.events.append(("removed", key))

    def touch(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                self.free.remove(block_id)
            self.ref_cnt[block_id] += 1

    def release(self, block_ids: list[int]) -> bool:
        """Free tail-first input; False (and no change) if any block is freed too often."""
        counts = dict(self.ref_cnt)
        for block_id in block_ids:
            counts[block_id] -= 1
            if counts[block_id] < 0:
                return False
        head, tail = [], []
        for block_id in block_ids:
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                (tail if block_id in self.hash_of else head).append(block_id)
        self.free = head + self.free + tail
        return True

    def cache(self, block_ids: list[int], keys: list[bytes]) -> None:
        """Routers hear of a hash with its first copy: one event per run of such blocks."""
        runs: list[list[bytes]] = []
        was_new = False
        for block_id, key in zip(block_ids, keys, strict=True):
            is_new = key not in self.by_key
            if is_new and was_new:
                runs[-1].append(key)
            elif is_new:
                runs.append([key])
            was_new = is_new
            self.hash_of[block_id] = key
            self.by_key.setdefault(key, []).append(block_id)
        self.events.extend(("stored", *run) for run in runs)

    def reset(self) -> bool:
        if any(self.ref_cnt.values()):
            return False
        self.hash_of.clear()
        self.by_key.clear()
        self.events.append(("cleared",))
        return True


@dataclass
class Running:
    request: Request
    blocks: list[KVCacheBlock]
    num_cached_blocks: int


def flatten(events: list) -> list[tuple]:
    """Pool events in the reference model's shape, with group-id keys."""
    flat: list[tuple] = []
    for event in events:
        if isinstance(event, BlockStored):
            keys = [make_block_hash_with_group_id(h, event.group_idx) for h in event.block_hashes]
            flat.append(("stored", *keys))
        elif isinstance(event, BlockRemoved):
            keys = [make_block_hash_with_group_id(h, event.group_idx) for h in event.block_hashes]
            flat.extend(("removed", key) for key in keys)
        else:
            assert isinstance(event, AllBlocksCleared)
            flat.append(("cleared",))
    return flat


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=True, enable_kv_cache_events=True)
        self.model = ReferencePool(NUM_BLOCKS)
        self.running: dict[int, Running] = {}
        self.next_req_id = 0

    def _keys(self, request: Request) -> list[bytes]:
        return [make_block_hash_with_group_id(h, 0) for h in request.block_hashes]

    def _lookup(self, request: Request) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        for block_hash, key in zip(request.block_hashes, self._keys(request), strict=True):
            cached = self.pool.get_cached_block(block_hash, [0])
            expected = self.model.lookup(key)
            assert (None if cached is None else cached[0].block_id) == expected
            if cached is None:
                break
            hits.extend(cached)
        return hits

    @rule(tokens=TOKENS)
    def admit(self, tokens: list[int]) -> None:
        request = Request(str(self.next_req_id), tokens, SamplingParams(), block_hasher=HASHER)
        hits = self._lookup(request)
        num_new = cdiv(len(tokens), BLOCK_SIZE) - len(hits)
        num_evictable_hits = sum(self.model.ref_cnt[b.block_id] == 0 for b in hits)
        if num_new > len(self.model.free) - num_evictable_hits:
            with pytest.raises(ValueError, match="cannot get"):
                self.pool.get_new_blocks(len(self.model.free) + 1)
            return
        self.pool.touch(hits)
        self.model.touch([b.block_id for b in hits])
        new_blocks = self.pool.get_new_blocks(num_new)
        assert [b.block_id for b in new_blocks] == self.model.allocate(num_new)
        self.running[self.next_req_id] = Running(request, hits + new_blocks, len(hits))
        self.next_req_id += 1

    @rule(tokens=TOKENS)
    def admit_identical_pair(self, tokens: list[int]) -> None:
        """Two identical prompts admitted before either is cached compute the same blocks twice."""
        first_id = self.next_req_id
        self.admit(tokens)
        self.admit(tokens)
        for req_id in (first_id, first_id + 1):
            if req_id in self.running:
                self._cache(self.running[req_id])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        self._cache(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    def _cache(self, run: Running) -> None:
        num_full = min(run.request.num_tokens // BLOCK_SIZE, len(run.blocks))
        start = run.num_cached_blocks
        self.pool.cache_full_blocks(run.request, run.blocks, start, num_full, BLOCK_SIZE, 0)
        block_ids = [b.block_id for b in run.blocks[start:num_full]]
        self.model.cache(block_ids, self._keys(run.request)[start:num_full])
        run.num_cached_blocks = max(start, num_full)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 1))
    def grow(self, data: st.DataObject, token: int) -> None:
        """A generated token; a new block when the last one is full and one is free."""
        run = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        run.request.append_output_token_ids(token)
        assert len(run.request.block_hashes) == run.request.num_tokens // BLOCK_SIZE
        if run.request.num_tokens > len(run.blocks) * BLOCK_SIZE and self.model.free:
            new_blocks = self.pool.get_new_blocks(1)
            assert [b.block_id for b in new_blocks] == self.model.allocate(1)
            run.blocks.extend(new_blocks)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        run = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.pool.free_blocks(reversed(run.blocks))
        assert self.model.release([b.block_id for b in reversed(run.blocks)])

    @precondition(lambda self: self.model.free)
    @rule(data=st.data())
    def over_free(self, data: st.DataObject) -> None:
        """Free a request's blocks plus one block that is already free: nothing may change."""
        blocks = [self.pool.blocks[data.draw(st.sampled_from(self.model.free))]]
        if self.running:
            run = self.running[data.draw(st.sampled_from(sorted(self.running)))]
            blocks = [*reversed(run.blocks), *blocks]
        with pytest.raises(ValueError, match="freed more often than it is referenced"):
            self.pool.free_blocks(blocks)
        assert not self.model.release([b.block_id for b in blocks])

    @rule(block_ids=st.lists(st.integers(-1, NUM_BLOCKS), max_size=3))
    def evict(self, block_ids: list[int]) -> None:
        if any(not 0 <= block_id < NUM_BLOCKS for block_id in block_ids):
            with pytest.raises(ValueError, match="cannot evict block"):
                self.pool.evict_blocks(block_ids)
            return
        self.pool.evict_blocks(block_ids)
        for block_id in block_ids:
            if block_id in self.model.hash_of:
                self.model.drop_hash(block_id)

    @rule()
    def reset(self) -> None:
        assert self.pool.reset_prefix_cache() == self.model.reset()

    @rule(tokens=TOKENS)
    def lookup(self, tokens: list[int]) -> None:
        self._lookup(Request("lookup", tokens, SamplingParams(), block_hasher=HASHER))

    @invariant()
    def matches_the_reference_model(self) -> None:
        pool, model = self.pool, self.model
        pool.check_invariants()
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == model.free
        assert {b.block_id: b.ref_cnt for b in pool.blocks[1:]} == model.ref_cnt
        hashes = {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}
        assert hashes == model.hash_of
        for key, block_ids in model.by_key.items():
            assert pool.cached_block_hash_to_block.get_one_block(key).block_id == block_ids[0]
        assert pool.get_num_free_blocks() == len(model.free)
        assert flatten(pool.take_events()) == model.events
        model.events.clear()


TestBlockPoolStateMachine = BlockPoolMachine.TestCase
