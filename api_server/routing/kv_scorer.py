"""The kv policy's cost of a request on each engine (KVScorer), over each engine's outstanding
work as its record's EngineLoad counts it. Pure: no sockets, no awaits, no clock.

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

from api_server.routing.engine_record import EngineRecord

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
        self, weighted_hits: list[float], num_prompt_tokens: int, records: list[EngineRecord]
    ) -> list[float]:
        weights = self.weights
        return [
            weights.prefill_weight
            * (
                record.load.scored_waiting_prefill_tokens
                + num_prompt_tokens
                - predicted_hit_tokens(hit, self.block_size, num_prompt_tokens)
            )
            + weights.decode_weight * record.load.scored_running_decodes
            for record, hit in zip(records, weighted_hits, strict=True)
        ]

    def choose(
        self,
        weighted_hits: list[float],
        num_prompt_tokens: int,
        records: list[EngineRecord],
        candidates: list[int],
        num_cached_blocks: list[int],
    ) -> int:
        """The candidate of least cost; `weighted_hits[i]` is 0 where engine i is not indexed,
        `num_cached_blocks[i]` the blocks its index holds."""
        if not candidates:
            raise LookupError(f"no engine available among {len(weighted_hits)}")
        costs = self.costs(weighted_hits, num_prompt_tokens, records)
        return min(
            candidates,
            key=lambda idx: (
                *(costs[idx], -weighted_hits[idx], records[idx].load.outstanding_tokens),
                *(num_cached_blocks[idx], idx),
            ),
        )
