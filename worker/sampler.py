"""Sampler: greedy or seeded temperature sampling from logits, the same on every rank.

Per request, in this order: its logit rules (allowed_token_ids, bad words, logit_bias;
worker/sampling/logit_processors.py); until it has min_tokens outputs, -inf for its stop and EOS ids
(vLLM's rule: it cannot stop early); penalties on the logits (worker/sampling/penalties.py), greedy
argmax or, at temperature > 0, probabilities rounded to a 2**-16 grid, the min-p, top-k and top-p
filters on that grid (worker/sampling/filters.py), and an inverse-CDF draw. A draw depends only on
(seed, position of the token being sampled): no generator carries state, so batching, chunking,
preemption and TP size cannot change a seeded request's tokens. On the grid the running sums are
exact, so every rank holding the same logits picks the same token.

Where floats enter (real checkpoints; the fake models' logits are exact, so none of this applies
to them): the logits of one sequence differ in their last bits between batch compositions, TP
sizes and kernels, and so do the penalized logits and exp(). Rounded to the grid, a probability
within that difference of a grid midpoint may land one grid step away; then a top-k, top-p or
min-p cut lying exactly there may keep one id more or less, and the running sums move by a step.
A draw changes only where its uniform number lands within that step of a boundary of the running
sums, and greedy only where the top two logits are within the difference. So two runs of one
seeded request agree up to such near-ties, while the ranks of one deployment always agree: the
all-reduce leaves them identical logits bytes. Logprobs (float32) may differ in their last bits
between runs alike. The grid also means an id whose probability is below 2**-17 of the top one's
is never drawn.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocol.sampling import SamplingParams
from worker.sampling.candidates import grid_candidates
from worker.sampling.columns import SamplingColumns
from worker.sampling.filters import filter_probabilities
from worker.sampling.logit_processors import apply_logit_rules
from worker.sampling.penalties import TokenHistory, apply_penalties

_MASK_64 = (1 << 64) - 1
_NUMPY_ARGMAX_DTYPES = (torch.float64, torch.float32)


SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_MUL_1 = 0xBF58476D1CE4E5B9
SPLITMIX_MUL_2 = 0x94D049BB133111EB


def splitmix64(value: int) -> int:
    """A fixed 64-bit mixing function (Steele, Lea and Flood's SplitMix64 finalizer)."""
    z = (value + SPLITMIX_GAMMA) & _MASK_64
    z = ((z ^ (z >> 30)) * SPLITMIX_MUL_1) & _MASK_64
    z = ((z ^ (z >> 27)) * SPLITMIX_MUL_2) & _MASK_64
    return z ^ (z >> 31)


def uniform_draw(seed: int, position: int) -> float:
    """A number in [0, 1) fixed by (seed, position), with 53 random bits."""
    return (splitmix64(splitmix64(seed) ^ position) >> 11) / float(1 << 53)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [S] int64, the first maximum on a tie (a NaN counts as the maximum).

    On the CPU numpy's vectorized argmax takes about a sixth of torch's time for float64 rows.
    """
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_ARGMAX_DTYPES:
        tokens = logits.detach().numpy().argmax(axis=-1)
        return torch.from_numpy(tokens.astype(np.int64, copy=False))
    return torch.argmax(logits, dim=-1)


@dataclass(frozen=True, slots=True)
class SampleBatch:
    """What the sampler needs of each row of logits, as columns of one length."""

    handles: Sequence[int]  # the requests' engine handles; seed unseeded temperature sampling
    sampling_params: Sequence[SamplingParams]
    positions: Sequence[int]  # position each sampled token will take in its sequence
    # The settings as arrays (the runner keeps them per row); None: derived from sampling_params
    columns: SamplingColumns | None = None
    history: TokenHistory | None = None  # each sequence so far; for penalties and min_tokens

    def __post_init__(self) -> None:
        lengths = {len(self.handles), len(self.sampling_params), len(self.positions)}
        if len(lengths) != 1:
            raise ValueError(
                f"sample batch of {len(self.handles)} handles, {len(self.sampling_params)} "
                f"sampling params and {len(self.positions)} positions: expected one length"
            )
        if self.columns is None:
            object.__setattr__(self, "columns", SamplingColumns.from_params(self.sampling_params))
        if self.sampling_columns.needs_history and self.history is None:
            raise ValueError(
                "sample batch has penalized or min_tokens requests but no token history"
            )

    @property
    def sampling_columns(self) -> SamplingColumns:
        assert self.columns is not None  # set by __post_init__
        return self.columns

    @classmethod
    def one(
        cls,
        handle: int,
        sampling_params: SamplingParams,
        position: int,
        history: TokenHistory | None = None,
    ) -> "SampleBatch":
        return cls([handle], [sampling_params], [position], history=history)

    def __len__(self) -> int:
        return len(self.handles)


class Sampler:
    """Turns logits rows into token ids; stateless apart from the seed for unseeded requests
    and the model's EOS ids (held back under min_tokens)."""

    def __init__(self, default_seed: int = 0, eos_token_ids: Sequence[int] = ()) -> None:
        self.default_seed = default_seed
        self.eos_token_ids = list(eos_token_ids)

    def sample(self, logits: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
        """Token ids [S] int64 for logits [S, V], one row per batch entry in order; `logits`
        are left as they are (logprobs read them raw).

        Greedy rows cost one argmax over all rows; penalties and temperature look only at the
        rows that have them, and a batch where no row has one skips that pass.
        """
        if logits.shape[0] != len(batch):
            raise ValueError(f"got {logits.shape[0]} logits rows for {len(batch)} requests")
        columns = batch.sampling_columns
        if columns.needs_history:
            assert batch.history is not None  # checked by SampleBatch
            positions = np.asarray(batch.positions, dtype=np.int64)
            if columns.logit_rules is not None:
                rows = np.flatnonzero(columns.logit_rules)
                params = batch.sampling_params
                logits = apply_logit_rules(logits, rows, params, batch.history, positions)
            if columns.min_tokens is not None:
                logits = self._hold_back_stops(logits, batch, batch.history, positions)
            if columns.has_penalties:
                logits = apply_penalties(logits, columns, batch.history, positions)
        tokens = greedy_tokens(logits)
        if columns.temperature is not None:
            hot = np.flatnonzero(columns.temperature > 0).tolist()
            if hot:
                rows = torch.tensor(hot, dtype=torch.int64, device=logits.device)
                hot_logits = logits if len(hot) == len(batch) else logits[rows]  # no copy if all
                tokens[rows] = self._sample_with_temperature(hot_logits, batch, hot)
        return tokens

    def _hold_back_stops(
        self, logits: torch.Tensor, batch: SampleBatch, history: TokenHistory, positions: np.ndarray
    ) -> torch.Tensor:
        """`logits` with -inf at the stop ids (EOS ids too, unless ignore_eos) of each entry that
        has fewer than min_tokens outputs (a copy where there is one). The engine's stop rule
        ignores them there anyway; masking makes the model say something else, as vLLM does."""
        min_tokens = batch.sampling_columns.min_tokens
        assert min_tokens is not None  # the caller checked
        short = np.flatnonzero(positions - history.num_prompt_tokens < min_tokens).tolist()
        rows: list[int] = []
        ids: list[int] = []
        for row in short:
            params = batch.sampling_params[row]
            row_ids = [*params.stop_token_ids, *([] if params.ignore_eos else self.eos_token_ids)]
            rows.extend([row] * len(row_ids))
            ids.extend(row_ids)
        if not ids:
            return logits
        held = logits.clone()
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(ids, device=device))
        held[index] = -torch.inf
        return held

    def _sample_with_temperature(
        self, logits: torch.Tensor, batch: SampleBatch, hot: list[int]
    ) -> torch.Tensor:
        """Inverse-CDF draw from softmax(logits / temperature), filtered, with per-position
        uniform numbers; `logits` are the rows of batch entries `hot`."""
        device = logits.device
        params, handles, positions = batch.sampling_params, batch.handles, batch.positions
        columns = batch.sampling_columns
        assert columns.temperature is not None  # the caller found hot rows in it
        temps = torch.from_numpy(columns.temperature[hot]).to(device)
        # only ids that can be nonzero on the grid take part (worker/sampling/candidates.py):
        # the running sums, the filters and so the drawn ids are those of the whole rows
        ids, probs = grid_candidates(logits, temps)  # each [S, K]; probs' max entry is 1
        if columns.has_filters:
            assert columns.top_k is not None and columns.top_p is not None
            assert columns.min_p is not None
            top_k = np.minimum(columns.top_k[hot], probs.shape[1])  # past K: every candidate
            probs = filter_probabilities(probs, top_k, columns.top_p[hot], columns.min_p[hot])
        cumulative = torch.cumsum(probs, dim=-1)  # exact on the grid
        draws = torch.tensor(
            [uniform_draw(self._seed(params[i], handles[i]), positions[i]) for i in hot],
            dtype=torch.float64,
            device=device,
        )
        targets = draws * cumulative[:, -1]
        picked = (cumulative <= targets[:, None]).sum(dim=-1)  # the first slot past the target
        picked = torch.clamp(picked, max=probs.shape[1] - 1)
        return ids.gather(1, picked[:, None])[:, 0]

    def _seed(self, sampling_params: SamplingParams, handle: int) -> int:
        seed = sampling_params.seed
        return seed if seed is not None else splitmix64((self.default_seed << 32) ^ handle)
