"""PagedCrossKV: one step's view of the cross-attention blocks. It writes each encoder's K/V when
its request is first scheduled (or resumed) and gathers it for the request's decoder queries,
always through the cross-attention group's block table; it refuses a table that lacks a block or
maps an encoder position into the null block. EncoderDecoderKV joins it to PagedKV for a forward.
"""

from typing import Protocol

import numpy as np
import torch

from protocol.kv_cache_spec import NULL_BLOCK_ID, CrossAttentionSpec, cdiv
from worker.attention import ContextChunk, KVContext, PagedKV
from worker.block_table import BlockTable
from worker.encoder_inputs import EncoderInputs


class CrossKVContext(KVContext, Protocol):
    """What an encoder-decoder forward needs beyond self-attention: the encoders to run this
    step, which request each token belongs to, and each request's encoder K/V."""

    def encoder_requests(self) -> list[tuple[int, torch.Tensor]]:
        """(request index in the step, its encoder token ids [E] int64) to encode now."""
        ...

    def token_requests(self) -> torch.Tensor:
        """[T] the request index of each of the step's tokens."""
        ...

    def write_cross(self, layer_name: str, req_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V [E, num_kv_heads_per_rank, head_dim] of request `req_idx`'s encoder."""
        ...

    def gather_cross(self, layer_name: str, req_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [E, num_kv_heads_per_rank, head_dim] of request `req_idx`'s encoder."""
        ...


class PagedCrossKV:
    """Encoder K/V of one step's requests in the paged cache, by (block id, offset) per position.

    Built for one step and never changed: the constructor maps every encoder position of every
    scheduled request through its cross-attention table.
    """

    def __init__(self, paged: PagedKV, num_encoder_tokens: np.ndarray) -> None:
        """Args:
        paged: the step's self-attention view, whose caches, tables and rows this one shares.
        num_encoder_tokens: [R] the length of each scheduled request's encoder input.
        """
        self.kv_caches = paged.kv_caches
        self.layer_to_group = {
            name: group_idx
            for name, group_idx in paged.layer_to_group.items()
            if isinstance(paged.specs[group_idx], CrossAttentionSpec)
        }
        rows = paged.layout.rows
        self.indices: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {
            group_idx: [
                _encoder_slots(paged.tables[group_idx], int(row), int(num), paged.device)
                for row, num in zip(rows, num_encoder_tokens, strict=True)
            ]
            for group_idx in set(self.layer_to_group.values())
        }

    def write(self, layer_name: str, req_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        cache = self.kv_caches[layer_name]
        block_idx, offsets = self.indices[self.layer_to_group[layer_name]][req_idx]
        cache[block_idx, 0, offsets] = k.to(cache.dtype)
        cache[block_idx, 1, offsets] = v.to(cache.dtype)

    def gather(self, layer_name: str, req_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.kv_caches[layer_name]
        block_idx, offsets = self.indices[self.layer_to_group[layer_name]][req_idx]
        return cache[block_idx, 0, offsets], cache[block_idx, 1, offsets]


def _encoder_slots(
    table: BlockTable, row: int, num_encoder_tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset) [E] of each encoder position of `row`, or ValueError for a table that
    lacks a block or names the null block."""
    block_size = table.block_size
    num_needed = cdiv(num_encoder_tokens, block_size)
    block_ids = table.row(row)
    if len(block_ids) < num_needed:
        raise ValueError(
            f"row {row} holds {len(block_ids)} cross-attention blocks for {num_encoder_tokens} "
            f"encoder tokens: expected {num_needed}"
        )
    if (block_ids[:num_needed] == NULL_BLOCK_ID).any():
        raise ValueError(
            f"row {row} maps its encoder tokens into the null block: {block_ids.tolist()}"
        )
    positions = np.arange(num_encoder_tokens)
    ids = block_ids[positions // block_size].astype(np.int64)
    return (
        torch.from_numpy(ids).to(device),
        torch.from_numpy(positions % block_size).to(device),
    )


class EncoderDecoderKV:
    """A step's CrossKVContext over the paged cache: self-attention through PagedKV, encoder
    K/V through PagedCrossKV, and the encoders this step must run."""

    def __init__(
        self,
        paged: PagedKV,
        cross: PagedCrossKV,
        encoders: list[tuple[int, torch.Tensor]],
        token_reqs: torch.Tensor,
    ) -> None:
        self.paged = paged
        self.cross = cross
        self.encoders = encoders
        self.token_reqs = token_reqs  # [T]

    @property
    def build_s(self) -> float:
        return self.paged.build_s

    def write(self, layer_name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        self.paged.write(layer_name, k, v)

    def chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]:
        return self.paged.chunks(layer_name, logits_only)

    def gather(self, layer_name: str, chunk: ContextChunk) -> tuple[torch.Tensor, torch.Tensor]:
        return self.paged.gather(layer_name, chunk)

    def encoder_requests(self) -> list[tuple[int, torch.Tensor]]:
        return self.encoders

    def token_requests(self) -> torch.Tensor:
        return self.token_reqs

    def write_cross(self, layer_name: str, req_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cross.write(layer_name, req_idx, k, v)

    def gather_cross(self, layer_name: str, req_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cross.gather(layer_name, req_idx)


def encoder_decoder_kv(
    paged: PagedKV, encoder_inputs: EncoderInputs, handles: list[int]
) -> EncoderDecoderKV:
    """The step's view for an encoder-decoder model: `handles` are the scheduled requests in
    step order, and those whose encoder is pending run it in this step."""
    layout = paged.layout
    cross = PagedCrossKV(paged, encoder_inputs.num_encoder_tokens(handles))
    encoders = [
        (idx, torch.from_numpy(encoder_inputs.token_ids[handles[idx]]).to(paged.device))
        for idx in encoder_inputs.take_pending(handles)
    ]
    token_reqs = np.repeat(np.arange(len(handles)), layout.num_queries)  # [T]
    return EncoderDecoderKV(paged, cross, encoders, torch.from_numpy(token_reqs).to(paged.device))
