"""KVTransferAgent: an engine's part in disaggregated prefill and decode (DESIGN.md §12), as the
EngineCore drives it around each step: the pins a step must carry, the handles its outputs must
carry, the pulls its reply settles, and the figures. A prefill engine holds KVTransferPins, a
decode engine KVTransferPulls, an engine of role "both" neither (every call is then a no-op).

It never reaches the scheduler: the EngineCore passes what it needs (the step's requests and
their block ids) and queues the requests whose pulls settled.
"""

from collections.abc import Callable, Sequence

import msgspec

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.kv_request import KVCacheRequest
from engine_core.kv_transfer.pins import KVTransferPins
from engine_core.kv_transfer.pulls import KVTransferPulls, ParkedRequest
from engine_core.sched.admission import scoped_req_id
from protocol.client_messages import EngineCoreOutputs, StatValue
from protocol.config import EngineConfig
from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.kv_transfer import KVTransferLayout, KVTransferOrders
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput


class KVTransferAgent:
    """Invariants: those of its pins or pulls; `pins` is set only on a prefill engine and
    `pulls` only on a decode engine."""

    def __init__(
        self,
        engine_config: EngineConfig,
        block_pool: BlockPool,
        block_size: int,
        layout: KVTransferLayout,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
    ) -> None:
        self.role = engine_config.kv_role
        self.layout = layout
        self.pins: KVTransferPins | None = None
        self.pulls: KVTransferPulls | None = None
        if self.role == "prefill":
            timeout_s = engine_config.kv_transfer_timeout_s
            self.pins = KVTransferPins(block_pool, block_size, timeout_s, layout, kv_cache_groups)
        elif self.role == "decode":
            self.pulls = KVTransferPulls(block_pool, block_size, layout, kv_cache_groups)

    def block_holders(self) -> list[Callable[[], list]]:
        """What the coordinator's invariant must count beside the request tables."""
        return [agent.held_blocks for agent in (self.pins, self.pulls) if agent is not None]

    # -- what a step carries -------------------------------------------------------------------

    def needs_step(self) -> bool:
        """Pins, unpins or pulls that the ranks must get with a step, or pulls they run whose
        ends only a step's reply can bring back: a step must go out, even an empty one."""
        pins, pulls = self.pins, self.pulls
        return (pins is not None and pins.has_orders()) or (
            pulls is not None and (pulls.has_orders() or pulls.is_pulling())
        )

    def is_pulling_only(self) -> bool:
        """Only the ends of pulls the ranks run are awaited (nothing to send)."""
        pulls = self.pulls
        return pulls is not None and pulls.is_pulling() and not pulls.has_orders()

    def with_orders(
        self,
        scheduler_output: SchedulerOutput,
        sampling: list[tuple[KVCacheRequest, bool]],
        block_ids_of: Callable[[str], tuple[list[int], ...]],
    ) -> SchedulerOutput:
        """The step as sent: with the pins of the wanted requests it samples (`sampling`: each
        of its requests and whether it samples; `block_ids_of`: a request's block ids, one list
        per KV-cache group), and every pending unpin and pull."""
        pins, pulls = self.pins, self.pulls
        if pins is not None and pins.wanted:
            for request, is_sampling in sampling:
                if is_sampling and request.req_id in pins.wanted:
                    block_ids = block_ids_of(request.req_id)
                    pins.on_first_sample_scheduled(
                        request.req_id, request.num_prompt_tokens, block_ids, request.block_hashes
                    )
        pin_orders = pins.take_orders() if pins is not None else None
        pull_orders = pulls.take_orders() if pulls is not None else None
        if pin_orders is None and pull_orders is None:
            return scheduler_output
        orders = pin_orders or KVTransferOrders()
        if pull_orders is not None:
            orders = msgspec.structs.replace(orders, pulls=pull_orders.pulls)
        return msgspec.structs.replace(scheduler_output, kv_transfer_orders=orders)

    # -- what a reply and its outputs carry ----------------------------------------------------

    def settle(self, model_runner_output: ModelRunnerOutput) -> list[ParkedRequest]:
        """The parked requests whose pulls every rank has now reported: to queue. A prefill
        engine counts the pulls its ranks refused."""
        if self.pins is not None:
            self.pins.num_refused_pulls += model_runner_output.num_refused_kv_pulls
        pulls = self.pulls
        if pulls is None or not model_runner_output.finished_kv_pulls:
            return []
        return pulls.on_step_reply(
            model_runner_output.finished_kv_pulls,
            model_runner_output.failed_kv_pulls,
            model_runner_output.kv_pull_bytes,
        )

    def with_handles(
        self, outputs: dict[bytes, EngineCoreOutputs]
    ) -> dict[bytes, EngineCoreOutputs]:
        """Each do_remote_decode request's last output, with its handle when its blocks are held
        for a decode engine; a request that ended otherwise drops its pin."""
        pins = self.pins
        if pins is None or not pins.wanted:
            return outputs
        for client_id, batch in outputs.items():
            if not any(out.finish_reason is not None for out in batch.outputs):
                continue
            changed = []
            for output in batch.outputs:
                req_id = scoped_req_id(client_id, output.req_id)
                if output.finish_reason is not None and req_id in pins.wanted:
                    num_tokens = len(output.new_token_ids)
                    handle = pins.on_finished(req_id, output.finish_reason, num_tokens)
                    if handle is not None:
                        output = msgspec.structs.replace(output, kv_transfer_handle=handle)
                changed.append(output)
            outputs[client_id] = msgspec.structs.replace(batch, outputs=changed)
        return outputs

    # -- between steps -------------------------------------------------------------------------

    def release(self, transfer_id: int, secret: str) -> tuple[bool, str | None]:
        """The front end's word that a handle's decode side is done: free its blocks."""
        if self.pins is None:
            return False, "this engine is not a prefill engine: it holds no KV transfers"
        return self.pins.release(transfer_id, secret)

    def expire(self) -> int:
        """Free the blocks of transfers whose deadline passed; how many."""
        return self.pins.expire() if self.pins is not None else 0

    def set_endpoints(self, endpoints: list[str | None]) -> None:
        """Each rank's transfer server, as its WorkerReady named it (a prefill engine's); none
        while any rank named none (its handles could not be pulled from that rank)."""
        if self.pins is not None:
            named = [endpoint for endpoint in endpoints if endpoint is not None]
            self.pins.endpoints = named if len(named) == len(endpoints) else []

    def forget_all(self) -> list[ParkedRequest]:
        """The worker generation is lost, with the pages: drop every pin, fail every pull (their
        blocks freed); the live parked requests, to queue on the next generation."""
        if self.pins is not None:
            self.pins.forget_all()
        return self.pulls.fail_all() if self.pulls is not None else []

    # -- figures -------------------------------------------------------------------------------

    def take_pull_seconds(self) -> list[float]:
        """Parked-to-pulled times of a decode engine's pulls since the last call."""
        return self.pulls.take_pull_seconds() if self.pulls is not None else []

    def stats(self) -> dict[str, StatValue]:
        """P/D figures for get_stats: the role, blocks held, transfers pinned, pulled, failed."""
        stats: dict[str, StatValue] = {"kv_role": self.role}
        if (pins := self.pins) is not None:
            stats |= {
                "kv_transfer_held_blocks": pins.num_held_blocks,
                "kv_transfer_held": len(pins.held),
                "kv_transfer_handles": pins.num_handles,
                "kv_transfer_released": pins.num_released,
                "kv_transfer_expired": pins.num_expired,
                "kv_transfer_refused_releases": pins.num_refused_releases,
                "kv_transfer_refused_pulls": pins.num_refused_pulls,
            }
        if (pulls := self.pulls) is not None:
            pull_stats = pulls.stats
            stats |= {
                "kv_transfer_parked": len(pulls.parked),
                "kv_transfer_pulls": pull_stats.num_pulls,
                "kv_transfer_failed_pulls": pull_stats.num_failed,
                "kv_transfer_skipped_pulls": pull_stats.num_skipped,
                "kv_transfer_pulled_blocks": pull_stats.num_blocks,
                "kv_transfer_pulled_bytes": pull_stats.num_bytes,
            }
        return stats

    def check_invariants(self) -> None:
        if self.pins is not None:
            self.pins.check_invariants()
        if self.pulls is not None:
            self.pulls.check_invariants()
