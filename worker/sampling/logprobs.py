"""Logprobs of sampled tokens: the model's raw distribution (log_softmax of the logits before
penalties, temperature or filters, as vLLM's default), packed as ModelRunnerOutput's columns.

Per entry that asked for N alternatives: the sampled id's logprob and rank (1 + the number of
ids strictly more likely, so a greedy token is rank 1 even on a tie), then the N most likely ids
in descending order (a tie at the cut keeps the ids topk returns, the same on every run of one
device). Only rank 0's columns reach the engine; ranks agree on the sampled ids, not on these.
"""

from dataclasses import dataclass

import numpy as np
import torch

from worker.sampling.columns import NO_LOGPROBS


@dataclass(frozen=True, slots=True)
class LogprobColumns:
    """ModelRunnerOutput's logprob columns, one entry per entry that asked, in order."""

    logprobs: bytes = b""  # float32 little-endian: the sampled id's, then the top N's
    token_ids: bytes = b""  # int32 little-endian, aligned with logprobs
    sampled_token_ranks: bytes = b""  # int32 little-endian, one per entry


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: np.ndarray
) -> LogprobColumns:
    """The columns for raw `logits` [S, V], the sampled `token_ids` [S] int64 and each entry's
    num_logprobs [S] (NO_LOGPROBS for an entry without)."""
    rows = np.flatnonzero(num_logprobs != NO_LOGPROBS)
    if not len(rows):
        return LogprobColumns()
    index = torch.from_numpy(rows).to(logits.device)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logprobs = torch.log_softmax(logits[index].to(dtype), dim=-1)  # [R, V]
    sampled_ids = token_ids.to(logits.device)[index]  # [R]
    sampled = logprobs.gather(1, sampled_ids[:, None])  # [R, 1]
    ranks = (logprobs > sampled).sum(dim=-1) + 1  # [R]
    counts = num_logprobs[rows]  # [R]
    top_logprobs, top_ids = torch.topk(logprobs, int(counts.max()), dim=-1)  # [R, max N]
    values = torch.cat((sampled, top_logprobs), dim=1).cpu().numpy()  # [R, 1 + max N]
    ids = torch.cat((sampled_ids[:, None], top_ids), dim=1).cpu().numpy()
    # Row-major selection of each row's first 1 + N columns keeps entries in order.
    is_kept = np.arange(values.shape[1]) <= counts[:, None]  # [R, 1 + max N]
    return LogprobColumns(
        values[is_kept].astype("<f4").tobytes(),
        ids[is_kept].astype("<i4").tobytes(),
        ranks.cpu().numpy().astype("<i4").tobytes(),
    )
