"""Block sums: checksum's context sums at a cost per block, not per cached entry, for fixed-time.

The layers of one KV-cache group keep, beside their paged caches, every block's (and slot's)
weighted sum over those layers, folding in each written entry as read back from the caches; a
context is its full blocks' sums plus its last block's slots, found through the block table. The
tokens equal checksum's. Full attention only (each block before the last is full).
"""

import weakref

import numpy as np
import torch

from worker.attention import PagedKV
from worker.models.fake.checksum import POSITION_WEIGHT_MODULUS


def entry_sums(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """checksum's weighted value of each entry: (k * (dim + 1) + v) summed over heads and dims,
    times position % 251 + 1. k, v [..., heads, head_dim]; positions [...]; int64 [...]."""
    dim_weight = torch.arange(1, k.shape[-1] + 1, dtype=torch.int64, device=k.device)
    return (k * dim_weight + v).sum(dim=(-2, -1)) * (positions % POSITION_WEIGHT_MODULUS + 1)


class BlockSums:
    """The weighted sums of the entries of `layer_names` (one group's layers), per slot and block.

    Invariants: slot_sums[s] is the sum over the layers of the entry in slot s (block *
    block_size + offset) as last written, 0 where none was; block_sums[b] is the sum of block
    b's slot_sums. They describe the caches `cache_refs` point at; other caches (a new
    allocation, all zeros) start them again at zero.
    """

    def __init__(self, layer_names: list[str], paged: PagedKV) -> None:
        caches = [paged.kv_caches[name] for name in layer_names]
        num_blocks, _, block_size = caches[0].shape[:3]
        self.layer_names = layer_names
        self.cache_refs = [weakref.ref(cache) for cache in caches]
        self.block_size = block_size
        device = caches[0].device
        self.block_sums = torch.zeros(num_blocks, dtype=torch.int64, device=device)
        self.slot_sums = torch.zeros(num_blocks * block_size, dtype=torch.int64, device=device)

    def check_invariants(self) -> None:
        per_block = self.slot_sums.view(-1, self.block_size).sum(dim=1)
        assert torch.equal(per_block, self.block_sums), "block sums differ from their slots'"

    def describes(self, paged: PagedKV) -> bool:
        """Whether these sums are of the caches this step writes and reads."""
        caches = [paged.kv_caches[name] for name in self.layer_names]
        return all(ref() is cache for ref, cache in zip(self.cache_refs, caches, strict=True))

    def record_writes(self, paged: PagedKV, positions: torch.Tensor) -> None:
        """Read the step's newly written entries back from every layer and fold them in."""
        group_idx = paged.layer_to_group[self.layer_names[0]]
        block_idx, offsets = paged.write_indices[group_idx]
        new = torch.zeros(len(block_idx), dtype=torch.int64, device=block_idx.device)
        for name in self.layer_names:
            rows, block_rows, block_size = paged.token_rows(name)
            k_rows = block_idx * block_rows + offsets
            k, v = rows.index_select(0, k_rows), rows.index_select(0, k_rows + block_size)
            new += entry_sums(k, v, positions)
        slots = block_idx * self.block_size + offsets
        self.block_sums.index_add_(0, block_idx, new - self.slot_sums[slots])
        self.slot_sums[slots] = new

    def context_sums(self, paged: PagedKV) -> torch.Tensor:
        """int64 [S]: each sampled request's sum over positions 0..p of its last token p."""
        layout = paged.layout
        reqs = layout.logits_reqs
        rows = layout.rows[reqs]
        last = (layout.first_positions + layout.num_queries - 1)[reqs]
        table = paged.tables[paged.layer_to_group[self.layer_names[0]]].block_table
        block_size, device = self.block_size, self.block_sums.device
        num_full = last // block_size  # blocks wholly before the last token's own
        width = int(num_full.max(initial=0))
        is_full = np.arange(width)[None, :] < num_full[:, None]  # [S, width]
        full = torch.from_numpy(np.where(is_full, table[rows, :width], 0)).to(device)
        is_full_t = torch.from_numpy(is_full).to(device)
        totals = torch.where(is_full_t, self.block_sums[full.long()], 0).sum(dim=1)
        return totals + self._last_block_sums(table, rows, last)

    def _last_block_sums(
        self, table: np.ndarray, rows: np.ndarray, last: np.ndarray
    ) -> torch.Tensor:
        """Each request's slots of its last token's block, up to that token: slot_sums hold
        what record_writes read back from the caches there, and nothing has written since."""
        block_size, device = self.block_size, self.block_sums.device
        offsets = np.arange(block_size)
        slots = (table[rows, last // block_size].astype(np.int64) * block_size)[:, None] + offsets
        is_visible = torch.from_numpy(offsets[None, :] <= (last % block_size)[:, None])
        sums = self.slot_sums[torch.from_numpy(slots).to(device)]  # [S, B]
        return torch.where(is_visible.to(device), sums, 0).sum(dim=1)
