"""EnginePool: one EngineHandle (an AsyncEngineClient) per engine address, their health, their
routing info (hash parameters and KV-event endpoints), and routing through the Router over the
KVEventSubscriber's index. It owns the clients; it never decodes engine messages itself.

What the pool, the router and the subscriber know of each engine lives in one EngineRecord per
engine (engine_record.py): the pool makes the records and hands the same list to each of them.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from api_server.routing.disaggregated import (
    DisaggregatedFlow,
    announced_layout,
    describe_layout_mismatch,
)
from api_server.routing.engine_handle import EngineHandle
from api_server.routing.engine_record import EngineRecord, StreamSource, engine_records
from api_server.routing.kv_event_subscriber import (
    DEFAULT_SILENT_LIMIT_S,
    KVEventSubscriber,
    subscribable_endpoint,
)
from api_server.routing.kv_scorer import KVScoreWeights
from api_server.routing.router import (
    DEFAULT_ROUTING_POLICY,
    RequestHasher,
    Router,
    RoutingPolicy,
)
from engine_client.errors import EngineConnectionLost, EngineDeadError, UtilityCallError
from kv_hashing.hash_params import HashParams, hash_params_mismatch
from protocol.client_messages import EngineCoreOutput, EngineCoreRequest
from protocol.config import CurveKeys

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0  # between two health checks of every engine
STATS_TIMEOUT_S = 2.0


@dataclass(slots=True)
class ChoiceGroup:
    """The choices of one prompt (`n` > 1, api_server/openai/parallel_sampling.py): where the
    first was routed, for the others to follow."""

    engine_idx: int | None = None  # None until the first choice is routed


class EnginePool:
    """Several engines behind one front end.

    Invariants: `records[i]` is `handles[i].record`, the one record of engine i; the records'
    loads count exactly the requests inside `generate` on each engine; an engine is healthy only
    after it answered check_health, and stops being so at its first disconnect or unanswered
    check; `hash_params` are those of the first engine (in flag order) that announced any, and an
    engine announcing others is never routed to.
    """

    def __init__(
        self,
        addresses: list[str],
        block_size: int,
        timeout_s: float,
        curve: CurveKeys | None = None,
        policy: RoutingPolicy = DEFAULT_ROUTING_POLICY,
        weights: KVScoreWeights | None = None,
        silent_limit_s: float = DEFAULT_SILENT_LIMIT_S,
    ) -> None:
        if not addresses:
            raise ValueError("engine pool of 0 addresses: expected at least one")
        self.records = engine_records(addresses)
        self.handles = [EngineHandle(record, timeout_s, curve) for record in self.records]
        self.router = Router(self.records, block_size, policy, weights)
        self.hash_params: HashParams | None = None  # the fleet's, from the first announcement
        self.subscriber: KVEventSubscriber | None = None  # made in start(), inside the loop
        self._curve = curve
        self._silent_limit_s = silent_limit_s
        self._health_task: asyncio.Task[None] | None = None
        self.disaggregated = DisaggregatedFlow(self)

    def start(self) -> None:
        self.subscriber = KVEventSubscriber(self.records, self._curve, self._silent_limit_s)
        self._health_task = asyncio.ensure_future(self._watch_health())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.subscriber is not None:
            await self.subscriber.close()
        await self.disaggregated.close()
        for handle in self.handles:
            await handle.client.close()

    async def _watch_health(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def check_health(self) -> list[bool]:
        """Ask every engine now; whether each answered. Then follow what they announced."""
        checks = (self._check_engine(handle) for handle in self.handles)
        answers = list(await asyncio.gather(*checks))
        announced = [record.hash_params for record in self.records if record.hash_params]
        if announced and announced[0] != self.hash_params:  # the first engine, by flag order
            self.hash_params = announced[0]
            is_caching = self.hash_params.is_prefix_caching
            self.router.hasher = RequestHasher(self.hash_params) if is_caching else None
            logger.info("engines hash blocks with %s", self.hash_params)
        for record in self.records:
            if record.is_healthy and record.routing_info is not None:
                self._adopt_routing_info(record)
        self._check_kv_layouts()
        return answers

    def _check_kv_layouts(self) -> None:
        """Refuse, by the field they disagree on, decode engines that cannot pull from the
        prefill engines (the first prefill engine's layout, in flag order, is the fleet's)."""
        prefill = [r for r in self.records if r.kv_role == "prefill" and r.routing_info]
        reference = announced_layout(prefill[0].routing_info) if prefill else None
        for record in self.records:
            mismatch = None
            if reference is not None and record.kv_role != "both" and record.routing_info:
                layout = announced_layout(record.routing_info)
                mismatch = describe_layout_mismatch(reference, layout)
            if mismatch != record.kv_layout_mismatch:
                record.kv_layout_mismatch = mismatch
                if mismatch is not None:
                    logger.error(
                        "engine at %s (kv role %s) cannot pair with prefill engine %s: KV "
                        "layouts differ (%s); not used for P/D",
                        record.address,
                        record.kv_role,
                        prefill[0].address,
                        mismatch,
                    )

    def pd_engines(self) -> tuple[list[int], list[int]] | None:
        """(prefill, decode) engine indexes that can serve a request in two phases now, or
        None when no routable pair with one KV layout exists."""
        usable = [
            idx
            for idx, record in enumerate(self.records)
            if record.is_routable and record.kv_layout_mismatch is None
        ]
        prefill = [idx for idx in usable if self.records[idx].kv_role == "prefill"]
        decode = [idx for idx in usable if self.records[idx].kv_role == "decode"]
        return (prefill, decode) if prefill and decode else None

    async def _check_engine(self, handle: EngineHandle) -> bool:
        """One engine's health check, then its load report: the router's own share of that
        engine is noted as the call is sent, so that its requests are never counted twice."""
        record = handle.record
        if not await handle.check_health():
            if not record.is_healthy:
                record.load.forget_report()
            return False
        own_when_asked = record.load.own_snapshot()
        report = await handle.fetch_load()
        if report is not None:
            waiting, running = report["waiting_prefill_tokens"], report["running_decodes"]
            record.load.on_report(waiting, running, own_when_asked)
        elif not record.reports_load:
            record.load.forget_report()
        return True

    def _adopt_routing_info(self, record: EngineRecord) -> None:
        """Check an engine's hash parameters against the fleet's and follow its KV events."""
        params = record.hash_params
        if params is None or self.hash_params is None:
            return
        mismatch = hash_params_mismatch(self.hash_params, params)
        if mismatch != record.hash_mismatch:
            record.hash_mismatch = mismatch
            if mismatch is not None:
                logger.error(
                    "engine at %s hashes blocks unlike the first engine (%s): not routed to",
                    record.address,
                    mismatch,
                )
        info = record.routing_info or {}
        endpoint, replay_endpoint = (
            info.get("kv_events_endpoint"),
            info.get("kv_events_replay_endpoint"),
        )
        if mismatch is None and isinstance(endpoint, str) and self.subscriber is not None:
            source = StreamSource(
                subscribable_endpoint(endpoint, record.address),
                subscribable_endpoint(replay_endpoint, record.address)
                if isinstance(replay_endpoint, str)
                else None,
                str(info.get("kv_events_topic") or ""),
            )
            self.subscriber.follow(record.engine_idx, source)

    def is_indexed(self) -> list[bool]:
        """Per engine: whether its KV-event stream is followed and answering."""
        return [record.is_indexed for record in self.records]

    def router_stats(self, include_keys: bool = False) -> dict[str, object]:
        """What `kvserve stats --url` prints: the policy and, per engine, its index and counts;
        with `include_keys`, every key the index holds for it (hex, as get_cached_block_hashes)."""
        engines = []
        for record in self.records:
            load, stream = record.load, record.kv_events
            engine: dict[str, object] = {
                "address": record.address,
                "kv_role": record.kv_role,
                "kv_layout_mismatch": record.kv_layout_mismatch,
                "is_routable": record.is_routable,
                "hash_mismatch": record.hash_mismatch,
                "decisions": record.num_decisions,
                "predicted_hit_tokens": record.predicted_hit_tokens,
                "actual_hit_tokens": record.actual_hit_tokens,
                "waiting_prefill_tokens": load.waiting_prefill_tokens,
                "running_decodes": load.num_running,
                "other_waiting_prefill_tokens": load.others_waiting_prefill_tokens,
                "other_running_decodes": load.others_running_decodes,
            }
            if self.subscriber is not None:
                engine |= {
                    "is_following_kv_events": stream.is_following,
                    "is_kv_events_silent": stream.is_silent,
                    "index_blocks": len(stream.keys),
                    "next_seq": stream.next_seq,
                    "replays": stream.num_replays,
                    "gaps": stream.num_gaps,
                    "restarts": stream.num_restarts,
                }
                if include_keys:
                    engine["index_keys"] = sorted(key.hex() for key in stream.keys)
            engines.append(engine)
        flow = self.disaggregated
        return {
            "router_policy": self.router.policy.value,
            "engines": engines,
            "pd_requests": flow.num_requests,
            "pd_recomputed_requests": flow.num_recomputed,
        }

    @property
    def has_healthy_engine(self) -> bool:
        return any(record.is_routable for record in self.records)

    @property
    def max_model_len(self) -> int | None:
        """The smallest max_model_len among the engines that reported theirs: a request that
        fits it fits whichever engine the router picks. None before any engine answered."""
        lengths = [
            info["max_model_len"]
            for handle in self.handles
            if (info := handle.client.model_info) is not None
            and isinstance(info.get("max_model_len"), int)
        ]
        return min(lengths) if lengths else None  # type: ignore[type-var]

    @property
    def vocab_size(self) -> int | None:
        """The smallest vocabulary among the engines that reported theirs: a token id inside it
        is inside every engine's. None before any engine answered."""
        sizes = [
            info["vocab_size"]
            for handle in self.handles
            if (info := handle.client.model_info) is not None
            and isinstance(info.get("vocab_size"), int)
        ]
        return min(sizes) if sizes else None  # type: ignore[type-var]

    async def get_stats(self) -> list[dict[str, object] | None]:
        """Each engine's get_stats, or None for one that did not answer in STATS_TIMEOUT_S."""

        async def one(handle: EngineHandle) -> dict[str, object] | None:
            if not handle.record.is_healthy:
                return None
            try:
                async with asyncio.timeout(STATS_TIMEOUT_S):
                    stats = await handle.client.call_utility("get_stats")
            except (TimeoutError, EngineDeadError, UtilityCallError):
                return None
            return stats if isinstance(stats, dict) else None

        return list(await asyncio.gather(*(one(handle) for handle in self.handles)))

    async def generate(
        self,
        request: EngineCoreRequest,
        prompt_token_ids: list[int],
        num_tokens: int,
        group: ChoiceGroup | None = None,
    ) -> AsyncIterator[EngineCoreOutput]:
        """Route a request, yield its outputs; a request left early (its consumer disconnected or
        was cancelled) is aborted in its engine, so that its blocks are freed. A request of a
        `group` (the choices of one prompt) goes where the group's first went, while that
        engine is routable, so that they share its prompt blocks. With a prefill and a decode
        engine available, it goes through both (api_server/routing/disaggregated.py); the
        choices of a group then each take that path, and share the prefill engine's cache as its
        KV score finds it."""
        pd_engines = self.pd_engines()
        if pd_engines is not None and request.sampling_params.max_tokens > 1:
            prefill_idxs, decode_idxs = pd_engines
            async for output in self.disaggregated.generate(
                request, prompt_token_ids, num_tokens, prefill_idxs, decode_idxs
            ):
                yield output
            return
        is_available = [record.is_routable for record in self.records]
        if group is not None and group.engine_idx is not None and is_available[group.engine_idx]:
            decision = self.router.follow(group.engine_idx, prompt_token_ids, num_tokens)
        else:
            index = None if self.subscriber is None else self.subscriber.index
            decision = self.router.choose(
                prompt_token_ids,
                num_tokens,
                request.cache_salt,
                is_available,
                index,
                self.is_indexed(),
            )
        if group is not None:
            group.engine_idx = decision.engine_idx
        handle = self.handles[decision.engine_idx]
        is_finished = is_decoding = False
        try:
            async for output in handle.client.generate(request):
                if not is_decoding:
                    is_decoding = True
                    self.router.on_first_output(decision, output.num_cached_tokens)
                is_finished = output.finish_reason is not None
                yield output
        except EngineConnectionLost:
            is_finished = True  # lost with its connection: the client reconnected, or is dead
            raise
        except EngineDeadError:
            handle.record.is_healthy = False  # the health loop reconnects it
            is_finished = True
            raise
        finally:
            self.router.release(decision, is_decoding)
            if not is_finished:
                logger.debug("aborting %s on the engine at %s", request.req_id, handle.address)
                await handle.client.abort([request.req_id])
