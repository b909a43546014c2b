"""Disaggregated prefill and decode in the front end (DESIGN.md §12): which engines pair up, and
the two-phase flow of one request over them.

Engines announce their role and KV layout in get_routing_info (`kv_role`, `kv_layout_*`), so the
front end needs no per-engine flag. A decode engine whose layout differs from the prefill
engines' is refused for P/D, the field named in the log and in /router; it still serves whole
requests when no pair is available.

One request (`DisaggregatedFlow.generate`):
1. The prefill engine, chosen by KV score among the prefill engines, gets the request with
   max_tokens 1 and do_remote_decode: it computes the prompt and the first token, and its last
   output carries a `KVTransferHandle` while it holds the prompt's blocks.
2. The decode engine, chosen by load, gets the request unchanged but for that handle. It pulls
   the blocks, computes the rest of the prompt (at least its last token) and samples every
   token itself, so the client's stream is exactly one engine's. The prefill engine's token is
   not sent: it is that of the decode engine's first step whenever sampling is greedy or seeded.
3. At the decode engine's first output (the pull is settled by then) the front end releases the
   handle, so the prefill engine frees the blocks before its deadline.

What is lost to a fault is only the transfer: a prefill engine that fails, refuses or dies sends
the request to the decode engine without a handle, which computes the prompt itself. A request
that ends at its first token (a stop token; a prompt that fills max_model_len) ends on the
prefill engine, whose output is then the answer.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec

from engine_client.errors import EngineConnectionLost, EngineDeadError, UtilityCallError
from protocol.client_messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from protocol.kv_transfer import KVTransferHandle, KVTransferLayout, describe_pair_mismatch

if TYPE_CHECKING:
    from api_server.routing.engine_handle import EngineHandle
    from api_server.routing.engine_pool import EnginePool

logger = logging.getLogger(__name__)

LAYOUT_PREFIX = "kv_layout_"
RELEASE_TIMEOUT_S = 2.0  # a release that gets no answer is left to the prefill engine's deadline


def announced_role(info: dict[str, object] | None) -> str:
    """An engine's `kv_role` from its routing info; "both" for one that announces none."""
    role = (info or {}).get("kv_role")
    return role if role in ("prefill", "decode", "both") else "both"  # type: ignore[return-value]


def announced_layout(info: dict[str, object] | None) -> dict[str, object]:
    """The KV layout an engine announced, by field name."""
    return {
        key.removeprefix(LAYOUT_PREFIX): value
        for key, value in (info or {}).items()
        if key.startswith(LAYOUT_PREFIX)
    }


def describe_layout_mismatch(prefill: dict[str, object], decode: dict[str, object]) -> str | None:
    """The first field a prefill and a decode engine disagree on, as `field: prefill's !=
    decode's`; None when they can pair: they agree, or differ only in a TP size the decode
    engine's is a multiple of (protocol.kv_transfer.describe_pair_mismatch). Layouts announced
    without every field are compared field by field."""
    try:
        layouts = KVTransferLayout(**prefill), KVTransferLayout(**decode)  # type: ignore[arg-type]
    except TypeError:
        layouts = None
    if layouts is not None:
        return describe_pair_mismatch(*layouts)
    for field in sorted(prefill.keys() | decode.keys()):
        if prefill.get(field) != decode.get(field):
            return f"{field}: {prefill.get(field)!r} != {decode.get(field)!r}"
    return None


class DisaggregatedFlow:
    """The two phases of a request over a prefill and a decode engine of one EnginePool.

    Invariants: every decision it takes from the pool's router is released once; every handle
    it got is released, or left to the prefill engine's deadline when that call fails.
    """

    def __init__(self, pool: "EnginePool") -> None:
        self.pool = pool
        self._releases: set[asyncio.Task[None]] = set()
        self.num_requests = 0  # sent through both phases
        self.num_recomputed = 0  # went to the decode engine without a handle

    async def generate(
        self,
        request: EngineCoreRequest,
        prompt_token_ids: list[int],
        num_tokens: int,
        prefill_idxs: list[int],
        decode_idxs: list[int],
    ) -> AsyncIterator[EngineCoreOutput]:
        self.num_requests += 1
        prefill_idx, handle, final = await self._prefill(
            request, prompt_token_ids, num_tokens, prefill_idxs
        )
        if final is not None:  # it ended on the prefill engine: that output is the answer
            yield final
            return
        if handle is None:
            self.num_recomputed += 1
        decode_request = msgspec.structs.replace(request, kv_transfer_handle=handle)
        async for output in self._decode(
            decode_request, prompt_token_ids, num_tokens, decode_idxs, prefill_idx
        ):
            yield output

    async def _prefill(
        self,
        request: EngineCoreRequest,
        prompt_token_ids: list[int],
        num_tokens: int,
        prefill_idxs: list[int],
    ) -> tuple[int, KVTransferHandle | None, EngineCoreOutput | None]:
        """Phase 1: (the prefill engine, the handle it gave, or the request's final output when
        it ended there). A prefill engine that fails costs the handle only."""
        pool = self.pool
        is_available = [idx in prefill_idxs for idx in range(len(pool.handles))]
        index = None if pool.subscriber is None else pool.subscriber.index
        decision = pool.router.choose(
            prompt_token_ids,
            len(prompt_token_ids) + 1,
            request.cache_salt,
            is_available,
            index,
            pool.is_indexed(),
        )
        engine = pool.handles[decision.engine_idx]
        params = request.sampling_params
        first_token_params = msgspec.structs.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1)
        )
        prefill_request = msgspec.structs.replace(
            request, sampling_params=first_token_params, do_remote_decode=True
        )
        last: EngineCoreOutput | None = None
        is_decoding = False
        try:
            async for output in engine.client.generate(prefill_request):
                if not is_decoding:
                    is_decoding = True
                    pool.router.on_first_output(decision, output.num_cached_tokens)
                if output.finish_reason is not None:
                    last = output
        except EngineDeadError as exc:
            if not isinstance(exc, EngineConnectionLost):
                engine.record.is_healthy = False  # the health loop reconnects it
            logger.warning(
                "prefill engine at %s failed %s: %s", engine.address, request.req_id, exc
            )
        finally:
            pool.router.release(decision, is_decoding)
            if last is None:  # cancelled, or its engine failed: never leave it running there
                await _abort_quietly(engine, request.req_id)
        if last is None or last.kv_transfer_handle is not None:
            handle = None if last is None else last.kv_transfer_handle
            return decision.engine_idx, handle, None
        if self._is_final(last, params.max_tokens, len(prompt_token_ids)):
            return decision.engine_idx, None, last
        if last.finish_reason == FinishReason.ERROR:
            logger.warning("prefill engine refused %s: %s", request.req_id, last.error)
        return decision.engine_idx, None, None

    def _is_final(self, output: EngineCoreOutput, max_tokens: int, num_prompt_tokens: int) -> bool:
        """Whether the prefill engine's last output ends the request as one engine would."""
        if output.finish_reason == FinishReason.STOP:
            return True
        max_model_len = self.pool.max_model_len
        return output.finish_reason == FinishReason.LENGTH and (
            max_tokens <= 1
            or (max_model_len is not None and num_prompt_tokens + 1 >= max_model_len)
        )

    async def _decode(
        self,
        request: EngineCoreRequest,
        prompt_token_ids: list[int],
        num_tokens: int,
        decode_idxs: list[int],
        prefill_idx: int,
    ) -> AsyncIterator[EngineCoreOutput]:
        """Phase 2, streamed as the single-engine path streams, aborting a request left early."""
        pool = self.pool
        is_available = [idx in decode_idxs for idx in range(len(pool.handles))]
        decision = pool.router.choose_by_load(prompt_token_ids, num_tokens, is_available)
        engine = pool.handles[decision.engine_idx]
        handle = request.kv_transfer_handle
        is_finished = is_decoding = False
        try:
            async for output in engine.client.generate(request):
                if not is_decoding:
                    is_decoding = True
                    pool.router.on_first_output(decision, output.num_cached_tokens)
                    if handle is not None:  # the pull has settled: the blocks may go
                        self._release(pool.handles[prefill_idx], handle)
                        handle = None
                is_finished = output.finish_reason is not None
                yield output
        except EngineConnectionLost:
            is_finished = True
            raise
        except EngineDeadError:
            engine.record.is_healthy = False
            is_finished = True
            raise
        finally:
            pool.router.release(decision, is_decoding)
            if handle is not None:
                self._release(pool.handles[prefill_idx], handle)
            if not is_finished:
                await _abort_quietly(engine, request.req_id)

    def _release(self, engine: "EngineHandle", handle: KVTransferHandle) -> None:
        """Tell the prefill engine, in the background, that the decode side is done."""
        task = asyncio.ensure_future(_release(engine, handle))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def close(self) -> None:
        for task in list(self._releases):
            task.cancel()


async def _release(engine: "EngineHandle", handle: KVTransferHandle) -> None:
    try:
        async with asyncio.timeout(RELEASE_TIMEOUT_S):
            await engine.client.call_utility(
                "release_kv_transfer", handle.transfer_id, handle.secret
            )
    except (TimeoutError, EngineDeadError, UtilityCallError) as exc:
        logger.info("KV transfer %d left to its deadline: %s", handle.transfer_id, exc)


async def _abort_quietly(engine: "EngineHandle", req_id: str) -> None:
    with contextlib.suppress(EngineDeadError):  # its engine is gone, and the request with it
        await engine.client.abort([req_id])
