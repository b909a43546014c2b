"""Prompt logprobs (vLLM's prompt_logprobs): the rows of a step whose logits give the logprobs of
the prompt's own tokens, for the requests that ask for them.

Prompt token t (1 <= t < num_prompt_tokens) is scored by the logits at position t - 1, so a chunk
of positions [first, end) scores tokens first + 1 .. min(end, num_prompt_tokens - 1); the first
token has none, and the last position's logits are the first sample's, not a prompt token's. The
engine computes the same counts from its SchedulerOutput (engine_core/sched/prompt_logprobs.py).
Only models whose last layer can attend every query row serve them
(worker/models/registry.py's `prompt_logits_refusal`).
"""

from dataclasses import dataclass

import numpy as np

from worker.sampling.columns import NO_LOGPROBS


@dataclass(frozen=True, slots=True)
class PromptLogitRows:
    """The step's tokens whose logits score a prompt token, in scheduled order."""

    token_idx: np.ndarray  # [Q] int64: index among the step's flattened tokens
    target_ids: np.ndarray  # [Q] int64: the prompt token those logits score
    num_logprobs: np.ndarray  # [Q] int64: alternatives its request asked for

    def __len__(self) -> int:
        return len(self.token_idx)


def prompt_logit_rows(
    token_table: np.ndarray,
    rows: np.ndarray,
    num_prompt_logprobs: np.ndarray,
    num_prompt_tokens: np.ndarray,
    first_positions: np.ndarray,
    num_queries: np.ndarray,
    token_offsets: np.ndarray,
) -> PromptLogitRows | None:
    """The logits rows of the scheduled requests (each argument but `token_table`, the batch's
    [rows, max_len] token ids, one entry per request); None when no request asks."""
    asking = np.flatnonzero(num_prompt_logprobs != NO_LOGPROBS)
    ends = np.minimum(first_positions + num_queries, num_prompt_tokens - 1)
    asking = asking[ends[asking] > first_positions[asking]]
    if not len(asking):
        return None
    counts = ends[asking] - first_positions[asking]  # [A]
    starts = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum())) - np.repeat(starts, counts)  # [Q] offset in the chunk
    positions = np.repeat(first_positions[asking], counts) + within
    return PromptLogitRows(
        token_idx=np.repeat(token_offsets[asking], counts) + within,
        target_ids=token_table[np.repeat(rows[asking], counts), positions + 1].astype(np.int64),
        num_logprobs=np.repeat(num_prompt_logprobs[asking], counts),
    )
