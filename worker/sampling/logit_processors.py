"""Per-request rules on the logits, before min_tokens, penalties and the draw (vLLM's order):
allowed_token_ids masks every other id, bad_words bans the id that would complete a bad word,
and logit_bias adds to the listed ids. They apply to greedy rows too.

Each row is ruled by its own request's settings and sequence only, in float32 at least, so a row's
result never depends on the batch around it, and every rank holding the same logits gets the same
bytes. The raw logits stay as they are: logprobs read them (vLLM's raw logprobs).
"""

from collections.abc import Sequence

import numpy as np
import torch

from protocol.sampling import SamplingParams
from worker.sampling.penalties import TokenHistory


def banned_by_bad_words(bad_words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The ids that would complete a bad word now: a word's last id, where the output so far ends
    with the rest of the word (a one-token word is always banned). Only the output counts, as in
    vLLM: a prompt's tail and the output's head do not make a word together."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) > len(output_ids):
            continue
        if not prefix or list(output_ids[len(output_ids) - len(prefix) :]) == list(prefix):
            banned.append(word[-1])
    return banned


def apply_logit_rules(
    logits: torch.Tensor,
    rows: np.ndarray,
    sampling_params: Sequence[SamplingParams],
    history: TokenHistory | None,
    positions: np.ndarray,
) -> torch.Tensor:
    """`logits` [S, V] with the rules of entries `rows` applied: a new tensor, float32 at least
    (the raw logits stay for logprobs); `logits` itself when no entry sets one.

    Args:
        rows: the entries whose request sets some rule, int64 [R].
        history: each entry's sequence; needed when some entry has bad words.
        positions: [S] each entry's number of tokens so far.
    """
    if not len(rows):
        return logits
    dtype = torch.promote_types(logits.dtype, torch.float32)
    device = logits.device
    index = torch.from_numpy(rows).to(device)
    ruled = logits[index].to(dtype)  # [R, V]
    mask_rows: list[int] = []  # allowed_token_ids: -inf everywhere else
    mask_ids: list[int] = []
    ban_rows: list[int] = []  # bad words: -inf at these ids
    ban_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for slot, entry in enumerate(rows.tolist()):
        params = sampling_params[entry]
        if params.allowed_token_ids:
            mask_rows.extend([slot] * len(params.allowed_token_ids))
            mask_ids.extend(params.allowed_token_ids)
        if params.bad_words_token_ids:
            if history is None:
                raise ValueError("bad words need the token history of the batch")
            banned = banned_by_bad_words(
                params.bad_words_token_ids, _output_ids(history, entry, int(positions[entry]))
            )
            ban_rows.extend([slot] * len(banned))
            ban_ids.extend(banned)
        if params.logit_bias:
            bias_rows.extend([slot] * len(params.logit_bias))
            bias_ids.extend(params.logit_bias)
            bias_values.extend(params.logit_bias.values())
    if mask_rows:
        allowed = _index(mask_rows, mask_ids, device)
        is_allowed = torch.zeros_like(ruled, dtype=torch.bool)
        is_allowed[allowed] = True
        masked = torch.unique(allowed[0])
        ruled[masked] = torch.where(is_allowed[masked], ruled[masked], -torch.inf)
    if ban_rows:
        ruled[_index(ban_rows, ban_ids, device)] = -torch.inf
    if bias_rows:
        values = torch.tensor(bias_values, dtype=dtype, device=device)
        ruled.index_put_(_index(bias_rows, bias_ids, device), values, accumulate=True)
    return logits.to(dtype).index_copy(0, index, ruled)


def _output_ids(history: TokenHistory, entry: int, num_tokens: int) -> list[int]:
    """The ids entry `entry` has generated so far; its sequence holds `num_tokens` ids."""
    start = int(history.num_prompt_tokens[entry])
    return history.token_ids[int(history.rows[entry]), start:num_tokens].tolist()


def _index(rows: list[int], ids: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(ids, dtype=torch.int64, device=device),
    )
