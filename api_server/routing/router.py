"""Router: the engine each request goes to under `--router-policy` (a RoutingPolicy), and the
counts /metrics shows of its decisions, kept in each engine's record. Pure policy: no sockets,
no awaits; the engine pool asks it and reports each request's first output and end. It is the
front end's only router: the policies it applies are named for what they weigh.

Policies: `kv` (the engines' own KV events, kv_scorer.py's formula; first-block's rule while no
engine's events are followed), `first-block` (the engine that last served the prompt's first
block, FirstBlockAffinity), `least-loaded` (fewest outstanding tokens) and `round-robin`.
"""

import enum
from dataclasses import dataclass

from api_server.routing.engine_record import EngineRecord
from api_server.routing.first_block import FirstBlockAffinity
from api_server.routing.kv_index import KVBlockIndex, index_key
from api_server.routing.kv_scorer import KVScorer, KVScoreWeights, predicted_hit_tokens
from kv_hashing.block_hasher import BlockHasher, BlockHashListWithBlockSize, first_block_extra_keys
from kv_hashing.hash_params import HashParams

ROUTED_GROUP_IDX = 0  # the KV-cache group whose cached prefix the kv policy weighs


class RoutingPolicy(enum.Enum):
    """The values of `--router-policy`."""

    KV = "kv"
    FIRST_BLOCK = "first-block"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


ROUTING_POLICIES = tuple(policy.value for policy in RoutingPolicy)
DEFAULT_ROUTING_POLICY = RoutingPolicy.KV


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request went, and what the router expected there."""

    engine_idx: int
    predicted_hit_tokens: int | None  # None when no index of that engine was usable
    num_prefill_tokens: int  # prompt tokens the load counts as waiting until the first output
    num_tokens: int  # prompt plus the most tokens the request may generate
    num_prompt_tokens: int
    is_first_block: bool = False  # chosen by the first-block policy


class RequestHasher:
    """A request's prefix-cache keys for the routed group, hashed as the engines hash them."""

    def __init__(self, params: HashParams) -> None:
        self.params = params
        self.hasher = BlockHasher(params.block_size, params.algo, params.hash_seed)  # type: ignore[arg-type]

    def keys(self, prompt_token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """Keys of the blocks an engine may serve from its cache: the engine always computes a
        prompt's last token, so only blocks within the tokens before it."""
        tokens = prompt_token_ids[: max(0, len(prompt_token_ids) - 1)]
        hashes = self.hasher.hash_prefix(tokens, first_block_extra_keys(cache_salt))
        view = BlockHashListWithBlockSize(
            hashes, self.params.block_size, self.params.group_block_size
        )
        return [index_key(block_hash, ROUTED_GROUP_IDX) for block_hash in view.snapshot()]


class Router:
    """Chooses an engine per request under one policy; counts each request in its engine's
    record (EngineLoad) from the decision to its release, and the decisions and hit predictions
    in the record too.

    Invariants: the records' loads count exactly the decisions not yet released; a record's
    `num_decisions` counts the requests sent to its engine; predicted and actual hit tokens are
    summed over the same requests.
    """

    def __init__(
        self,
        records: list[EngineRecord],
        block_size: int,
        policy: RoutingPolicy = DEFAULT_ROUTING_POLICY,
        weights: KVScoreWeights | None = None,
    ) -> None:
        self.records = records
        self.num_engines = len(records)
        self.policy = policy
        self.block_size = block_size
        self.weights = weights or KVScoreWeights()
        self.first_block = FirstBlockAffinity(records, block_size)
        self.hasher: RequestHasher | None = None  # once the engines announced their HashParams
        self.scorer = KVScorer(self.weights, block_size)
        self._next_round_robin = 0

    def choose(
        self,
        prompt_token_ids: list[int],
        num_tokens: int,
        cache_salt: str | None,
        is_available: list[bool],
        index: KVBlockIndex | None,
        is_indexed: list[bool],
    ) -> Decision:
        """The engine for a request; `is_indexed[i]`: engine i's index is current (its stream
        answers), so its cached prefix counts. Counts the request as waiting there."""
        candidates = [idx for idx in range(self.num_engines) if is_available[idx]]
        if not candidates:
            raise LookupError(f"no engine available among {self.num_engines}")
        weighted = [0.0] * self.num_engines
        has_index = index is not None and self.hasher is not None and any(is_indexed)
        if has_index:
            keys = self.hasher.keys(prompt_token_ids, cache_salt)  # type: ignore[union-attr]
            hits = index.prefix_hits(keys)  # type: ignore[union-attr]
            weighted = [hit if is_indexed[idx] else 0.0 for idx, (_, hit) in enumerate(hits)]
        num_cached = [0] * self.num_engines
        if index is not None:
            num_cached = [index.num_blocks(idx) for idx in range(self.num_engines)]
        is_first_block = self.policy is RoutingPolicy.FIRST_BLOCK or (
            self.policy is RoutingPolicy.KV and not has_index
        )
        if is_first_block:  # kv with no engine indexed falls back to first-block's guess
            is_available = [idx in candidates for idx in range(self.num_engines)]
            engine_idx = self.first_block.choose(prompt_token_ids, is_available)
        else:
            engine_idx = self._pick(prompt_token_ids, candidates, weighted, num_cached)
        predicted = None
        if has_index and is_indexed[engine_idx]:
            num_prompt = len(prompt_token_ids)
            predicted = predicted_hit_tokens(weighted[engine_idx], self.block_size, num_prompt)
        num_prefill = len(prompt_token_ids) - (predicted or 0)
        num_prompt = len(prompt_token_ids)
        self._count(engine_idx, num_prefill, num_prompt, num_tokens)
        return Decision(engine_idx, predicted, num_prefill, num_tokens, num_prompt, is_first_block)

    def follow(self, engine_idx: int, prompt_token_ids: list[int], num_tokens: int) -> Decision:
        """A request that must go where an earlier one went (a choice of `n`, sharing the first
        choice's prompt blocks): counted as waiting there, its whole prompt as prefill."""
        if not 0 <= engine_idx < self.num_engines:
            raise ValueError(f"engine {engine_idx}: expected 0..{self.num_engines - 1}")
        num_prompt = len(prompt_token_ids)
        self._count(engine_idx, num_prompt, num_prompt, num_tokens)
        return Decision(engine_idx, None, num_prompt, num_tokens, num_prompt)

    def _count(
        self, engine_idx: int, num_prefill_tokens: int, num_prompt_tokens: int, num_tokens: int
    ) -> None:
        """A request goes to `engine_idx`: it waits there until its first output."""
        record = self.records[engine_idx]
        record.load.add(num_prefill_tokens, num_prompt_tokens, num_tokens)
        record.num_decisions += 1

    def choose_by_load(
        self, prompt_token_ids: list[int], num_tokens: int, is_available: list[bool]
    ) -> Decision:
        """The available engine with the least outstanding work (what a decode engine is chosen
        by under P/D, whatever the policy: its cache holds little it could reuse). Counts the
        request as waiting there, its whole prompt as prefill."""
        candidates = [idx for idx in range(self.num_engines) if is_available[idx]]
        if not candidates:
            raise LookupError(f"no engine available among {self.num_engines}")
        loads = [record.load for record in self.records]
        engine_idx = min(
            candidates,
            key=lambda idx: (
                loads[idx].scored_running_decodes + loads[idx].num_waiting,
                loads[idx].outstanding_tokens,
                idx,
            ),
        )
        num_prompt = len(prompt_token_ids)
        self._count(engine_idx, num_prompt, num_prompt, num_tokens)
        return Decision(engine_idx, None, num_prompt, num_tokens, num_prompt)

    def _pick(
        self,
        prompt_token_ids: list[int],
        candidates: list[int],
        weighted: list[float],
        num_cached: list[int],
    ) -> int:
        """The engine under kv (with an index), least-loaded or round-robin."""
        outstanding = [record.load.outstanding_tokens for record in self.records]
        match self.policy:
            case RoutingPolicy.KV:
                num_prompt = len(prompt_token_ids)
                records = self.records
                return self.scorer.choose(weighted, num_prompt, records, candidates, num_cached)
            case RoutingPolicy.LEAST_LOADED:
                return min(candidates, key=lambda idx: (outstanding[idx], idx))
            case RoutingPolicy.ROUND_ROBIN:
                start = self._next_round_robin
                engine_idx = min(candidates, key=lambda idx: (idx - start) % self.num_engines)
                self._next_round_robin = (engine_idx + 1) % self.num_engines
                return engine_idx
            case RoutingPolicy.FIRST_BLOCK:
                raise AssertionError("first-block decisions are taken in choose()")

    def on_first_output(self, decision: Decision, num_cached_tokens: int) -> None:
        """The request's prefill ended; the engine served `num_cached_tokens` from its cache."""
        record = self.records[decision.engine_idx]
        record.load.start_decoding(decision.num_prefill_tokens, decision.num_prompt_tokens)
        if decision.predicted_hit_tokens is not None:
            record.num_predicted += 1
            record.predicted_hit_tokens += decision.predicted_hit_tokens
            record.actual_hit_tokens += num_cached_tokens

    def release(self, decision: Decision, is_decoding: bool) -> None:
        """The request ended: after its first output when `is_decoding`, else before it."""
        self.records[decision.engine_idx].load.remove(
            decision.num_prefill_tokens,
            decision.num_prompt_tokens,
            decision.num_tokens,
            is_decoding,
        )

    def check_invariants(self) -> None:
        for record in self.records:
            record.load.check_invariants(record.engine_idx)
            assert record.num_decisions >= record.num_predicted, (
                f"engine {record.engine_idx}: {record.num_predicted} predictions for "
                f"{record.num_decisions} decisions"
            )
        self.first_block.check_invariants()
