"""The routing policies' arithmetic: each engine's outstanding work (EngineLoad) and the kv
policy's cost of a request on each engine (KVScorer). Pure: no sockets, no awaits, no clock.

    cost(e) = prefill_weight * (waiting_prefill_tokens(e) + prompt_tokens - hit_tokens(e))
              + decode_weight * running_decodes(e)
    waiting_prefill_tokens(e) = own(e) + max(0, reported(e) - own(e) when the report was asked),
    likewise running_decodes(e): what this front end has outstanding there now, plus the rest of
    what the engine itself last reported (other clients' work)
    hit_tokens(e) = block_size * (the request's blocks e holds consecutively from block 0, each
                    counted by its medium's weight: GPU 1, CPU 0.5, DISK 0.25), at most the
                    prompt less its last token (which the engine always computes)

The request goes to the engine of least cost; a tie goes to the engine with the longest hit,
then the least outstanding tokens, then the fewest blocks cached (so new prefixes spread over the
engines' caches rather than evict each other on one), then the lowest index: equal events and
load give equal decisions.
"""

from dataclasses import dataclass

DEFAULT_PREFILL_WEIGHT = 1.0
DEFAULT_DECODE_WEIGHT = 8.0  # a running decode costs a step as much as this many prompt tokens


@dataclass(frozen=True, slots=True)
class KVScoreWeights:
    """The kv policy's weights: `--router-prefill-weight` and `--router-decode-weight`."""

    prefill_weight: float = DEFAULT_PREFILL_WEIGHT  # per prompt token still to compute
    decode_weight: float = DEFAULT_DECODE_WEIGHT  # per request decoding

    def __post_init__(self) -> None:
        if self.prefill_weight < 0 or self.decode_weight < 0:
            raise ValueError(
                f"router weights prefill {self.prefill_weight}, decode {self.decode_weight}: "
                "expected >= 0"
            )


class EngineLoad:
    """Each engine's outstanding work: what the front end has sent it and not yet seen finish,
    plus the work of other clients, from the engine's own last load report.

    A request waits (its prompt tokens less its predicted hit count as waiting prefill) until
    its first output, then decodes until it ends. A report (`on_report`) counts everything the
    engine holds, this front end's requests included, and the engine counts a waiting request's
    whole prompt: the others' share is the report less this front end's own requests, whole
    prompts, as they stood when the report was asked (`own_snapshot`). So a burst sent since the
    last report counts at once, and a request of this front end is never counted twice.

    Invariants: every count is >= 0; `num_waiting[i]` and `num_running[i]` count the requests
    of engine i in each state, `waiting_prompt_tokens[i]` their whole prompts while waiting,
    `outstanding_tokens[i]` the prompt plus most new tokens of all.
    """

    def __init__(self, num_engines: int) -> None:
        self.waiting_prefill_tokens = [0] * num_engines
        self.waiting_prompt_tokens = [0] * num_engines
        self.num_waiting = [0] * num_engines
        self.num_running = [0] * num_engines
        self.outstanding_tokens = [0] * num_engines
        self.others_waiting_prefill_tokens = [0] * num_engines  # from the last report
        self.others_running_decodes = [0] * num_engines  # likewise

    def add(
        self, engine_idx: int, num_prefill_tokens: int, num_prompt_tokens: int, num_tokens: int
    ) -> None:
        self.waiting_prefill_tokens[engine_idx] += num_prefill_tokens
        self.waiting_prompt_tokens[engine_idx] += num_prompt_tokens
        self.num_waiting[engine_idx] += 1
        self.outstanding_tokens[engine_idx] += num_tokens

    def start_decoding(
        self, engine_idx: int, num_prefill_tokens: int, num_prompt_tokens: int
    ) -> None:
        """The request's first output came: its prefill is done."""
        self.waiting_prefill_tokens[engine_idx] -= num_prefill_tokens
        self.waiting_prompt_tokens[engine_idx] -= num_prompt_tokens
        self.num_waiting[engine_idx] -= 1
        self.num_running[engine_idx] += 1

    def remove(
        self,
        engine_idx: int,
        num_prefill_tokens: int,
        num_prompt_tokens: int,
        num_tokens: int,
        is_decoding: bool,
    ) -> None:
        """The request ended, in whichever state it was."""
        if is_decoding:
            self.num_running[engine_idx] -= 1
        else:
            self.waiting_prefill_tokens[engine_idx] -= num_prefill_tokens
            self.waiting_prompt_tokens[engine_idx] -= num_prompt_tokens
            self.num_waiting[engine_idx] -= 1
        self.outstanding_tokens[engine_idx] -= num_tokens

    def own_snapshot(self, engine_idx: int) -> tuple[int, int]:
        """This front end's share of a report asked now: (whole prompts waiting, running)."""
        return self.waiting_prompt_tokens[engine_idx], self.num_running[engine_idx]

    def on_report(
        self,
        engine_idx: int,
        waiting_prefill_tokens: int,
        running_decodes: int,
        own_when_asked: tuple[int, int],
    ) -> None:
        """The engine's `get_load`, asked when this front end's share was `own_when_asked`."""
        own_waiting, own_running = own_when_asked
        self.others_waiting_prefill_tokens[engine_idx] = max(
            0, waiting_prefill_tokens - own_waiting
        )
        self.others_running_decodes[engine_idx] = max(0, running_decodes - own_running)

    def forget_report(self, engine_idx: int) -> None:
        """The engine's work is unknown (it stopped answering, or restarted): own count only."""
        self.others_waiting_prefill_tokens[engine_idx] = 0
        self.others_running_decodes[engine_idx] = 0

    def scored_waiting_prefill_tokens(self, engine_idx: int) -> int:
        others = self.others_waiting_prefill_tokens[engine_idx]
        return self.waiting_prefill_tokens[engine_idx] + others

    def scored_running_decodes(self, engine_idx: int) -> int:
        return self.num_running[engine_idx] + self.others_running_decodes[engine_idx]

    def check_invariants(self) -> None:
        names = (
            *("waiting_prefill_tokens", "waiting_prompt_tokens", "num_waiting", "num_running"),
            *("outstanding_tokens", "others_waiting_prefill_tokens", "others_running_decodes"),
        )
        for name in names:
            values = getattr(self, name)
            assert min(values, default=0) >= 0, f"negative {name}: {values}"
        for idx, prefill in enumerate(self.waiting_prefill_tokens):
            assert prefill <= self.waiting_prompt_tokens[idx], (
                f"engine {idx}: {prefill} prefill tokens waiting of "
                f"{self.waiting_prompt_tokens[idx]} prompt tokens"
            )


def predicted_hit_tokens(weighted_blocks: float, block_size: int, num_prompt_tokens: int) -> int:
    """Prompt tokens an engine holding `weighted_blocks` of the prompt would not compute."""
    cap = (max(0, num_prompt_tokens - 1) // block_size) * block_size
    return min(cap, int(weighted_blocks * block_size))


class KVScorer:
    """Chooses the engine of least cost (the module's formula) among the candidates."""

    def __init__(self, weights: KVScoreWeights, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"kv scorer block_size {block_size}: expected >= 1")
        self.weights = weights
        self.block_size = block_size

    def costs(
        self, weighted_hits: list[float], num_prompt_tokens: int, load: EngineLoad
    ) -> list[float]:
        weights = self.weights
        return [
            weights.prefill_weight
            * (
                load.scored_waiting_prefill_tokens(idx)
                + num_prompt_tokens
                - predicted_hit_tokens(hit, self.block_size, num_prompt_tokens)
            )
            + weights.decode_weight * load.scored_running_decodes(idx)
            for idx, hit in enumerate(weighted_hits)
        ]

    def choose(
        self,
        weighted_hits: list[float],
        num_prompt_tokens: int,
        load: EngineLoad,
        candidates: list[int],
        num_cached_blocks: list[int],
    ) -> int:
        """The candidate of least cost; `weighted_hits[i]` is 0 where engine i is not indexed,
        `num_cached_blocks[i]` the blocks its index holds."""
        if not candidates:
            raise LookupError(f"no engine available among {len(weighted_hits)}")
        costs = self.costs(weighted_hits, num_prompt_tokens, load)
        outstanding = load.outstanding_tokens
        return min(
            candidates,
            key=lambda idx: (
                *(costs[idx], -weighted_hits[idx], outstanding[idx]),
                *(num_cached_blocks[idx], idx),
            ),
        )
