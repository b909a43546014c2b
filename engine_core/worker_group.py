"""WorkerGroup: the engine's worker ROUTER socket, the handshake with every rank, and the per-step
broadcast and gather (the ZMQ executor), for one worker generation at a time.

Every wait has a deadline. A rank that dies, vanishes or fails is a WorkerGroupError naming it;
this class never schedules, and it replaces a generation only when told to (DESIGN.md §8).
"""

import logging
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from engine_core.endpoints import Endpoints
from engine_core.handshake import (
    HandshakeError,
    check_hello,
    check_ready,
    describe_disagreement,
    describe_message,
    missing_ranks,
)
from engine_core.rank_watch import MONITOR_EVENTS, RankWatch, WorkerGroupError
from protocol.codec import make_encoder, worker_to_engine_decoder
from protocol.errors import ProtocolError
from protocol.kv_cache_spec import KVCacheConfig
from protocol.worker_messages import (
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerFailed,
    WorkerHello,
    WorkerReady,
    WorkerToEngine,
)

logger = logging.getLogger(__name__)

SHUTDOWN_LINGER_MS = 1000
RETIRE_GRACE_S = 3.0  # a retired local rank gets this long to exit before it is killed
WAIT_SLICE_MS = 100  # a long handshake wait lets the engine serve its clients this often


class WorkerGroup:
    """The ranks of one tensor-parallel group, as the engine sees them.

    Invariants: `ranks_by_identity` maps distinct identities to distinct ranks of the current
    `generation` that said hello; after `wait_for_ready` it holds exactly ranks 0..tp_size-1;
    `retired` holds only identities of earlier generations; `last_step_id` is the last step
    broadcast, and every gathered reply echoes it and the generation.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        tp_size: int,
        step_timeout_s: float,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        endpoints: Endpoints | None = None,
    ) -> None:
        """Binds at `address`, through `endpoints` when given (the engine: a busy address is
        refused by name, and its ipc file is removed at exit), else directly (benchmarks)."""
        self.tp_size = tp_size
        self.step_timeout_s = step_timeout_s
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished rank fails at once
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout_s * 1000))
        if endpoints is None:
            self.sock.bind(address)
        else:
            endpoints.bind(self.sock, address, "--worker-address")
        self.monitor = self.sock.get_monitor_socket(MONITOR_EVENTS)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.watch = RankWatch(self.monitor, self.poller, tp_size)
        self.generation = 1  # one more each time a generation is retired
        self.retired: dict[bytes, tuple[int, int]] = {}  # identity -> (generation, rank)
        self.on_wait: Callable[[], None] | None = None  # called every WAIT_SLICE_MS of handshake
        self.hellos: dict[int, WorkerHello] = {}
        self.ranks_by_identity: dict[bytes, int] = {}
        self.peers: set[bytes] = set()  # every worker identity heard from, refused ones included
        self.refusals: list[str] = []  # why peers were refused during startup
        self.last_step_id = 0
        self.encode_time_s = 0.0  # total seconds encoding steps
        self.transport_time_s = 0.0  # total seconds from each broadcast to its last reply
        self._submit_times: deque[tuple[int, float]] = deque()  # (step_id, perf_counter) sent
        self._encoder = make_encoder()
        self._decoder = worker_to_engine_decoder()
        self._is_serving = False

    # -- handshake -----------------------------------------------------------------------------

    def wait_for_hellos(self, deadline: float) -> dict[int, WorkerHello]:
        """Collect one valid WorkerHello per rank before `deadline` (a time.monotonic() value).

        A peer that cannot join (a duplicate rank, another model, garbage) is refused by itself:
        it is told to exit and the engine keeps waiting for the real rank until the deadline.
        """
        while len(self.hellos) < self.tp_size:
            identity, message = self._recv_handshake(deadline, "WorkerHello", set(self.hellos))
            match message:
                case WorkerHello():
                    try:
                        check_hello(message, self.tp_size, self.hellos)
                    except HandshakeError as exc:
                        self._refuse(identity, str(exc))
                        continue
                    self._accept_hello(identity, message)
                case _:
                    self._refuse(identity, f"expected WorkerHello, got {type(message).__name__}")
        return self.hellos

    def _accept_hello(self, identity: bytes, hello: WorkerHello) -> None:
        self.hellos[hello.rank] = hello
        self.ranks_by_identity[identity] = hello.rank
        self.watch.watch_process(hello.rank, hello.pid, hello.host)
        logger.info(
            "rank %d joined: pid %d on %s, %s, %d blocks available",
            hello.rank,
            hello.pid,
            hello.host,
            hello.device,
            hello.num_blocks_available,
        )

    def _refuse(self, identity: bytes, reason: str) -> None:
        """Tell one peer to exit, remember why for the timeout's message, and go on waiting."""
        if identity in self.ranks_by_identity:
            raise HandshakeError(reason)  # an accepted rank misbehaving is a broken group
        logger.warning("refused a worker: %s", reason)
        self.refusals.append(reason)
        self._tell_to_exit([identity], Shutdown(reason=reason, is_failure=True))

    def send_kv_cache_config(self, config: KVCacheConfig) -> None:
        """Admit the ranks that said hello as this generation, starting at config.first_step_id."""
        config = msgspec.structs.replace(config, generation=self.generation)
        self.last_step_id = config.first_step_id - 1
        self._broadcast(self._encoder.encode(config))

    def wait_for_ready(self, num_blocks: int, deadline: float) -> None:
        """Require WorkerReady with exactly `num_blocks` from every rank before `deadline`."""
        ready_ranks: set[int] = set()
        while len(ready_ranks) < self.tp_size:
            identity, message = self._recv_handshake(deadline, "WorkerReady", ready_ranks)
            sender = self.ranks_by_identity.get(identity)
            if sender is None:
                self._refuse(identity, f"the engine already has all {self.tp_size} ranks")
                continue
            match message:
                case WorkerReady():
                    if sender != message.rank:
                        raise HandshakeError(
                            f"WorkerReady names rank {message.rank} but came from rank {sender}"
                        )
                    check_ready(message, num_blocks, ready_ranks, self.generation)
                    ready_ranks.add(message.rank)
                case _:
                    raise HandshakeError(f"expected WorkerReady, got {type(message).__name__}")
        self._is_serving = self.watch.is_serving = True

    def _recv_handshake(
        self, deadline: float, awaited: str, answered: set[int]
    ) -> tuple[bytes, WorkerToEngine]:
        """The next decodable message; a frame from an unknown peer that does not decode is
        logged and dropped, since a stray or hostile connection must not abort startup."""
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                refused = f"; refused: {'; '.join(self.refusals[-3:])}" if self.refusals else ""
                raise HandshakeError(
                    f"timed out waiting for {awaited}: missing rank(s) "
                    f"{missing_ranks(self.tp_size, answered)} of tp_size={self.tp_size}{refused}"
                )
            wait_ms = max(1, int(remaining_s * 1000))
            if self.on_wait is not None:
                wait_ms = min(wait_ms, WAIT_SLICE_MS)
            events = dict(self.poller.poll(wait_ms))
            self.watch.check(events)
            if self.sock not in events:
                if self.on_wait is not None:
                    self.on_wait()
                continue
            frames = self.sock.recv_multipart(copy=False)
            identity = frames[0].bytes
            if identity in self.retired:
                self._drop_stale(identity, "a frame")
                continue
            self.peers.add(identity)
            if len(frames) != 2:
                self._drop_stray(identity, f"{len(frames) - 1} frames instead of 1")
                continue
            try:
                message = self._decoder.decode(frames[1].bytes)
            except ProtocolError as exc:
                self._drop_stray(identity, str(exc))
                continue
            if isinstance(message, WorkerHello):
                self.watch.remember_connection(frames[1], message.rank)
            if isinstance(message, WorkerFailed) and identity in self.ranks_by_identity:
                raise HandshakeError(f"rank {message.rank} failed during startup: {message.error}")
            return identity, message

    def _drop_stray(self, identity: bytes, reason: str) -> None:
        rank = self.ranks_by_identity.get(identity)
        if rank is not None:
            raise HandshakeError(f"rank {rank} sent a bad frame during startup: {reason}")
        logger.warning("dropped a frame from an unknown peer during startup: %s", reason[:200])

    # -- serving -------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcast one step, gather every rank's reply, and return rank 0's if all agree."""
        self.submit(scheduler_output)
        return self.collect(scheduler_output.step_id)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Broadcast the next step without waiting for its replies (asynchronous scheduling
        sends step N+1 while the ranks run step N); `collect` takes them in step order."""
        step_id, expected_id = scheduler_output.step_id, self.last_step_id + 1
        if step_id != expected_id:
            message = f"step {step_id} broadcast, expected step {expected_id}"
            raise WorkerGroupError(message, "protocol", is_recoverable=False)
        start = time.perf_counter()
        if scheduler_output.generation != self.generation:
            scheduler_output = msgspec.structs.replace(scheduler_output, generation=self.generation)
        frame = self._encoder.encode(scheduler_output)
        encoded = time.perf_counter()
        self._broadcast(frame)
        self.last_step_id = step_id
        self.encode_time_s += encoded - start
        self._submit_times.append((step_id, encoded))

    def collect(self, step_id: int) -> ModelRunnerOutput:
        """Every rank's reply to `step_id`, the oldest step submitted and not yet collected;
        rank 0's once all agree."""
        awaited_id, submitted = self._submit_times.popleft()
        assert awaited_id == step_id, f"collecting step {step_id}, but step {awaited_id} is next"
        outputs = self.gather(step_id)
        disagreement = describe_disagreement(step_id, outputs)
        if disagreement:  # a new generation would diverge again: a bug, not a fault
            raise WorkerGroupError(disagreement, "protocol", is_recoverable=False)
        self.transport_time_s += time.perf_counter() - submitted
        return outputs[0]

    def gather(self, step_id: int) -> list[ModelRunnerOutput]:
        """Every rank's ModelRunnerOutput for `step_id`, in rank order, within the step deadline."""
        outputs: list[ModelRunnerOutput | None] = [None] * self.tp_size
        num_pending = self.tp_size
        deadline = time.monotonic() + self.step_timeout_s
        while num_pending:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                missing = [rank for rank, out in enumerate(outputs) if out is None]
                raise WorkerGroupError(
                    f"no reply to step {step_id} from rank(s) {missing} in {self.step_timeout_s} s",
                    "timeout",
                )
            events = dict(self.poller.poll(max(1, int(remaining_s * 1000))))
            if len(events) > (self.sock in events):
                self.watch.check(events)
            if self.sock in events:
                num_pending -= self._drain_replies(step_id, outputs, num_pending)
        return outputs  # type: ignore[return-value]  # no None left

    def _drain_replies(
        self, step_id: int, outputs: list[ModelRunnerOutput | None], num_pending: int
    ) -> int:
        """Read the replies that arrived, stopping once none is pending (no needless recv)."""
        num_received = 0
        while num_received < num_pending:
            try:
                identity, frame = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return num_received
            rank = self.ranks_by_identity.get(identity)
            if identity in self.retired:
                self._drop_stale(identity, "a reply")
                continue
            if rank is None:
                self._refuse_stranger(identity)
                continue
            generation = self.generation
            match self._decode(identity, frame):
                case ModelRunnerOutput() as out if (
                    out.step_id == step_id and out.rank == rank and out.generation == generation
                ):
                    if outputs[rank] is not None:
                        message = f"rank {rank} replied twice to step {step_id}"
                        raise WorkerGroupError(message, "protocol")
                    outputs[rank] = out
                    num_received += 1
                case WorkerFailed() as failed:
                    self.watch.raise_if_a_rank_is_gone()
                    raise WorkerGroupError(
                        f"rank {rank} failed at step {failed.step_id}: {failed.error}"
                    )
                case other:
                    raise WorkerGroupError(
                        f"rank {rank} sent {describe_message(other)} "
                        f"while step {step_id} was awaited",
                        "protocol",
                    )
        return num_received

    def check_idle_events(self) -> None:
        """Between steps: raise if a rank died, disconnected or spoke out of turn."""
        events = dict(self.poller.poll(0))
        self.watch.check(events)
        if self.sock in events:
            identity, frame = self.sock.recv_multipart()
            rank = self.ranks_by_identity.get(identity)
            if identity in self.retired:
                self._drop_stale(identity, "a frame")
                return
            if rank is None:
                self._refuse_stranger(identity)
                return
            match self._decode(identity, frame):
                case WorkerFailed() as failed:
                    raise WorkerGroupError(f"rank {rank} failed: {failed.error}")
                case other:
                    message = f"rank {rank} sent {describe_message(other)} between steps"
                    raise WorkerGroupError(message, "protocol")

    def _decode(self, identity: bytes, frame: bytes) -> WorkerToEngine:
        try:
            return self._decoder.decode(frame)
        except ProtocolError as exc:
            rank = self.ranks_by_identity.get(identity)
            message = f"rank {rank} sent a bad frame: {exc}"
            raise WorkerGroupError(message, "protocol") from None

    def _refuse_stranger(self, identity: bytes) -> None:
        """A worker that joined after startup: tell it to exit and keep serving the group."""
        reason = f"the engine already serves all {self.tp_size} ranks"
        logger.warning("refused a worker that connected after startup: %s", reason)
        self._tell_to_exit([identity], Shutdown(reason=reason, is_failure=True))

    def _broadcast(self, frame: bytes) -> None:
        """Send the same encoded frame to every rank that said hello."""
        sock = self.sock
        for identity, rank in self.ranks_by_identity.items():
            try:  # two plain sends: send_multipart costs a few µs more per rank
                sock.send(identity, zmq.SNDMORE)
                sock.send(frame)
            except zmq.ZMQError as exc:
                message = f"cannot reach rank {rank}: {exc}"
                raise WorkerGroupError(message, "unreachable") from None

    def _drop_stale(self, identity: bytes, what: str) -> None:
        """A rank of a retired generation woke up (SIGSTOP, a partition): its words are void."""
        generation, rank = self.retired[identity]
        msg = "dropped %s from rank %d of retired worker generation %d (serving %d)"
        logger.warning(msg, what, rank, generation, self.generation)

    # -- generations ---------------------------------------------------------------------------

    def retire_generation(self, reason: str) -> None:
        """Tell every rank of the current generation to exit, kill local ones that do not within
        RETIRE_GRACE_S, and forget them: the next hellos form generation + 1 (DESIGN.md §8)."""
        shutdown = Shutdown(reason=reason, is_failure=True, generation=self.generation)
        self._tell_to_exit(list(self.ranks_by_identity), shutdown)
        for identity, rank in self.ranks_by_identity.items():
            self.retired[identity] = (self.generation, rank)
        self.watch.retire(RETIRE_GRACE_S)
        self._submit_times.clear()  # never to be answered
        self.hellos.clear()
        self.ranks_by_identity.clear()
        self.refusals.clear()
        self._is_serving = False
        self.generation += 1

    def pollables(self) -> list[zmq.Socket | int]:
        """What the engine's own poller must watch between steps for this generation."""
        return [self.sock, self.monitor, *self.watch.sentinels]

    # -- shutdown ------------------------------------------------------------------------------

    def shutdown(self, reason: str, is_failure: bool = False) -> None:
        """Tell every worker still reachable to exit, refused ones included."""
        self._tell_to_exit(list(self.peers), Shutdown(reason=reason, is_failure=is_failure))

    def _tell_to_exit(self, identities: list[bytes], shutdown: Shutdown) -> None:
        """Best effort: a peer that is gone or not reading is past telling."""
        frame = self._encoder.encode(shutdown)
        for identity in identities:
            try:
                self.sock.send_multipart((identity, frame), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.debug("Shutdown not delivered to %r: %s", identity, exc)

    def close(self) -> None:
        self.watch.close_sentinels()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=SHUTDOWN_LINGER_MS)  # lets a Shutdown just sent reach the ranks

    def check_invariants(self) -> None:
        inverse = {rank: identity for identity, rank in self.ranks_by_identity.items()}
        assert len(inverse) == len(self.ranks_by_identity), (
            f"two identities share a rank: {self.ranks_by_identity}"
        )
        if self._is_serving:
            assert sorted(inverse) == list(range(self.tp_size)), f"ranks {sorted(inverse)}"
        stale = self.retired.keys() & self.ranks_by_identity.keys()
        assert not stale, f"identities {stale} are both retired and current"
        assert all(gen < self.generation for gen, _ in self.retired.values()), "retired ahead"
        self.watch.check_invariants()
