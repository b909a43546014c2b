"""A sparse layer's mixture of experts on one TP rank: routing as transformers computes it, and
the experts grouped so that a step costs one pass per active expert, not one per token.

Routing (every rank alike, the router being replicated): logits in the compute dtype, softmax in
float32, the top-k experts of each token, renormalised to sum to 1 where the model asks. The
grouped path then sorts the (token, expert) pairs by expert, runs each active expert's gate/up
GEMM, SiLU-and-multiply and down GEMM once over all its tokens, and scatter-adds the weighted rows
back, expert by expert in ascending order, as transformers' loop adds them.

Under TP each rank holds every expert's slice [rank * I_r, (rank + 1) * I_r) of the intermediate
dimension (as vLLM's TP MoE splits them): its output is a partial sum, and the decoder's one
all-reduce per layer completes it. This is the reference path; LayerOps.moe (layer_ops.py) is the
seam where a fused CUDA kernel replaces it.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.models.hf.fp8_linear import Fp8Linear, weight_tensors
from worker.models.hf.linear import linear


@dataclass(slots=True)
class MoeWeights:
    """One sparse layer's router and this rank's slices of its experts (linear.py's layout: each
    expert's matrix packed for the CPU's GEMM where packing applies)."""

    router: torch.Tensor  # [E, D], replicated and plain: its logits decide the routing
    gate_up_proj: list[torch.Tensor | Fp8Linear]  # per expert [2 * I_r, D]: gate rows, then up
    down_proj: list[torch.Tensor | Fp8Linear]  # per expert [D, I_r]: this rank's input columns
    num_experts_per_tok: int  # top-k
    norm_topk_prob: bool  # renormalise the top-k probabilities
    is_weighted_in_float32: bool  # Mixtral: output x float32 weight, then rounded (moe_config)

    def tensors(self) -> list[torch.Tensor]:
        experts = [t for w in (*self.gate_up_proj, *self.down_proj) for t in weight_tensors(w)]
        return [self.router, *experts]


def route(h: torch.Tensor, weights: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k routing of h [T, D]: (probabilities [T, k] float32, expert ids [T, k] int64),
    each row in descending probability."""
    logits = F.linear(h, weights.router)  # [T, E] in the compute dtype, as transformers has it
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_probs, expert_ids = torch.topk(probs, weights.num_experts_per_tok, dim=-1)
    if weights.norm_topk_prob:
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
    return top_probs, expert_ids


def grouped_moe(
    h: torch.Tensor,
    weights: MoeWeights,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """This rank's partial MoE output [T, D] of the normed h [T, D] (the whole output at TP 1).

    One host sync (the per-expert counts) and, per active expert, two GEMMs over its tokens.
    """
    num_tokens, top_k = h.shape[0], weights.num_experts_per_tok
    probs, expert_ids = route(h, weights)
    flat_ids = expert_ids.flatten()  # [T * k]: pair p is token p // k's (p % k)-th pick
    # a stable sort keeps each expert's tokens in ascending order, as transformers visits them
    pairs = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=len(weights.gate_up_proj)).tolist()
    flat_probs = probs.flatten()
    out = torch.zeros_like(h)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        expert_pairs = pairs[start : start + count]
        start += count
        tokens = expert_pairs // top_k
        act = silu_and_mul(linear(h[tokens], weights.gate_up_proj[expert]))  # [n, I_r]
        y = linear(act, weights.down_proj[expert])  # [n, D]
        prob = flat_probs[expert_pairs, None]  # [n, 1] float32
        y = (y * prob).to(h.dtype) if weights.is_weighted_in_float32 else y * prob.to(h.dtype)
        out.index_add_(0, tokens, y)
    assert start == num_tokens * top_k
    return out
