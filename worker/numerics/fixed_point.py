"""Fixed-point arithmetic that makes tiny-llama's tokens exact for any shape, chunking and TP size.

Activations are multiples of 2**-12 below 64, weights multiples of 2**-10 below 2, held in float64:
every matmul and all-reduce sum then fits 53 bits and is exact in any order, blocking or kernel.
Nonlinear steps use only correctly rounded IEEE operations, or tables built once with `math`.
"""

import math

import torch

ACT_FRAC_BITS = 12  # activations are multiples of 2**-12
ACT_INT_BITS = 6  # and lie strictly inside (-64, 64)
WEIGHT_FRAC_BITS = 10  # weights are multiples of 2**-10
WEIGHT_INT_BITS = 1  # and lie strictly inside (-2, 2)
PROB_FRAC_BITS = 16  # softmax weights are multiples of 2**-16 in [0, 1]
EXP_TABLE_SPAN = 16  # exp(-d) for d beyond 16 rounds to 0 on the probability grid
NORM_EPS = 2.0**-20
MAX_CONTEXT_TOKENS = 4096  # keeps sum(p * v) within 53 bits: 16 + 12 + 6 + 12 + 1 <= 53


def quantize(
    x: torch.Tensor, frac_bits: int = ACT_FRAC_BITS, int_bits: int = ACT_INT_BITS
) -> torch.Tensor:
    """Round to the nearest multiple of 2**-frac_bits (ties to even) and clamp inside the range."""
    scale = float(2**frac_bits)
    limit = float(2**int_bits) - 1.0 / scale
    return torch.clamp(torch.round(x * scale) / scale, -limit, limit)


def exp_table(device: torch.device) -> torch.Tensor:
    """exp(-i / 2**ACT_FRAC_BITS) for i in [0, 16 * 2**ACT_FRAC_BITS], on the probability grid."""
    step = 2.0**-ACT_FRAC_BITS
    count = EXP_TABLE_SPAN * 2**ACT_FRAC_BITS + 1
    values = torch.tensor([math.exp(-i * step) for i in range(count)], dtype=torch.float64)
    return quantize(values, PROB_FRAC_BITS, 1).to(device)  # [count]


def rotary_tables(
    max_len: int, head_dim: int, base: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * base**(-2i/head_dim) on the weight grid; [max_len, head_dim/2]."""
    half = head_dim // 2
    angles = [[pos * base ** (-2.0 * i / head_dim) for i in range(half)] for pos in range(max_len)]
    cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64)
    sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64)
    return (
        quantize(cos, WEIGHT_FRAC_BITS, WEIGHT_INT_BITS).to(device),
        quantize(sin, WEIGHT_FRAC_BITS, WEIGHT_INT_BITS).to(device),
    )


def rms_norm(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dim; the mean of squares is exact, then sqrt and divide round once."""
    mean_square = (x * x).sum(dim=-1, keepdim=True) / x.shape[-1]
    return quantize(x / torch.sqrt(mean_square + NORM_EPS) * gamma)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, head_dim] with cos, sin [T, head_dim/2] (halves layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return quantize(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, table: torch.Tensor
) -> torch.Tensor:
    """Grouped-query attention with exact softmax weights.

    Args:
        q: [S, n, H, head_dim] queries; k, v: [S, L, G, head_dim] context (H divisible by G).
        mask: [S, n, L] True where a query may read an entry; each query reads at least itself.
    Returns [S, n, H * head_dim].
    """
    scores, allowed = masked_scores(q, k, mask)  # [S, G, H/G, n, L]
    weights = torch.where(
        allowed, table_weights(scores.amax(dim=-1, keepdim=True) - scores, table), 0.0
    )
    out = quantize((weights @ grouped_values(v)) / weights.sum(dim=-1, keepdim=True))
    return ungroup(out)


def masked_scores(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [S, G, H/G, n, L] of queries q [S, n, H, head_dim] against keys k [S, L, G,
    head_dim] on the activation grid, masked-out entries at the grid's floor, and the mask as
    [S, 1, 1, n, L]; `attend`'s first half, shared with cascade attention (worker/cascade.py)."""
    num_seqs, num_queries, num_heads, head_dim = q.shape
    num_groups = k.shape[2]
    q = q.view(num_seqs, num_queries, num_groups, num_heads // num_groups, head_dim)
    q = q.permute(0, 2, 3, 1, 4)  # [S, G, H/G, n, head_dim]
    keys = k.permute(0, 2, 3, 1).unsqueeze(2)  # [S, G, 1, head_dim, L]
    scale = 1.0 / math.sqrt(head_dim)  # a power of two for head_dim 4, 16, 64
    scores = quantize((q @ keys) * scale)  # [S, G, H/G, n, L]
    allowed = mask[:, None, None, :, :]
    return torch.where(allowed, scores, -float(2**ACT_INT_BITS)), allowed


def table_weights(distance: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """exp(-distance) from `exp_table`; distance >= 0 on the activation grid (exact)."""
    index = torch.clamp(distance * 2**ACT_FRAC_BITS, max=table.shape[0] - 1).long()
    return table[index]


def grouped_values(v: torch.Tensor) -> torch.Tensor:
    """Values [S, L, G, head_dim] as [S, G, 1, L, head_dim], to multiply `attend`'s weights."""
    return v.permute(0, 2, 1, 3).unsqueeze(2)


def ungroup(out: torch.Tensor) -> torch.Tensor:
    """Per-group results [S, G, H/G, n, head_dim] as [S, n, H * head_dim]."""
    num_seqs, num_groups, per_group, num_queries, head_dim = out.shape
    return out.permute(0, 3, 1, 2, 4).reshape(
        num_seqs, num_queries, num_groups * per_group * head_dim
    )
