"""EngineClient (blocking) and AsyncEngineClient (asyncio, uvloop when available): a DEALER
connection to the engine's client ROUTER that adds requests, streams their outputs, aborts them and
makes utility calls. Every wait has a deadline; a vanished engine is an EngineDeadError. The async
client refuses a frame the engine would refuse, and outlives a dropped connection that reconnects.
"""

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol.buffers import pack_int32
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
from protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
CLOSE_LINGER_MS = 1000  # close() delivers what was sent (an abort, say) within this long
# A dead engine on this host closes the connection, which the socket monitor reports. A vanished
# remote host is found by TCP keepalive, not ZMQ heartbeats: under backpressure those trip a
# libzmq assertion that aborts the client process.
TCP_KEEPALIVE_IDLE_S = 10
TCP_KEEPALIVE_INTERVAL_S = 2
TCP_KEEPALIVE_COUNT = 5
# The engine drops a connection that sends a frame over its size limit (DESIGN §1); ZeroMQ then
# reconnects within its reconnect interval (100 ms). An engine not back within this long is dead.
RECONNECT_TIMEOUT_S = 2.0
CONNECTION_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


class EngineDeadError(RuntimeError):
    """The engine closed the connection or stopped answering."""


class EngineConnectionLost(EngineDeadError):
    """The connection dropped under a request or call in flight, which is lost with it; the
    client reconnects, so only what was in flight fails (EngineDeadError if it cannot)."""


class FrameTooLargeError(ValueError):
    """A request whose frame the engine's client socket would refuse, dropping the connection."""


class UtilityCallError(RuntimeError):
    """The engine answered a utility call with ok=False; the message is its reason."""


@dataclass
class RequestResult:
    """Everything one request produced, with client-side timings in seconds (time.monotonic)."""

    req_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # the FinishReason's name, lowercase
    error: str | None = None
    num_cached_tokens: int = 0
    submit_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    # Per generated token, when the request asked for logprobs: the sampled id and its top-N
    # alternatives, and their logprobs (TokenLogprobs of every output, concatenated)
    logprob_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def absorb(self, output: EngineCoreOutput, now: float) -> None:
        if output.new_token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.token_ids.extend(output.new_token_ids)
        if output.new_logprobs is not None:
            self.logprob_token_ids.extend(output.new_logprobs.token_ids)
            self.logprobs.extend(output.new_logprobs.logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.finish_reason is not None:
            self.finish_reason = str(output.finish_reason)
            self.error = output.error
            self.finish_time = now


def make_request(
    req_id: str,
    prompt_token_ids: list[int],
    sampling_params: SamplingParams | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    encoder_token_ids: list[int] | None = None,  # an encoder-decoder model's encoder input
) -> EngineCoreRequest:
    return EngineCoreRequest(
        req_id=req_id,
        prompt_token_ids=pack_int32(prompt_token_ids),
        sampling_params=sampling_params or SamplingParams(),
        arrival_time=time.time(),
        priority=priority,
        cache_salt=cache_salt,
        encoder_token_ids=None if encoder_token_ids is None else pack_int32(encoder_token_ids),
    )


def _configure(sock: zmq.Socket, address: str, curve: CurveKeys | None) -> None:
    sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
    if curve is not None:  # a CURVE client: the client keypair and the engine's public key
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public_key.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key.encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key.encode())
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTERVAL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_COUNT)
    sock.connect(address)


class EngineClient:
    """A blocking client of one engine.

    Invariants: `_outputs` holds outputs received while a utility call was awaited, in arrival
    order; `_results` holds only requests this client submitted; once `_dead` is set, every wait
    raises it at once.
    """

    def __init__(
        self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S, curve: CurveKeys | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        _configure(self._sock, address, curve)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._encoder = make_encoder()
        self._decoder = engine_to_client_decoder()
        self._outputs: deque[EngineCoreOutput] = deque()
        self._call_ids = itertools.count(1)
        self._results: dict[str, RequestResult] = {}
        self._dead: EngineDeadError | None = None  # set when the engine disconnects

    def send(self, message: EngineCoreRequest | AbortRequests | UtilityCall | bytes) -> None:
        """Send a message (or raw bytes, which tests use to send malformed frames)."""
        frame = message if isinstance(message, bytes) else self._encoder.encode(message)
        self._sock.send(frame)

    def add_request(self, request: EngineCoreRequest) -> RequestResult:
        """Submit a request; its result fills in as outputs arrive."""
        previous = self._results.get(request.req_id)
        if previous is not None and not previous.is_finished:
            raise ValueError(f"req_id {request.req_id!r} is still running: expected a new req_id")
        result = RequestResult(request.req_id, submit_time=time.monotonic())
        self._results[request.req_id] = result
        self.send(request)
        return result

    def abort(self, req_ids: list[str]) -> None:
        self.send(AbortRequests(req_ids=req_ids))

    def get_outputs(self, timeout_s: float | None = None) -> list[EngineCoreOutput]:
        """The next outputs from the engine, waiting at most `timeout_s` (default: the client's)."""
        if self._outputs:
            outputs = list(self._outputs)
            self._outputs.clear()
            return outputs
        message = self._recv(timeout_s, "outputs")
        match message:
            case EngineCoreOutputs():
                return self._record(message.outputs)
            case UtilityResult():
                logger.warning("dropping the answer to call %d, no longer awaited", message.call_id)
                return []

    def poll_outputs(self, timeout_s: float) -> list[EngineCoreOutput]:
        """Like get_outputs, but an empty list when nothing arrives within `timeout_s`."""
        if not self._outputs and not self._sock.poll(int(timeout_s * 1000)):
            self._raise_if_engine_gone()
            return []
        return self.get_outputs(timeout_s)

    def result(self, req_id: str) -> RequestResult:
        """What a request submitted through this client has produced so far."""
        if req_id not in self._results:
            raise KeyError(f"request {req_id!r} was not submitted through this client")
        return self._results[req_id]

    def _raise_if_engine_gone(self) -> None:
        if self._dead is None and self._monitor.poll(0):
            self._note_disconnect()
        if self._dead is not None:
            raise self._dead

    def _note_disconnect(self) -> None:
        """Remember the engine's disconnect: the monitor reports it only once."""
        event = parse_monitor_message(self._monitor.recv_multipart())
        self._dead = EngineDeadError(
            f"the engine at {self.address} disconnected ({event['event']!r})"
        )

    def run_until_finished(
        self, req_ids: list[str], timeout_s: float | None = None
    ) -> dict[str, RequestResult]:
        """Wait until every request in `req_ids` has finished; their results by req_id."""
        wait_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + wait_s
        while not all(self._results[req_id].is_finished for req_id in req_ids):
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                pending = [r for r in req_ids if not self._results[r].is_finished]
                raise TimeoutError(f"requests {pending[:5]} unfinished after {wait_s} s")
            self.get_outputs(remaining_s)
        return {req_id: self._results[req_id] for req_id in req_ids}

    def generate(
        self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> Iterator[EngineCoreOutput]:
        """Submit one request and yield its outputs until it finishes."""
        result = self.add_request(make_request(req_id, prompt_token_ids, sampling_params))
        while not result.is_finished:
            for output in self.get_outputs():
                if output.req_id == req_id:
                    yield output

    def call_utility(
        self, method: str, *args: str | int | float | bool | None, timeout_s: float | None = None
    ) -> object:
        """Call a management method; its value, or UtilityCallError with the engine's reason."""
        call_id = next(self._call_ids)
        self.send(UtilityCall(call_id=call_id, method=method, args=list(args)))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            message = self._recv(deadline - time.monotonic(), f"answer to {method}")
            match message:
                case UtilityResult() if message.call_id == call_id:
                    if not message.ok:
                        raise UtilityCallError(f"{method} failed: {message.error}")
                    return message.value
                case EngineCoreOutputs():
                    self._outputs.extend(self._record(message.outputs))

    def reset_prefix_cache(self) -> object:
        return self.call_utility("reset_prefix_cache")

    def get_stats(self) -> object:
        return self.call_utility("get_stats")

    def check_health(self) -> object:
        return self.call_utility("check_health")

    def _record(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        now = time.monotonic()
        for output in outputs:
            result = self._results.get(output.req_id)
            if result is not None:
                result.absorb(output, now)
        return outputs

    def _recv(self, timeout_s: float | None, what: str) -> EngineCoreOutputs | UtilityResult:
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        if self._dead is None:
            events = dict(self._poller.poll(max(0, int(wait_s * 1000))))
            if self._sock in events:
                return self._decoder.decode(self._sock.recv())
            if self._monitor not in events:
                raise TimeoutError(f"no {what} from the engine at {self.address} in {wait_s:.1f} s")
            self._note_disconnect()
        if self._sock.poll(0):  # what the engine sent before it went away is still delivered
            return self._decoder.decode(self._sock.recv())
        raise self._dead  # type: ignore[misc]  # set above or by an earlier call

    def close(self) -> None:
        """Close, first giving what was sent up to CLOSE_LINGER_MS to reach a live engine."""
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0 if self._dead is not None else CLOSE_LINGER_MS)
        self._ctx.term()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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
        _configure(self._sock, address, curve)
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
                # asyncio.timeout, not wait_for, which on Python 3.11 returns an output ready in a
                # cancel's loop turn and drops the cancel: a left client's request ran to its end
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
