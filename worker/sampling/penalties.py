"""Penalties on the logits, from each request's sequence so far (vLLM's rules, in its order):

- repetition r, over every id of the prompt or the output: a positive logit is divided by r, a
  negative one multiplied (r > 1 makes a seen id less likely either way);
- frequency f, over the output: f times the id's count is subtracted;
- presence p, over the output: p is subtracted once from every id that occurs.
The sequences are the ranks' own (each keeps its sampled tokens), so they are whole even while
the engine has not yet seen the latest token (asynchronous scheduling).
"""

from dataclasses import dataclass

import numpy as np
import torch

from worker.sampling.columns import SamplingColumns


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """Where each sampled request's sequence is: row rows[i] of token_ids holds entry i's
    tokens, the first num_prompt_tokens[i] of them its prompt; their count is its position."""

    token_ids: np.ndarray  # [rows, max_len] int32
    rows: np.ndarray  # [S] int64
    num_prompt_tokens: np.ndarray  # [S] int64

    @classmethod
    def one(cls, token_ids: list[int], num_prompt_tokens: int) -> "TokenHistory":
        """The history of a lone sequence (the reference model, tests)."""
        table = np.array([token_ids], dtype=np.int32).reshape(1, len(token_ids))
        return cls(table, np.zeros(1, np.int64), np.array([num_prompt_tokens], np.int64))


def penalized_rows(columns: SamplingColumns) -> np.ndarray:
    """The entries with some penalty, int64; none when the columns carry no penalty."""
    if not columns.has_penalties:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(
        (columns.presence_penalty != 0.0)
        | (columns.frequency_penalty != 0.0)
        | (columns.repetition_penalty != 1.0)
    )


def apply_penalties(
    logits: torch.Tensor,
    columns: SamplingColumns,
    history: TokenHistory,
    positions: np.ndarray,
) -> torch.Tensor:
    """`logits` [S, V] with each penalized entry's row penalized: a new tensor (the raw logits
    stay for logprobs), float32 at least. `positions` [S] is each entry's number of tokens."""
    rows = penalized_rows(columns)
    if not len(rows):
        return logits
    assert columns.presence_penalty is not None and columns.frequency_penalty is not None
    assert columns.repetition_penalty is not None  # has_penalties: the three come together
    dtype = torch.promote_types(logits.dtype, torch.float32)
    device = logits.device
    num_tokens = positions[rows]
    offsets = np.arange(int(num_tokens.max()))  # [L]
    in_sequence = offsets < num_tokens[:, None]  # [P, L]
    in_output = in_sequence & (offsets >= history.num_prompt_tokens[rows][:, None])
    token_ids = history.token_ids[history.rows[rows], : len(offsets)]  # [P, L]
    # Past its end a row holds stale ids: they point at id 0 with weight 0.
    ids = torch.from_numpy(np.where(in_sequence, token_ids, 0).astype(np.int64)).to(device)
    vocab_size = logits.shape[1]
    output_counts = torch.zeros((len(rows), vocab_size), dtype=dtype, device=device)  # [P, V]
    output_counts.scatter_add_(1, ids, torch.from_numpy(in_output).to(device, dtype))
    seen = torch.zeros((len(rows), vocab_size), dtype=dtype, device=device)  # [P, V]
    seen.scatter_add_(1, ids, torch.from_numpy(in_sequence).to(device, dtype))

    def column(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values[rows]).to(device, dtype)[:, None]  # [P, 1]

    index = torch.from_numpy(rows).to(device)
    penalized = logits[index].to(dtype)  # [P, V]
    repetition = column(columns.repetition_penalty)
    repeated = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
    penalized = torch.where(seen > 0, repeated, penalized)
    penalized = penalized - column(columns.frequency_penalty) * output_counts
    penalized = penalized - column(columns.presence_penalty) * (output_counts > 0).to(dtype)
    return logits.to(dtype).index_copy(0, index, penalized)
