"""PromptLogprobs: a request's prompt logprobs (vLLM's prompt_logprobs), gathered chunk by chunk
from the step replies and sent with its first sampled token.

Prompt token t (1 <= t < num_prompt_tokens) is scored by the logits at position t - 1, so a chunk
of positions [first, first + n) scores tokens first + 1 .. min(first + n, num_prompt_tokens - 1);
the ranks send one entry per such token (worker/sampling/prompt_logprobs.py). Tokens read from
the prefix cache have no logits, so the Scheduler does not read the cache for a request whose
prompt logprobs are incomplete (vLLM skips it for such requests too). A chunk computed again after
a preemption repeats entries already held; they are dropped.
"""

from array import array
from collections.abc import Sequence

from protocol.buffers import unpack_float32, unpack_int32
from protocol.client_messages import TokenLogprobs
from protocol.worker_messages import ModelRunnerOutput


def num_scored_tokens(first_position: int, num_queries: int, num_prompt_tokens: int) -> int:
    """How many prompt tokens the chunk [first_position, first_position + num_queries) scores."""
    return max(0, min(first_position + num_queries, num_prompt_tokens - 1) - first_position)


class PromptLogprobs:
    """The entries of prompt tokens 1, 2, ... received so far, until they are sent.

    Invariants: the three lists have one item per entry, entry i scoring prompt token i + 1.
    """

    __slots__ = ("is_sent", "logprobs", "ranks", "token_ids")

    def __init__(self) -> None:
        self.token_ids: list[list[int]] = []  # the prompt token, then its top-N
        self.logprobs: list[list[float]] = []
        self.ranks: list[int] = []  # the prompt token's rank, 1 the most likely
        self.is_sent = False

    @property
    def num_entries(self) -> int:
        return len(self.ranks)

    def is_complete(self, num_prompt_tokens: int) -> bool:
        return self.num_entries >= num_prompt_tokens - 1

    def add(self, first_token_idx: int, entries: TokenLogprobs) -> None:
        """Entries scoring prompt tokens first_token_idx, first_token_idx + 1, ...; ValueError
        when they leave a gap after the entries held."""
        num_held = self.num_entries
        if first_token_idx > num_held + 1:
            raise ValueError(
                f"prompt logprobs from token {first_token_idx}: expected at most token "
                f"{num_held + 1}, as {num_held} are held"
            )
        skip = num_held + 1 - first_token_idx  # computed again after a preemption
        self.token_ids.extend(entries.token_ids[skip:])
        self.logprobs.extend(entries.logprobs[skip:])
        self.ranks.extend(entries.sampled_token_ranks[skip:])

    def take(self) -> TokenLogprobs:
        """Every entry, once: the request's first output carries them."""
        self.is_sent = True
        return TokenLogprobs(self.token_ids, self.logprobs, self.ranks)

    def check_invariants(self) -> None:
        lengths = {len(self.token_ids), len(self.logprobs), len(self.ranks)}
        assert len(lengths) == 1, f"prompt logprob columns of lengths {sorted(lengths)}"


def read_prompt_logprobs(
    output: ModelRunnerOutput,
    num_prompt_logprobs: Sequence[int | None],
    chunks: Sequence[tuple[int, int]],
    num_prompt_tokens: Sequence[int],
) -> list[TokenLogprobs | None]:
    """Each request's entries in the reply, aligned with the step's requests (their
    prompt_logprobs, (first position, count) of their chunk and prompt length); None for one
    that scored no prompt token. ValueError unless the columns hold exactly those entries."""
    values = unpack_float32(output.prompt_logprobs)
    token_ids = unpack_int32(output.prompt_logprob_token_ids)
    ranks = unpack_int32(output.prompt_logprob_ranks)
    per_request: list[TokenLogprobs | None] = [None] * len(chunks)
    start = num_read = 0
    for idx, (num_logprobs, (first, count)) in enumerate(
        zip(num_prompt_logprobs, chunks, strict=True)
    ):
        num_scored = (
            0 if num_logprobs is None else num_scored_tokens(first, count, num_prompt_tokens[idx])
        )
        if not num_scored:
            continue
        width = 1 + num_logprobs  # type: ignore[operator]  # num_scored > 0: it asked
        end = start + num_scored * width
        if num_read + num_scored > len(ranks) or end > len(values):
            raise ValueError(
                f"rank {output.rank} sent {len(ranks)} prompt logprob entries for step "
                f"{output.step_id}: request {idx} alone needs {num_scored} past entry {num_read}"
            )
        per_request[idx] = TokenLogprobs(
            _rows(token_ids, start, num_scored, width),
            _rows(values, start, num_scored, width),
            ranks[num_read : num_read + num_scored].tolist(),
        )
        start, num_read = end, num_read + num_scored
    if num_read != len(ranks) or start != len(values) or len(values) != len(token_ids):
        raise ValueError(
            f"rank {output.rank} sent {len(ranks)} prompt logprob entries ({len(values)} values, "
            f"{len(token_ids)} ids) for step {output.step_id}: expected {num_read} ({start})"
        )
    return per_request


def _rows(column: array, start: int, num_rows: int, width: int) -> list:
    return [
        column[row : row + width].tolist() for row in range(start, start + num_rows * width, width)
    ]
