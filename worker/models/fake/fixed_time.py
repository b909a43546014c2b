"""fixed-time: checksum's tokens through the paged cache, each forward lasting a set time on a
device timeline, as a GPU's does while its host goes on: a forward is ready step_s (plus
prefill_token_s per prompt token it computes) after the later of its call and the previous one's
end (`ready_at_s`), and the worker holds its reply till then.
Its sums are taken a block at a time (block_sums.py), so the host does no per-entry work.
"""

import dataclasses
import time

import torch

from worker.attention import KVContext, PagedKV
from worker.distributed import TPGroup
from worker.models.fake.block_sums import BlockSums
from worker.models.fake.checksum import CHECKSUM, ChecksumConfig, ChecksumModel, kv_values

# checksum's shapes and token rule under a name of its own, so a rank's ModelInfo says which runs
FIXED_TIME: ChecksumConfig = dataclasses.replace(CHECKSUM, name="fixed-time")


class FixedTimeModel:
    """The checksum model on one TP rank, each forward lasting step_s seconds of device time, and
    prefill_token_s more per prompt token it computes (the tokens it does not sample from: a
    decode computes only the token it samples from, and a prefill all its prompt tokens).

    Token rule: checksum's (worker/models/fake/checksum.py), read back from the same paged cache;
    the charge changes only when a reply is ready, never a token.
    Invariants: the wrapped checksum model's and the block sums'; step_s > 0; prefill_token_s
    >= 0; ready_at_s never decreases.
    """

    def __init__(
        self, checksum: ChecksumModel, step_s: float, prefill_token_s: float = 0.0
    ) -> None:
        if step_s <= 0 or prefill_token_s < 0:
            raise ValueError(
                f"{FIXED_TIME.name} step time {step_s} s, prefill token time {prefill_token_s} "
                "s: expected > 0 and >= 0"
            )
        self.checksum = checksum
        self.step_s = step_s
        self.prefill_token_s = prefill_token_s
        self.vocab_size = checksum.vocab_size
        self.block_sums: BlockSums | None = None  # made on the first step over paged caches
        self.ready_at_s = 0.0  # time.perf_counter() at which the last forward's output is ready

    def check_invariants(self) -> None:
        self.checksum.check_invariants()
        if self.block_sums is not None:
            self.block_sums.check_invariants()
        assert self.step_s > 0, f"{FIXED_TIME.name} step time {self.step_s} s"
        assert self.prefill_token_s >= 0, f"prefill token time {self.prefill_token_s} s"

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: KVContext,
    ) -> torch.Tensor:
        """checksum's logits [S, V] float64; the output counts as ready at `ready_at_s`."""
        start_s = time.perf_counter()
        if isinstance(kv, PagedKV):
            logits = self._paged_forward(token_ids, positions, kv)
        else:  # a dense store (the reference's): checksum's own entry-by-entry sums
            logits = self.checksum.forward(token_ids, positions, logits_idx, kv)
        num_prefill_tokens = max(0, token_ids.numel() - logits_idx.numel())
        device_s = self.step_s + self.prefill_token_s * num_prefill_tokens
        self.ready_at_s = max(start_s, self.ready_at_s) + device_s
        return logits

    def _paged_forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKV
    ) -> torch.Tensor:
        checksum, config = self.checksum, self.checksum.config
        names = [config.layer_name(layer_idx) for layer_idx in range(config.num_layers)]
        for layer_idx, name in enumerate(names):
            k, v = kv_values(token_ids, positions, layer_idx, checksum.heads, config.head_dim)
            kv.write(name, k, v)  # before any read: a same-step neighbour may share these blocks
        if self.block_sums is None or not self.block_sums.describes(kv):
            self.block_sums = BlockSums(names, kv)
        self.block_sums.record_writes(kv, positions)
        totals = self.block_sums.context_sums(kv)
        return checksum.logit_mixer.mix(checksum.tp_group.all_reduce(totals))


def build_fixed_time(
    tp_group: TPGroup, device: torch.device, step_ms: float, prefill_token_us: float = 0.0
) -> FixedTimeModel:
    checksum = ChecksumModel(FIXED_TIME, tp_group, device)
    return FixedTimeModel(checksum, step_ms / 1000, prefill_token_us / 1_000_000)
