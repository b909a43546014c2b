"""Sampling columns: each request's sampling settings as arrays, read by a step without visiting
its requests one by one; a feature no request uses is a None column, and costs nothing.

SamplingTable keeps them per InputBatch row; SamplingColumns holds one step's sampled requests.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protocol.sampling import SamplingParams

TOP_K_ALL = np.iinfo(np.int64).max  # top_k column entry of a request that keeps every id
NO_LOGPROBS = -1  # num_logprobs column entry of a request that asked for no logprobs


def _has_filter(params: SamplingParams) -> bool:
    """Filters matter only to a draw: greedy keeps the top id whatever they say."""
    return params.temperature > 0 and (
        params.top_k is not None or params.top_p < 1.0 or params.min_p > 0.0
    )


def has_logit_rules(params: SamplingParams) -> bool:
    """Whether a request sets a rule of worker/sampling/logit_processors.py (an empty
    logit_bias sets none)."""
    return bool(params.logit_bias or params.allowed_token_ids or params.bad_words_token_ids)


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


@dataclass(frozen=True, slots=True)
class SamplingColumns:
    """The settings of one step's sampled requests, entry i for the i-th; a group of columns is
    None when no entry uses it (all greedy, no filter, no penalty, no logprobs)."""

    temperature: np.ndarray | None = None  # float64 [S]; 0 is greedy
    top_k: np.ndarray | None = None  # int64 [S]; TOP_K_ALL keeps every id
    top_p: np.ndarray | None = None  # float64 [S]; 1 keeps every id
    min_p: np.ndarray | None = None  # float64 [S]; 0 keeps every id
    presence_penalty: np.ndarray | None = None  # float64 [S]
    frequency_penalty: np.ndarray | None = None  # float64 [S]
    repetition_penalty: np.ndarray | None = None  # float64 [S]; 1 is none
    num_logprobs: np.ndarray | None = None  # int64 [S]; NO_LOGPROBS for an entry without
    min_tokens: np.ndarray | None = None  # int64 [S]; None: no entry holds back its stop ids
    # bool [S]: the entry sets logit_bias, allowed_token_ids or bad words (logit_processors.py)
    logit_rules: np.ndarray | None = None

    @property
    def has_filters(self) -> bool:
        return self.top_k is not None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty is not None

    @property
    def needs_history(self) -> bool:
        """Penalties and bad words read the sequences; min_tokens counts their outputs."""
        return (
            self.repetition_penalty is not None
            or self.min_tokens is not None
            or self.logit_rules is not None
        )

    @classmethod
    def from_params(cls, sampling_params: Sequence[SamplingParams]) -> "SamplingColumns":
        """The columns of requests given one by one (the reference model, tests)."""
        table = SamplingTable(len(sampling_params))
        for row, params in enumerate(sampling_params):
            table.add_row(row, params)
        return table.take(np.arange(len(sampling_params), dtype=np.int64))


class SamplingTable:
    """Sampling settings per batch row, with counts of the rows using each feature.

    Invariants: the counts are those of the live rows' settings (the caller adds and removes
    rows as its batch does); a row without a request holds the neutral settings.
    """

    def __init__(self, num_rows: int) -> None:
        self.temperature = np.zeros(num_rows, dtype=np.float64)  # [rows]
        self.top_k = np.full(num_rows, TOP_K_ALL, dtype=np.int64)  # [rows]
        self.top_p = np.ones(num_rows, dtype=np.float64)  # [rows]
        self.min_p = np.zeros(num_rows, dtype=np.float64)  # [rows]
        self.presence_penalty = np.zeros(num_rows, dtype=np.float64)  # [rows]
        self.frequency_penalty = np.zeros(num_rows, dtype=np.float64)  # [rows]
        self.repetition_penalty = np.ones(num_rows, dtype=np.float64)  # [rows]
        self.num_logprobs = np.full(num_rows, NO_LOGPROBS, dtype=np.int64)  # [rows]
        self.min_tokens = np.zeros(num_rows, dtype=np.int64)  # [rows]
        self.logit_rules = np.zeros(num_rows, dtype=np.bool_)  # [rows]
        # prompt_logprobs per row, NO_LOGPROBS for none; the runner reads it, not the sampler
        self.num_prompt_logprobs = np.full(num_rows, NO_LOGPROBS, dtype=np.int64)  # [rows]
        self.num_random_rows = 0  # temperature > 0
        self.num_filtered_rows = 0  # temperature > 0 and some filter set
        self.num_penalized_rows = 0
        self.num_logprob_rows = 0
        self.num_min_tokens_rows = 0  # min_tokens > 0
        self.num_logit_rule_rows = 0  # logit_bias, allowed_token_ids or bad words
        self.num_prompt_logprob_rows = 0

    def add_row(self, row: int, params: SamplingParams) -> None:
        self.temperature[row] = params.temperature
        self.top_k[row] = TOP_K_ALL if params.top_k is None else params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.num_logprobs[row] = NO_LOGPROBS if params.logprobs is None else params.logprobs
        self.min_tokens[row] = params.min_tokens
        self.logit_rules[row] = has_logit_rules(params)
        prompt_logprobs = params.prompt_logprobs
        self.num_prompt_logprobs[row] = NO_LOGPROBS if prompt_logprobs is None else prompt_logprobs
        self._count(params, 1)

    def remove_row(self, row: int, params: SamplingParams) -> None:
        """Uncount the request of `row` (its settings `params`) and reset the row."""
        self._count(params, -1)
        self._reset(row)

    def move_row(self, src: int, tgt: int) -> None:
        """Move the settings of `src` to `tgt` and reset `src`; the counts stay."""
        for column in self._columns():
            column[tgt] = column[src]
        self._reset(src)

    def grow(self, num_rows: int) -> None:
        extra = num_rows - len(self.temperature)
        fresh = SamplingTable(extra)
        for name in _COLUMN_NAMES:
            setattr(self, name, np.concatenate((getattr(self, name), getattr(fresh, name))))

    def take(self, rows: np.ndarray) -> SamplingColumns:
        """The columns of `rows` (int64), in order, leaving out the features none of them use
        because no row at all uses them."""
        filtered = self.num_filtered_rows > 0
        penalized = self.num_penalized_rows > 0
        return SamplingColumns(
            temperature=self.temperature[rows] if self.num_random_rows else None,
            top_k=self.top_k[rows] if filtered else None,
            top_p=self.top_p[rows] if filtered else None,
            min_p=self.min_p[rows] if filtered else None,
            presence_penalty=self.presence_penalty[rows] if penalized else None,
            frequency_penalty=self.frequency_penalty[rows] if penalized else None,
            repetition_penalty=self.repetition_penalty[rows] if penalized else None,
            num_logprobs=self.num_logprobs[rows] if self.num_logprob_rows else None,
            min_tokens=self.min_tokens[rows] if self.num_min_tokens_rows else None,
            logit_rules=self.logit_rules[rows] if self.num_logit_rule_rows else None,
        )

    def _count(self, params: SamplingParams, delta: int) -> None:
        self.num_random_rows += delta * (params.temperature > 0)
        self.num_filtered_rows += delta * _has_filter(params)
        self.num_penalized_rows += delta * _has_penalty(params)
        self.num_logprob_rows += delta * (params.logprobs is not None)
        self.num_min_tokens_rows += delta * (params.min_tokens > 0)
        self.num_logit_rule_rows += delta * has_logit_rules(params)
        self.num_prompt_logprob_rows += delta * (params.prompt_logprobs is not None)

    def _reset(self, row: int) -> None:
        neutral = _NEUTRAL
        for name, column in zip(_COLUMN_NAMES, self._columns(), strict=True):
            column[row] = neutral[name]

    def _columns(self) -> list[np.ndarray]:
        return [getattr(self, name) for name in _COLUMN_NAMES]

    def check_invariants(self, live_params: Sequence[SamplingParams]) -> None:
        """Rows 0.. hold `live_params` (the live rows' settings, in row order), the counts are
        theirs, and every other row is neutral."""
        expected = SamplingTable(len(self.temperature))
        for row, params in enumerate(live_params):
            expected.add_row(row, params)
        columns = zip(_COLUMN_NAMES, self._columns(), expected._columns(), strict=True)
        for name, column, want in columns:
            rows = np.flatnonzero(column != want)
            assert not len(rows), f"sampling column {name} holds {column[rows]} at rows {rows}"
        counts = (
            sum(params.temperature > 0 for params in live_params),
            sum(_has_filter(params) for params in live_params),
            sum(_has_penalty(params) for params in live_params),
            sum(params.logprobs is not None for params in live_params),
            sum(params.min_tokens > 0 for params in live_params),
            sum(has_logit_rules(params) for params in live_params),
            sum(params.prompt_logprobs is not None for params in live_params),
        )
        held = (
            self.num_random_rows,
            self.num_filtered_rows,
            self.num_penalized_rows,
            self.num_logprob_rows,
            self.num_min_tokens_rows,
            self.num_logit_rule_rows,
            self.num_prompt_logprob_rows,
        )
        assert held == counts, f"sampling feature counts are {held}, expected {counts}"


_COLUMN_NAMES = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "num_logprobs",
    "min_tokens",
    "logit_rules",
    "num_prompt_logprobs",
)
_NEUTRAL = {
    "temperature": 0.0,
    "top_k": TOP_K_ALL,
    "top_p": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "num_logprobs": NO_LOGPROBS,
    "min_tokens": 0,
    "logit_rules": False,
    "num_prompt_logprobs": NO_LOGPROBS,
}
