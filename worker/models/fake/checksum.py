"""checksum: a cheap fake model in exact integer arithmetic that reads the real paged KV cache.

Token rule: each layer writes values of (token, position, layer, head, dim) into the token's slot;
each sampled request reads its whole context back through the block table, sums it weighted by
position over this rank's heads, all-reduces the sum and mixes it into pseudo-random logits.
"""

from dataclasses import dataclass

import numpy as np
import torch

from protocol.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from worker.attention import KVContext
from worker.distributed import TPGroup
from worker.sampler import SPLITMIX_GAMMA, SPLITMIX_MUL_1, SPLITMIX_MUL_2

VALUE_MODULUS = 65_521  # values stay below 2**16
LOGIT_SHIFT = 12  # a logit keeps a 64-bit product's top 52 bits: a float64's mantissa
ONE_BITS = 0x3FF0_0000_0000_0000  # the float64 1.0; its mantissa bits are all zero
POSITION_WEIGHT_MODULUS = 251


@dataclass(frozen=True, slots=True)
class ChecksumConfig:
    name: str = "checksum"
    vocab_size: int = 1024
    num_layers: int = 2
    num_kv_heads: int = 4  # divisible by every supported tp_size (1, 2, 4)
    head_dim: int = 2
    max_model_len: int = 8192
    eos_token_id: int | None = None  # runs stop on max_tokens or stop ids only

    def layer_name(self, layer_idx: int) -> str:
        return f"layers.{layer_idx}.attn"

    def kv_cache_groups(self, block_size: int) -> list[KVCacheGroupSpec]:
        names = [self.layer_name(i) for i in range(self.num_layers)]
        spec = FullAttentionSpec(block_size, self.num_kv_heads, self.head_dim, "int64")
        return [KVCacheGroupSpec(names, spec)]


CHECKSUM = ChecksumConfig()


def kv_values(
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    layer_idx: int,
    heads: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [T, len(heads), head_dim] int64 of tokens at positions, for these global heads."""
    dims = torch.arange(head_dim, dtype=torch.int64, device=token_ids.device)
    base = (
        token_ids[:, None, None] * 1_000_003
        + positions[:, None, None] * 7_919
        + layer_idx * 104_729
        + heads[None, :, None] * 15_485_863
    )
    k = (base + dims * 2_750_159) % VALUE_MODULUS
    v = (base * 3 + dims * 49_979_687 + 1) % VALUE_MODULUS
    return k, v


def context_sum(
    k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Sum over heads, dims and visible entries of (k * (dim + 1) + v) * (position % 251 + 1).

    Args: k, v [S, L, heads, head_dim]; positions [S, L]; mask [S, L]. Returns [S] int64.
    """
    dim_weight = torch.arange(1, k.shape[-1] + 1, dtype=torch.int64, device=k.device)
    per_entry = (k * dim_weight + v).sum(dim=(2, 3))  # [S, L]
    weight = positions % POSITION_WEIGHT_MODULUS + 1
    return torch.where(mask, per_entry * weight, 0).sum(dim=1)


def mix_logits(totals: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Pseudo-random logits [S, V] float64 in [0, 1), a fixed function of each int64 total."""
    return LogitMixer(vocab_size).mix(totals).clone()


def _wrap_int64(value: int) -> int:
    """The int64 whose two's-complement bits are the 64-bit unsigned `value`."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right_logical(z: torch.Tensor, bits: int) -> torch.Tensor:
    """`z >> bits` of int64 `z` read as unsigned: torch shifts signed values arithmetically."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix_rows(totals: torch.Tensor) -> torch.Tensor:
    """SplitMix64 of each int64 value, made odd, as the int64 of its bits [S]: a row's (or a
    token's) multiplier."""
    z = totals + _wrap_int64(SPLITMIX_GAMMA)  # int64 arithmetic wraps like uint64's
    z = (z ^ _shift_right_logical(z, 30)) * _wrap_int64(SPLITMIX_MUL_1)
    z = (z ^ _shift_right_logical(z, 27)) * _wrap_int64(SPLITMIX_MUL_2)
    return (z ^ _shift_right_logical(z, 31)) | 1


class LogitMixer:
    """mix_logits into buffers kept from one step to the next: four cheap passes over [S, V].

    Row s's logit for token v is the top 52 bits of a_s * b_v mod 2^64, over 2^52: a_s is the
    SplitMix64 of the row's total and b_v that of v, both odd, so a product's high bits mix
    both. Those bits become the mantissa of a float64 in [1, 2), less 1.0: exact, and with no
    integer-to-float conversion, which SIMD units lack for 64-bit integers. int64 products wrap
    mod 2^64 as uint64's do, so the torch path (any device) and numpy's (CPU) agree bit for bit.

    Invariants: the buffers hold at least as many rows as the largest batch mixed so far; the
    logits a call returns are valid until the next call.
    """

    def __init__(self, vocab_size: int, numpy_on_cpu: bool = True) -> None:
        self.vocab_size = vocab_size
        self.numpy_on_cpu = numpy_on_cpu  # False: torch's ops on the CPU too, as on a GPU
        self._reserve(0, torch.device("cpu"))

    def _reserve(self, num_rows: int, device: torch.device) -> None:
        self._columns = mix_rows(torch.arange(self.vocab_size, dtype=torch.int64, device=device))
        shape = (num_rows, self.vocab_size)
        self._values = torch.empty(shape, dtype=torch.int64, device=device)
        self._logits = torch.empty(shape, dtype=torch.float64, device=device)

    def mix(self, totals: torch.Tensor) -> torch.Tensor:
        """The logits [S, V] float64 of totals [S] int64, in this mixer's buffer."""
        num_rows = len(totals)
        if self._values.shape[0] < num_rows or self._values.device != totals.device:
            self._reserve(num_rows, totals.device)
        rows = mix_rows(totals)
        y, logits = self._values[:num_rows], self._logits[:num_rows]
        if y.device.type != "cpu" or not self.numpy_on_cpu:
            torch.mul(rows[:, None], self._columns, out=y)
            mantissas = _shift_right_logical(y, LOGIT_SHIFT).bitwise_or_(ONE_BITS)
            return torch.sub(mantissas.view(torch.float64), 1.0, out=logits)
        values = y.numpy().view(np.uint64)  # numpy's uint64 ufuncs wrap, and shift logically
        columns = self._columns.numpy().view(np.uint64)
        np.multiply(rows.numpy().view(np.uint64)[:, None], columns, out=values)
        np.right_shift(values, np.uint64(LOGIT_SHIFT), out=values)
        np.bitwise_or(values, np.uint64(ONE_BITS), out=values)
        np.subtract(values.view(np.float64), 1.0, out=logits.numpy())
        return logits


class ChecksumModel:
    """The checksum model on one TP rank.

    Invariants: the rank owns KV heads [rank * G_r, (rank + 1) * G_r) of every layer.
    """

    def __init__(self, config: ChecksumConfig, tp_group: TPGroup, device: torch.device) -> None:
        if config.num_kv_heads % tp_group.tp_size:
            raise ValueError(
                f"{config.name} has {config.num_kv_heads} kv heads, not divisible by "
                f"tp_size={tp_group.tp_size}"
            )
        self.config = config
        self.tp_group = tp_group
        self.vocab_size = config.vocab_size
        per_rank = config.num_kv_heads // tp_group.tp_size
        first = tp_group.rank * per_rank
        self.heads = torch.arange(first, first + per_rank, dtype=torch.int64, device=device)
        self.logit_mixer = LogitMixer(config.vocab_size)

    def check_invariants(self) -> None:
        per_rank = self.config.num_kv_heads // self.tp_group.tp_size
        expected = list(range(self.tp_group.rank * per_rank, (self.tp_group.rank + 1) * per_rank))
        assert self.heads.tolist() == expected, (
            f"rank {self.tp_group.rank} owns {self.heads.tolist()}"
        )

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: KVContext,
    ) -> torch.Tensor:
        """Write every token's values, read each sampled token's context; logits [S, V] float64."""
        totals = torch.zeros(len(logits_idx), dtype=torch.int64, device=token_ids.device)  # [S]
        for layer_idx in range(self.config.num_layers):
            name = self.config.layer_name(layer_idx)
            k, v = kv_values(token_ids, positions, layer_idx, self.heads, self.config.head_dim)
            kv.write(name, k, v)  # before any read: a same-step neighbour may share these blocks
            done = 0
            for chunk in kv.chunks(name, logits_only=True):  # one query per sequence, in order
                k_ctx, v_ctx = kv.gather(name, chunk)
                sums = context_sum(k_ctx, v_ctx, chunk.positions, chunk.mask[:, 0, :])
                totals[done : done + len(sums)] += sums
                done += len(sums)
        return self.logit_mixer.mix(self.tp_group.all_reduce(totals))
