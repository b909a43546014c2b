"""One step's view of the MLA layers' latent caches: each token's latent is written into its slot
and each query's context latents gathered, through the block table with PagedKV's own indices; and
the unpaged store the reference model uses instead. It never projects: the model up-projects the
gathered latent into every head's K and V itself.
"""

from typing import Protocol

import torch

from worker.attention import ContextChunk, PagedKV


class LatentContext(Protocol):
    """What an MLA forward needs of a latent store: PagedLatentKV here, DenseLatentKV unpaged."""

    def write_latent(self, layer_name: str, latent: torch.Tensor) -> None: ...

    def chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]: ...

    def gather_latent(self, layer_name: str, chunk: ContextChunk) -> torch.Tensor: ...


class PagedLatentKV:
    """The paged latent caches `[num_blocks, block_size, latent_dim]` as one step sees them.

    It borrows everything positional from the step's PagedKV (slot of each scheduled token, context
    chunks of each query, the null-block refusal), so MLA layers page exactly as attention layers
    do; only the tensor's layout differs: no K/V split, and no heads to shard over TP ranks.
    """

    def __init__(self, paged: PagedKV) -> None:
        self.paged = paged

    def write_latent(self, layer_name: str, latent: torch.Tensor) -> None:
        """Store the latent [T, latent_dim] of every scheduled token."""
        cache = self.paged.kv_caches[layer_name]
        block_idx, offsets = self.paged.write_indices[self.paged.layer_to_group[layer_name]]
        cache[block_idx, offsets] = latent.to(cache.dtype)

    def chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]:
        return self.paged.chunks(layer_name, logits_only)

    def gather_latent(self, layer_name: str, chunk: ContextChunk) -> torch.Tensor:
        """The latents [S, L, latent_dim] of a chunk's context, in cache dtype."""
        return self.paged.kv_caches[layer_name][chunk.block_idx, chunk.block_offsets]


class DenseLatentKV:
    """One whole sequence's latents in contiguous tensors: entry i is position i. No blocks.

    It lives for one dense forward, which writes every layer's latent of all positions at once, so
    there is no state to walk between steps. Every layer attends causally to the whole prefix.
    """

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.store: dict[str, torch.Tensor] = {}

    def write_latent(self, layer_name: str, latent: torch.Tensor) -> None:
        self.store[layer_name] = latent.double()  # [T, latent_dim]

    def chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]:
        positions = torch.arange(self.num_tokens)
        queries = positions[-1:] if logits_only else positions
        visible = positions[None, :] <= queries[:, None]  # [n, T]
        zeros = torch.zeros((1, self.num_tokens), dtype=torch.int64)  # [1, T]
        return [ContextChunk(queries[None, :], zeros, zeros, positions[None, :], visible[None])]

    def gather_latent(self, layer_name: str, chunk: ContextChunk) -> torch.Tensor:
        return self.store[layer_name][None]  # [1, T, latent_dim]
