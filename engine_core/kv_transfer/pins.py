"""KVTransferPins: a prefill engine's blocks held for decode engines (DESIGN.md §12).

A `do_remote_decode` request is pinned when the step that samples its first token is scheduled:
the pin takes its own reference on the prompt's blocks (so the pool can neither evict nor reuse
them, whatever the request does next) and the ranks are told, with that same step, to serve
pulls of exactly those blocks under a fresh transfer id and a random secret. The rank therefore
knows the pin before any output can name it.

When the request finishes after that one token with reason "length", its last output carries
the `KVTransferHandle` and the pin is held until `release` (the front end, once the decode engine
answered) or its deadline (`kv_transfer_timeout_s`). Otherwise (a stop token, an abort, an
error) the pin is dropped at once. Dropping frees the blocks into the prefix cache (full ones
stay cached) and sends the ranks an unpin with the next step, which is the first step that could
reuse them: a stale handle is refused from then on.
"""

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHash
from engine_core.kv_transfer.pulls import first_needed_block
from protocol.client_messages import FinishReason
from protocol.kv_cache_spec import NULL_BLOCK_ID, KVCacheGroupSpec, cdiv
from protocol.kv_transfer import KVPin, KVTransferHandle, KVTransferLayout, KVTransferOrders

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class HeldTransfer:
    """One pin: the blocks it references and, once its handle is out, its deadline."""

    transfer_id: int
    secret: str
    req_id: str  # the scoped id of the request it was made for
    blocks: list[KVCacheBlock]  # group after group, in sequence order; one reference each
    num_tokens: int  # prompt tokens whose KV the blocks hold
    deadline: float | None = None  # monotonic; None while the request still runs
    # the handle's block_ids: one run per group, NULL_BLOCK_ID where a window dropped a block
    block_ids: list[int] = field(default_factory=list)


class KVTransferPins:
    """The pins of one prefill engine, and the orders its ranks have not been sent yet.

    Invariants: a transfer id is in `by_req` (its request runs) or `held` (its handle is out),
    never both; each pin holds exactly one reference on each of its blocks; `wanted` names live
    do_remote_decode requests only.
    """

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        timeout_s: float,
        layout: KVTransferLayout,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_pool = block_pool
        self.groups = list(kv_cache_groups)
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.layout = layout
        self.clock = clock
        self.engine_id = secrets.token_hex(8)  # names this engine in its handles
        self.endpoints: list[str] = []  # each rank's transfer server, from its WorkerReady
        self.wanted: set[str] = set()  # scoped ids of live do_remote_decode requests
        self.by_req: dict[str, HeldTransfer] = {}  # pinned, the request still running
        self.held: dict[int, HeldTransfer] = {}  # handle given out, by transfer id
        self._next_transfer_id = 1
        self._pins: list[KVPin] = []
        self._unpins: list[int] = []
        # totals since start, for stats and metrics
        self.num_handles = 0  # handles given out
        self.num_released = 0  # freed by the front end's release
        self.num_expired = 0  # freed at their deadline: the decode side never pulled
        self.num_refused_releases = 0  # a release naming no held transfer, or a wrong secret
        self.num_refused_pulls = 0  # pulls the ranks refused (a forged, stale or foreign handle)

    @property
    def num_held_blocks(self) -> int:
        """Blocks pinned for transfers, whether or not their handle is out yet."""
        pins = [*self.by_req.values(), *self.held.values()]
        return sum(len(pin.blocks) for pin in pins)

    def held_blocks(self) -> list[KVCacheBlock]:
        """Every block a pin references, once per pin (the coordinator's invariant counts them)."""
        return [
            block for pin in [*self.by_req.values(), *self.held.values()] for block in pin.blocks
        ]

    def has_orders(self) -> bool:
        """Pins or unpins the ranks must get: a step must go out even if nothing runs."""
        return bool(self._pins or self._unpins)

    def take_orders(self) -> KVTransferOrders | None:
        if not self.has_orders():
            return None
        orders = KVTransferOrders(pins=self._pins, unpins=self._unpins)
        self._pins, self._unpins = [], []
        return orders

    def want(self, req_id: str) -> None:
        """A do_remote_decode request was admitted: pin it when its first token is scheduled."""
        self.wanted.add(req_id)

    def on_first_sample_scheduled(
        self,
        req_id: str,
        num_tokens: int,
        block_ids: Sequence[list[int]],
        block_hashes: Sequence[BlockHash] = (),
    ) -> None:
        """The step that samples the request's first token is being sent: pin the blocks that
        hold its `num_tokens` prompt tokens (their K/V are written by that step at the latest),
        in each KV-cache group (`block_ids`: the request's, one list per group).

        A sliding-window group has dropped the blocks wholly before the window of this step's
        first token. Those a decode engine's hit needs (the window before the prompt's last
        full block: pulls.first_needed_block) may reach one block further back, when the step
        starts inside the prompt's last block; such a block is pinned from the prefix cache by
        its hash (`block_hashes`: the request's) while it is still cached there. The others
        stay NULL_BLOCK_ID in the pin, with nothing to move."""
        if req_id not in self.wanted or req_id in self.by_req:
            return
        num_blocks = cdiv(num_tokens, self.block_size)
        runs = [list(group_ids[:num_blocks]) for group_ids in block_ids]
        if any(len(run) != num_blocks or run[-1] == NULL_BLOCK_ID for run in runs):
            return  # a group that does not hold the prompt: nothing a decode engine can admit
        pool = self.block_pool
        num_hit_blocks = min((num_tokens - 1) // self.block_size, len(block_hashes))
        for group_id, (run, group) in enumerate(zip(runs, self.groups, strict=True)):
            for idx in range(first_needed_block(group.spec, num_hit_blocks), num_hit_blocks):
                if run[idx] == NULL_BLOCK_ID:
                    cached = pool.get_cached_block(block_hashes[idx], [group_id])
                    if cached is not None:
                        run[idx] = cached[0].block_id
        ids = [block_id for run in runs for block_id in run]
        blocks = [pool.blocks[block_id] for block_id in ids if block_id != NULL_BLOCK_ID]
        self.block_pool.touch(blocks)
        transfer_id, self._next_transfer_id = self._next_transfer_id, self._next_transfer_id + 1
        pin = HeldTransfer(transfer_id, secrets.token_hex(16), req_id, blocks, num_tokens)
        self.by_req[req_id] = pin
        self._pins.append(KVPin(transfer_id, pin.secret, ids))
        pin.block_ids = ids

    def on_finished(
        self, req_id: str, finish_reason: FinishReason, num_output_tokens: int
    ) -> KVTransferHandle | None:
        """The request ended: its handle when a decode engine should carry it on, else None (the
        pin, if any, is dropped)."""
        self.wanted.discard(req_id)
        pin = self.by_req.pop(req_id, None)
        if pin is None:
            return None
        if finish_reason != FinishReason.LENGTH or num_output_tokens != 1 or not self.endpoints:
            self._drop(pin)
            return None
        pin.deadline = self.clock() + self.timeout_s
        self.held[pin.transfer_id] = pin
        self.num_handles += 1
        return KVTransferHandle(
            self.engine_id,
            pin.transfer_id,
            pin.secret,
            list(pin.block_ids),
            pin.num_tokens,
            list(self.endpoints),
            self.layout,
        )

    def release(self, transfer_id: int, secret: str) -> tuple[bool, str | None]:
        """The front end's word that the decode side is done with a transfer."""
        pin = self.held.get(transfer_id)
        if pin is None or not secrets.compare_digest(pin.secret, secret):
            self.num_refused_releases += 1
            return False, f"no held KV transfer {transfer_id} with that secret"
        del self.held[transfer_id]
        self._drop(pin)
        self.num_released += 1
        return True, None

    def expire(self) -> int:
        """Drop the pins whose deadline passed; how many."""
        now = self.clock()
        expired = [
            pin for pin in self.held.values() if pin.deadline is not None and pin.deadline <= now
        ]
        for pin in expired:
            del self.held[pin.transfer_id]
            self._drop(pin)
            logger.warning(
                "KV transfer %d of %s expired after %.1f s: its blocks are freed",
                pin.transfer_id,
                pin.req_id,
                self.timeout_s,
            )
        self.num_expired += len(expired)
        return len(expired)

    def forget_all(self) -> None:
        """The worker generation is lost, and the pages with it: free every pin's blocks. The
        new ranks hold no pins, so no unpin is due."""
        for pin in [*self.by_req.values(), *self.held.values()]:
            self.block_pool.free_blocks(reversed(pin.blocks))
        self.by_req.clear()
        self.held.clear()
        self._pins, self._unpins = [], []

    def _drop(self, pin: HeldTransfer) -> None:
        self.block_pool.free_blocks(reversed(pin.blocks))  # tail first, as a request frees
        self._unpins.append(pin.transfer_id)

    def check_invariants(self) -> None:
        running = {pin.transfer_id for pin in self.by_req.values()}
        assert not running & set(self.held), f"transfers {running & set(self.held)} twice"
        for pin in [*self.by_req.values(), *self.held.values()]:
            for block in pin.blocks:
                assert block.ref_cnt >= 1, f"transfer {pin.transfer_id} pins a free block {block}"
