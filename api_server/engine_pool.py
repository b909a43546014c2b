"""EnginePool: one AsyncEngineClient per engine address, their health, and routing through
PrefixAffinityRouter. It owns the clients; it never decodes engine messages itself.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from api_server.router import PrefixAffinityRouter
from engine_client.async_client import AsyncEngineClient
from engine_client.errors import EngineConnectionLost, EngineDeadError, UtilityCallError
from protocol.client_messages import EngineCoreOutput, EngineCoreRequest
from protocol.config import CurveKeys

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0  # between two health checks of every engine
HEALTH_TIMEOUT_S = 2.0  # one check_health waits this long
SILENT_LIMIT_S = 15.0  # a serving engine silent this long (no disconnect seen) is down
STATS_TIMEOUT_S = 2.0


class EngineHandle:
    """One engine: its address, its client (replaced after a disconnect) and whether it serves.

    A busy engine answers utility calls only between steps, and a long prefill on a loaded host
    can take seconds: a serving engine is declared down at once when it disconnects, but only
    after SILENT_LIMIT_S without an answer otherwise. An engine never heard from is down.
    """

    def __init__(self, address: str, timeout_s: float, curve: CurveKeys | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.curve = curve  # the client keypair, when the engines are CURVE servers
        self.client = AsyncEngineClient(address, timeout_s=timeout_s, curve=curve)
        self.is_healthy = False  # until its first check_health answer
        self.last_answer_s: float | None = None  # time.monotonic() of its last answer

    async def reconnect(self) -> None:
        """A fresh client: a client that saw its engine disconnect stays dead."""
        fresh = AsyncEngineClient(self.address, timeout_s=self.timeout_s, curve=self.curve)
        old, self.client = self.client, fresh
        await old.close()

    def mark_down(self, reason: str) -> None:
        if self.is_healthy:
            logger.warning("engine at %s is down: %s", self.address, reason)
        self.is_healthy = False

    async def check_health(self) -> bool:
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):  # not wait_for, which can drop a cancel
                await self.client.call_utility("check_health")
                await self.client.fetch_model_info()  # cached: asked once per connection
        except EngineConnectionLost:
            return False  # what was in flight is lost; the client reconnects on its own
        except EngineDeadError as exc:
            self.mark_down(str(exc))
            await self.reconnect()
            return False
        except (TimeoutError, UtilityCallError) as exc:
            silent_s = time.monotonic() - (self.last_answer_s or 0.0)
            if self.last_answer_s is None or silent_s > SILENT_LIMIT_S:
                self.mark_down(f"no answer to check_health for {silent_s:.1f} s ({exc!r})")
            return False
        if not self.is_healthy:
            info = self.client.model_info or {}
            logger.info(
                "engine at %s is serving %s (max_model_len %s, vocabulary of %s ids)",
                self.address,
                info.get("model"),
                info.get("max_model_len"),
                info.get("vocab_size"),
            )
        self.is_healthy = True
        self.last_answer_s = time.monotonic()
        return True


class EnginePool:
    """Several engines behind one front end.

    Invariants: `router` counts exactly the requests inside `generate` on each engine; a handle
    is healthy only after its engine answered check_health, and stops being so at its first
    disconnect or unanswered check.
    """

    def __init__(
        self,
        addresses: list[str],
        block_size: int,
        timeout_s: float,
        curve: CurveKeys | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("engine pool of 0 addresses: expected at least one")
        self.handles = [EngineHandle(address, timeout_s, curve) for address in addresses]
        self.router = PrefixAffinityRouter(len(addresses), block_size)
        self.num_requests = [0] * len(addresses)  # routed to each engine since the start
        self._health_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._health_task = asyncio.ensure_future(self._watch_health())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for handle in self.handles:
            await handle.client.close()

    async def _watch_health(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def check_health(self) -> list[bool]:
        """Ask every engine now; whether each answered."""
        return list(await asyncio.gather(*(handle.check_health() for handle in self.handles)))

    @property
    def has_healthy_engine(self) -> bool:
        return any(handle.is_healthy for handle in self.handles)

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

    async def get_stats(self) -> list[dict[str, object] | None]:
        """Each engine's get_stats, or None for one that did not answer in STATS_TIMEOUT_S."""

        async def one(handle: EngineHandle) -> dict[str, object] | None:
            if not handle.is_healthy:
                return None
            try:
                async with asyncio.timeout(STATS_TIMEOUT_S):
                    stats = await handle.client.call_utility("get_stats")
            except (TimeoutError, EngineDeadError, UtilityCallError):
                return None
            return stats if isinstance(stats, dict) else None

        return list(await asyncio.gather(*(one(handle) for handle in self.handles)))

    async def generate(
        self, request: EngineCoreRequest, prompt_token_ids: list[int], num_tokens: int
    ) -> AsyncIterator[EngineCoreOutput]:
        """Route a request, yield its outputs; a request left early (its consumer disconnected or
        was cancelled) is aborted in its engine, so that its blocks are freed."""
        is_available = [handle.is_healthy for handle in self.handles]
        engine_idx = self.router.choose(prompt_token_ids, num_tokens, is_available)
        self.num_requests[engine_idx] += 1
        handle = self.handles[engine_idx]
        is_finished = False
        try:
            async for output in handle.client.generate(request):
                is_finished = output.finish_reason is not None
                yield output
        except EngineConnectionLost:
            is_finished = True  # lost with its connection: the client reconnected, or is dead
            raise
        except EngineDeadError:
            handle.is_healthy = False  # the health loop reconnects it
            is_finished = True
            raise
        finally:
            self.router.release(engine_idx, num_tokens)
            if not is_finished:
                logger.debug("aborting %s on the engine at %s", request.req_id, handle.address)
                await handle.client.abort([request.req_id])
