"""The routing policies' arithmetic: each engine's outstanding work (EngineLoad) and the kv
policy's cost of a request on each engine (KVScorer). Pure: no sockets, no awaits, no clock.

    cost(e) = prefill_weight * (waiting_prefill_tokens(e) + prompt_tokens - hit_tokens(e))
              + decode_weight * running_decodes(e)
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
    """What the front end has sent each engine and not yet seen finish.

    A request waits (its prompt tokens less its predicted hit count as waiting prefill) until
    its first output, then decodes until it ends.

    Invariants: every count is >= 0; `num_waiting[i]` and `num_running[i]` count the requests
    of engine i in each state, `outstanding_tokens[i]` the prompt plus most new tokens of all.
    """

    def __init__(self, num_engines: int) -> None:
        self.waiting_prefill_tokens = [0] * num_engines
        self.num_waiting = [0] * num_engines
        self.num_running = [0] * num_engines
        self.outstanding_tokens = [0] * num_engines

    def add(self, engine_idx: int, num_prefill_tokens: int, num_tokens: int) -> None:
        self.waiting_prefill_tokens[engine_idx] += num_prefill_tokens
        self.num_waiting[engine_idx] += 1
        self.outstanding_tokens[engine_idx] += num_tokens

    def start_decoding(self, engine_idx: int, num_prefill_tokens: int) -> None:
        """The request's first output came: its prefill is done."""
        self.waiting_prefill_tokens[engine_idx] -= num_prefill_tokens
        self.num_waiting[engine_idx] -= 1
        self.num_running[engine_idx] += 1

    def remove(
        self, engine_idx: int, num_prefill_tokens: int, num_tokens: int, is_decoding: bool
    ) -> None:
        """The request ended, in whichever state it was."""
        if is_decoding:
            self.num_running[engine_idx] -= 1
        else:
            self.waiting_prefill_tokens[engine_idx] -= num_prefill_tokens
            self.num_waiting[engine_idx] -= 1
        self.outstanding_tokens[engine_idx] -= num_tokens

    def check_invariants(self) -> None:
        for name in ("waiting_prefill_tokens", "num_waiting", "num_running", "outstanding_tokens"):
            values = getattr(self, name)
            assert min(values, default=0) >= 0, f"negative {name}: {values}"


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
                load.waiting_prefill_tokens[idx]
                + num_prompt_tokens
                - predicted_hit_tokens(hit, self.block_size, num_prompt_tokens)
            )
            + weights.decode_weight * load.num_running[idx]
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
