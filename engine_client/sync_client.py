"""EngineClient: a blocking DEALER connection to the engine's client ROUTER that adds requests,
waits for their outputs, aborts them and makes utility calls. Every wait has a deadline; a vanished
engine is an EngineDeadError.
"""

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator

import zmq
from zmq.utils.monitor import parse_monitor_message

from engine_client.connection import CLOSE_LINGER_MS, DEFAULT_TIMEOUT_S, connect_to_engine
from engine_client.errors import EngineDeadError, UtilityCallError
from engine_client.request import RequestResult, make_request
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
from protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)


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
        connect_to_engine(self._sock, address, curve)
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
