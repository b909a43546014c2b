"""AsyncEngineClient (asyncio, uvloop when available through run_async): a DEALER connection to
the engine's client ROUTER that streams each request's outputs to its own queue and makes utility
calls. Every wait has a deadline; it refuses a frame the engine would refuse, and outlives a
dropped connection that reconnects.
"""

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engine_client.connection import CLOSE_LINGER_MS, DEFAULT_TIMEOUT_S, connect_to_engine
from engine_client.errors import (
    EngineConnectionLost,
    EngineDeadError,
    FrameTooLargeError,
    UtilityCallError,
)
from protocol.client_messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityCall,
    UtilityResult,
)
from protocol.codec import engine_to_client_decoder, make_encoder
from protocol.config import CurveKeys
from protocol.errors import ProtocolError

logger = logging.getLogger(__name__)

# The engine drops a connection that sends a frame over its size limit (DESIGN §1); ZeroMQ then
# reconnects within its reconnect interval (100 ms). An engine not back within this long is dead.
RECONNECT_TIMEOUT_S = 2.0
CONNECTION_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


class AsyncEngineClient:
    """An asyncio client of one engine; a receive task routes outputs to per-request queues.
    Create it inside a running event loop (see `run_async`).

    A dropped connection (the engine refused a frame, or went away) fails what was in flight
    with EngineConnectionLost; if ZeroMQ reconnects within RECONNECT_TIMEOUT_S the client serves
    on, and otherwise it is dead. `model_info` (the engine's `get_model_info`) is fetched before
    the first request, so that a frame over the engine's limit is refused here, not there.

    Invariants: `_queues` has one queue per unfinished request submitted here, `_calls` one
    future per utility call awaiting its answer; once `_dead` is set, every waiter has been
    failed with it and every later call raises it at once.
    """

    def __init__(
        self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S, curve: CurveKeys | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor = self._sock.get_monitor_socket(CONNECTION_EVENTS)
        connect_to_engine(self._sock, address, curve)
        self._encoder = make_encoder()
        self._decoder = engine_to_client_decoder()
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput | Exception]] = {}
        self._calls: dict[int, asyncio.Future[UtilityResult]] = {}
        self._call_ids = itertools.count(1)
        self._dead: EngineDeadError | None = None  # set when the engine disconnects for good
        self.model_info: dict[str, object] | None = None  # get_model_info's answer, once known
        self.num_reconnects = 0  # dropped connections that came back
        self._tasks = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._watch())]

    async def fetch_model_info(self) -> dict[str, object]:
        """The engine's `get_model_info` (max_model_len, max_request_frame_bytes, ...), cached."""
        if self.model_info is None:
            info = await self.call_utility("get_model_info")
            if not isinstance(info, dict):
                raise ProtocolError(f"get_model_info answered {info!r}: expected a dict")
            self.model_info = info
        return self.model_info

    async def _checked_frame(self, request: EngineCoreRequest) -> bytes:
        frame = self._encoder.encode(request)
        limit = (await self.fetch_model_info()).get("max_request_frame_bytes")
        if isinstance(limit, int) and limit > 0 and len(frame) > limit:
            raise FrameTooLargeError(
                f"request {request.req_id} is a frame of {len(frame)} bytes: the engine at "
                f"{self.address} refuses frames over {limit} bytes (its max_model_len)"
            )
        return frame

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Submit a request and yield its outputs until its last one."""
        if self._dead is not None:
            raise self._dead
        if request.req_id in self._queues:
            raise ValueError(f"req_id {request.req_id!r} is still running: expected a new req_id")
        frame = await self._checked_frame(request)
        queue: asyncio.Queue[EngineCoreOutput | Exception] = asyncio.Queue()
        self._queues[request.req_id] = queue
        try:  # from here a cancel at any await drops the queue; the caller aborts the request
            await self._sock.send(frame)
            while True:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns an output that is
                # ready in the loop turn of a cancel and drops the cancel, so a request whose
                # client had left (the front end cancelled its task) generated to its end
                async with asyncio.timeout(self.timeout_s):
                    item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        except TimeoutError:
            raise TimeoutError(f"no output for {request.req_id} in {self.timeout_s} s") from None
        finally:
            self._queues.pop(request.req_id, None)

    async def send_unchecked(self, frame: bytes) -> None:
        """Send raw bytes as they are: tests use it to send frames the engine refuses."""
        await self._sock.send(frame)

    async def abort(self, req_ids: list[str]) -> None:
        await self._sock.send(self._encoder.encode(AbortRequests(req_ids=req_ids)))

    async def call_utility(self, method: str, *args: str | int | float | bool | None) -> object:
        if self._dead is not None:
            raise self._dead
        call_id = next(self._call_ids)
        future: asyncio.Future[UtilityResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        await self._sock.send(self._encoder.encode(UtilityCall(call_id, method, list(args))))
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for: see generate
                result = await future
        except TimeoutError:
            raise TimeoutError(f"no answer to {method} in {self.timeout_s} s") from None
        finally:
            self._calls.pop(call_id, None)
        if not result.ok:
            raise UtilityCallError(f"{method} failed: {result.error}")
        return result.value

    async def _receive(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                message = self._decoder.decode(frame)
            except ProtocolError as exc:
                logger.warning("ignored a frame from the engine: %s", exc)
                continue
            match message:
                case EngineCoreOutputs():
                    for output in message.outputs:
                        queue = self._queues.get(output.req_id)
                        if queue is not None:
                            queue.put_nowait(output)
                case UtilityResult():
                    future = self._calls.get(message.call_id)
                    if future is not None and not future.done():
                        future.set_result(message)

    def _fail_waiters(self, error: EngineDeadError) -> list[str]:
        """Fail every request and call in flight with `error`; the failed requests' ids."""
        req_ids = list(self._queues)
        for queue in self._queues.values():
            queue.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        return req_ids

    async def _watch(self) -> None:
        """On each dropped connection fail what was in flight; wait for the reconnect, and fail
        everything for good if none comes."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue  # a handshake: the first connection, or one after a reconnect
            lost = EngineConnectionLost(
                f"the engine at {self.address} disconnected: what was in flight on the "
                "connection is lost (it may have refused a frame over its size limit)"
            )
            lost_req_ids = self._fail_waiters(lost)
            self.model_info = None  # a reconnect may reach a restarted engine
            if not await self._reconnected():
                break
            self.num_reconnects += 1
            logger.warning(
                "the connection to the engine at %s dropped and came back: %d requests lost",
                self.address,
                len(lost_req_ids),
            )
            if lost_req_ids:  # a request still in ZeroMQ's queue reaches the engine now
                await self.abort(lost_req_ids)
        self._dead = EngineDeadError(
            f"the engine at {self.address} disconnected and did not come back in "
            f"{RECONNECT_TIMEOUT_S} s"
        )
        self._fail_waiters(self._dead)

    async def _reconnected(self) -> bool:
        try:
            async with asyncio.timeout(RECONNECT_TIMEOUT_S):
                while True:
                    event = parse_monitor_message(await self._monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0 if self._dead is not None else CLOSE_LINGER_MS)
        self._ctx.term()


def run_async(coroutine: object) -> object:
    """Run a coroutine on uvloop when it is installed, else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)  # type: ignore[arg-type]
    return uvloop.run(coroutine)  # type: ignore[arg-type]
