"""EngineHandle: the front end's connection to one engine: its AsyncEngineClient (replaced after
a disconnect), and the health checks, routing info and load reports asked over it, written into
the engine's EngineRecord. Opens the client's socket; every call has a deadline.
"""

import asyncio
import logging
import time

from api_server.routing.disaggregated import announced_role
from api_server.routing.engine_record import EngineRecord
from engine_client.async_client import AsyncEngineClient
from engine_client.errors import EngineConnectionLost, EngineDeadError, UtilityCallError
from kv_hashing.hash_params import decode_hash_params
from protocol.config import CurveKeys

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0  # one check_health waits this long
SILENT_LIMIT_S = 15.0  # a serving engine silent this long (no disconnect seen) is down


class EngineHandle:
    """One engine's connection: its client (replaced after a disconnect), and the health checks,
    routing info and load reports asked over it, written into its `record`.

    A busy engine answers utility calls only between steps, and a long prefill on a loaded host
    can take seconds: a serving engine is declared down at once when it disconnects, but only
    after SILENT_LIMIT_S without an answer otherwise. An engine never heard from is down.
    """

    def __init__(
        self, record: EngineRecord, timeout_s: float, curve: CurveKeys | None = None
    ) -> None:
        self.record = record
        self.address = record.address
        self.timeout_s = timeout_s
        self.curve = curve  # the client keypair, when the engines are CURVE servers
        self.client = AsyncEngineClient(self.address, timeout_s=timeout_s, curve=curve)

    async def reconnect(self) -> None:
        """A fresh client: a client that saw its engine disconnect stays dead."""
        fresh = AsyncEngineClient(self.address, timeout_s=self.timeout_s, curve=self.curve)
        old, self.client = self.client, fresh
        self.record.routing_info = None  # asked again of whatever engine answers next
        self.record.reports_load = True
        await old.close()

    async def fetch_routing_info(self) -> dict[str, object] | None:
        """The engine's get_routing_info, asked once per connection; None from an engine that
        does not know the call (it is then routed by load alone)."""
        record = self.record
        if record.routing_info is None:
            try:
                info = await self.client.call_utility("get_routing_info")
            except UtilityCallError as exc:
                logger.warning("engine at %s announces no routing info: %s", self.address, exc)
                info = {}
            record.routing_info = info if isinstance(info, dict) else {}
            record.kv_role = announced_role(record.routing_info)
            try:
                if not isinstance(info, dict):
                    raise ValueError(f"get_routing_info of {self.address} answered {info!r}")
                record.hash_params = decode_hash_params(info, self.address) if info else None
            except ValueError as exc:  # an engine whose hashing is unknown is not routed to
                logger.error("engine at %s: %s: not routed to", self.address, exc)
                record.hash_params = None
                record.hash_mismatch = str(exc)
        return record.routing_info or None

    async def fetch_load(self) -> dict[str, int] | None:
        """The engine's get_load (its waiting prefill tokens and running decodes), or None when
        it did not answer in time or does not know the call (it is then scored by this front
        end's own count alone)."""
        if not self.record.reports_load:
            return None
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                load = await self.client.call_utility("get_load")
        except UtilityCallError as exc:
            logger.warning("engine at %s reports no load: %s", self.address, exc)
            self.record.reports_load = False
            return None
        except (TimeoutError, EngineConnectionLost, EngineDeadError):
            return None  # the health check judges the engine
        keys = ("waiting_prefill_tokens", "running_decodes")
        if not (isinstance(load, dict) and all(isinstance(load.get(key), int) for key in keys)):
            logger.warning("engine at %s: get_load answered %r: not used", self.address, load)
            self.record.reports_load = False
            return None
        return load

    def mark_down(self, reason: str) -> None:
        if self.record.is_healthy:
            logger.warning("engine at %s is down: %s", self.address, reason)
        self.record.is_healthy = False

    async def check_health(self) -> bool:
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):  # not wait_for, which can drop a cancel
                await self.client.call_utility("check_health")
                await self.client.fetch_model_info()  # cached: asked once per connection
                await self.fetch_routing_info()  # cached likewise
        except EngineConnectionLost:
            return False  # what was in flight is lost; the client reconnects on its own
        except EngineDeadError as exc:
            self.mark_down(str(exc))
            await self.reconnect()
            return False
        except (TimeoutError, UtilityCallError) as exc:
            silent_s = time.monotonic() - (self.record.last_answer_s or 0.0)
            if self.record.last_answer_s is None or silent_s > SILENT_LIMIT_S:
                self.mark_down(f"no answer to check_health for {silent_s:.1f} s ({exc!r})")
            return False
        if not self.record.is_healthy:
            info = self.client.model_info or {}
            logger.info(
                "engine at %s is serving %s (max_model_len %s, vocabulary of %s ids)",
                self.address,
                info.get("model"),
                info.get("max_model_len"),
                info.get("vocab_size"),
            )
        self.record.is_healthy = True
        self.record.last_answer_s = time.monotonic()
        return True
