"""bench.engine_loop's workload for the tiers below the pool: a batch that keeps turning over on
shared documents, so that blocks move between the pool and the host tier in every step.

Each request is a short turn: one of `NUM_DOCUMENTS` documents of `DOCUMENT_TOKENS`, a few tokens
of its own, and `TURN_TOKENS` generated. A finished turn is replaced at once, so `size` requests
stay running. The pool holds the running turns at their longest and `SPARE_BLOCKS` more: the
documents (16x the spare blocks) do not fit beside them, so each step's allocations evict cached
blocks (device -> host copies) and its admissions find most documents in the host tier (host ->
device copies) when it holds them all. Run with the tier off, the same workload recomputes them.
"""

import random
import time

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.client_messages import FinishReason
from protocol.kv_cache_spec import bytes_per_block, cdiv
from protocol.sampling import SamplingParams
from worker.models.registry import get_model_info

NUM_DOCUMENTS = 256  # 256 turns drawn at random hold about 162 of them at once
DOCUMENT_TOKENS = 64  # 4 blocks of 16: 1,024 blocks, 16x the spare blocks
OWN_TOKENS = 8  # each turn's own tokens after its document
TURN_TOKENS = 24  # generated per turn: a 256-decode batch finishes about 10 turns a step
SPARE_BLOCKS = 64
# Moved blocks counted per step, as get_stats names them (protocol/stats.py PrefixCacheStats).
MOVED_KEYS = {
    "blocks_to_host": "prefix_cache_blocks_to_host",
    "blocks_from_host": "prefix_cache_blocks_from_host",
}


def turn_blocks(block_size: int) -> int:
    return cdiv(DOCUMENT_TOKENS + OWN_TOKENS + TURN_TOKENS, block_size)


def kv_cache_memory_bytes(model: str, block_size: int, num_reqs: int, tp_size: int) -> int:
    """A rank's KV budget: every running turn at its longest, and SPARE_BLOCKS for the cache."""
    groups = get_model_info(model, block_size).kv_cache_groups
    num_blocks = num_reqs * turn_blocks(block_size) + SPARE_BLOCKS
    return num_blocks * bytes_per_block(groups, tp_size)


def host_tier_bytes(model: str, block_size: int, num_blocks: int, tp_size: int) -> int:
    """The --kv-offload-host-bytes (all ranks together) of a host tier of num_blocks slots."""
    groups = get_model_info(model, block_size).kv_cache_groups
    return num_blocks * bytes_per_block(groups, tp_size) * tp_size


class Turns:
    """Submits turns and replaces each finished one, keeping `size` in the engine."""

    def __init__(self, client: EngineClient, model: str, block_size: int, size: int) -> None:
        self.client = client
        self.size = size
        self.rng = random.Random(size)
        vocab_size = get_model_info(model, block_size).vocab_size
        self.vocab_size = vocab_size
        self.documents = [
            [self.rng.randrange(3, vocab_size) for _ in range(DOCUMENT_TOKENS)]
            for _ in range(NUM_DOCUMENTS)
        ]
        self.params = SamplingParams(max_tokens=TURN_TOKENS, ignore_eos=True)
        self.live: set[str] = set()
        self._next_idx = 0

    def fill(self) -> None:
        while len(self.live) < self.size:
            req_id = f"turn-{self.size}-{self._next_idx}"
            self._next_idx += 1
            own = [self.rng.randrange(3, self.vocab_size) for _ in range(OWN_TOKENS)]
            prompt = [*self.rng.choice(self.documents), *own]
            self.client.add_request(make_request(req_id, prompt, self.params))
            self.live.add(req_id)

    def drain_until(self, deadline_s: float, poll_s: float) -> None:
        """Read outputs until deadline_s, replacing every turn that ends; one that ends other
        than by its length is an error."""
        while (remaining_s := deadline_s - time.monotonic()) > 0:
            for output in self.client.poll_outputs(min(remaining_s, poll_s)):
                if output.finish_reason is None or output.req_id not in self.live:
                    continue
                if output.finish_reason != FinishReason.LENGTH:
                    raise RuntimeError(
                        f"{output.req_id} ended {output.finish_reason} ({output.error}): "
                        "expected every turn to run to its length"
                    )
                self.live.discard(output.req_id)
            self.fill()

    def abort(self) -> None:
        self.client.abort(sorted(self.live))
        self.live.clear()


def moved_per_step(before: dict, after: dict) -> dict[str, float]:
    """Blocks copied each way per engine step between two get_stats answers."""
    num_steps = int(after["num_engine_steps"]) - int(before["num_engine_steps"])
    if num_steps < 1:
        raise RuntimeError(f"{num_steps} engine steps between two readings: expected some")
    return {
        f"{name}_per_step": (int(after[key]) - int(before[key])) / num_steps
        for name, key in MOVED_KEYS.items()
    }
