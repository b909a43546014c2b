"""WorkerGroup: the engine's worker ROUTER socket, the handshake with every rank, and the per-step
broadcast and gather (the ZMQ executor).

Every wait has a deadline. A rank that dies, vanishes or fails is a WorkerGroupError naming it; this
class never retries and never schedules.
"""

import logging
import os
import socket
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from engine_core.endpoints import Endpoints
from engine_core.handshake import (
    HandshakeError,
    check_hello,
    check_ready,
    describe_disagreement,
    describe_message,
    missing_ranks,
)
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

MONITOR_EVENTS = zmq.EVENT_DISCONNECTED
SHUTDOWN_LINGER_MS = 1000
SENTINEL_GRACE_MS = 500  # a dead local process closes its sockets just before its pidfd fires


class WorkerGroupError(RuntimeError):
    """A rank died, vanished, failed, diverged or did not answer in time."""


class WorkerGroup:
    """The ranks of one tensor-parallel group, as the engine sees them.

    Invariants: `ranks_by_identity` maps distinct identities to distinct ranks that said hello;
    after `wait_for_ready` it holds exactly ranks 0..tp_size-1; `last_step_id` counts the
    steps broadcast so far, and every gathered reply echoes it.
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
        self.hellos: dict[int, WorkerHello] = {}
        self.ranks_by_identity: dict[bytes, int] = {}
        self.peers: set[bytes] = set()  # every worker identity heard from, refused ones included
        self.refusals: list[str] = []  # why peers were refused during startup
        self.sentinels: dict[int, int] = {}  # pidfd of a local worker process -> its rank
        self.fd_ranks: dict[int, int] = {}  # connection fd of a rank's hello -> its rank
        self.last_step_id = 0
        self.encode_time_s = 0.0  # total seconds encoding steps
        self.transport_time_s = 0.0  # total seconds from each broadcast to its last reply
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
        self._watch_process(hello)
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
        frame = self._encoder.encode(Shutdown(reason=reason, is_failure=True))
        try:
            self.sock.send_multipart((identity, frame), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("refusal not delivered: %s", exc)

    def send_kv_cache_config(self, config: KVCacheConfig) -> None:
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
                    check_ready(message, num_blocks, ready_ranks)
                    ready_ranks.add(message.rank)
                case _:
                    raise HandshakeError(f"expected WorkerReady, got {type(message).__name__}")
        self._is_serving = True

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
            events = dict(self.poller.poll(max(1, int(remaining_s * 1000))))
            self._check_side_events(events)
            if self.sock not in events:
                continue
            frames = self.sock.recv_multipart(copy=False)
            identity = frames[0].bytes
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
                self._remember_connection(frames[1], message.rank)
            if isinstance(message, WorkerFailed) and identity in self.ranks_by_identity:
                raise HandshakeError(f"rank {message.rank} failed during startup: {message.error}")
            return identity, message

    def _drop_stray(self, identity: bytes, reason: str) -> None:
        rank = self.ranks_by_identity.get(identity)
        if rank is not None:
            raise HandshakeError(f"rank {rank} sent a bad frame during startup: {reason}")
        logger.warning("dropped a frame from an unknown peer during startup: %s", reason[:200])

    def _remember_connection(self, frame: zmq.Frame, rank: int) -> None:
        """Map the connection a rank's hello came on to that rank, so a disconnect names it."""
        try:
            fd = frame.get(zmq.SRCFD)
        except (zmq.ZMQError, AttributeError) as exc:  # SRCFD is deprecated in libzmq
            logger.debug("cannot tell rank %d's connection: %s", rank, exc)
            return
        self.fd_ranks[fd] = rank

    def _watch_process(self, hello: WorkerHello) -> None:
        """Put a local worker's process in the poller, so its death is seen within milliseconds."""
        if hello.host != socket.gethostname():
            return  # a remote rank: ZMQ heartbeats and the step deadline watch it
        try:
            pidfd = os.pidfd_open(hello.pid)
        except (OSError, AttributeError) as exc:
            logger.debug("cannot watch rank %d pid %d: %s", hello.rank, hello.pid, exc)
            return
        self.sentinels[pidfd] = hello.rank
        self.poller.register(pidfd, zmq.POLLIN)

    # -- serving -------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcast one step, gather every rank's reply, and return rank 0's if all agree."""
        step_id, expected_id = scheduler_output.step_id, self.last_step_id + 1
        if step_id != expected_id:
            raise WorkerGroupError(f"step {step_id} broadcast, expected step {expected_id}")
        start = time.perf_counter()
        frame = self._encoder.encode(scheduler_output)
        encoded = time.perf_counter()
        self._broadcast(frame)
        self.last_step_id = scheduler_output.step_id
        outputs = self.gather(scheduler_output.step_id)
        disagreement = describe_disagreement(scheduler_output.step_id, outputs)
        if disagreement:
            raise WorkerGroupError(disagreement)
        self.encode_time_s += encoded - start
        self.transport_time_s += time.perf_counter() - encoded
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
                    f"no reply to step {step_id} from rank(s) {missing} in {self.step_timeout_s} s"
                )
            events = dict(self.poller.poll(max(1, int(remaining_s * 1000))))
            if len(events) > (self.sock in events):
                self._check_side_events(events)
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
            if rank is None:
                self._refuse_stranger(identity)
                continue
            match self._decode(identity, frame):
                case ModelRunnerOutput() as out if out.step_id == step_id and out.rank == rank:
                    if outputs[rank] is not None:
                        raise WorkerGroupError(f"rank {rank} replied twice to step {step_id}")
                    outputs[rank] = out
                    num_received += 1
                case WorkerFailed() as failed:
                    self._raise_if_a_rank_is_gone()
                    raise WorkerGroupError(
                        f"rank {rank} failed at step {failed.step_id}: {failed.error}"
                    )
                case other:
                    raise WorkerGroupError(
                        f"rank {rank} sent {describe_message(other)} "
                        f"while step {step_id} was awaited"
                    )
        return num_received

    def check_idle_events(self) -> None:
        """Between steps: raise if a rank died, disconnected or spoke out of turn."""
        events = dict(self.poller.poll(0))
        self._check_side_events(events)
        if self.sock in events:
            identity, frame = self.sock.recv_multipart()
            rank = self.ranks_by_identity.get(identity)
            if rank is None:
                self._refuse_stranger(identity)
                return
            match self._decode(identity, frame):
                case WorkerFailed() as failed:
                    raise WorkerGroupError(f"rank {rank} failed: {failed.error}")
                case other:
                    raise WorkerGroupError(
                        f"rank {rank} sent {describe_message(other)} between steps"
                    )

    def _check_side_events(self, events: dict) -> None:
        for pidfd, rank in self.sentinels.items():
            if pidfd in events:
                pid = self.hellos[rank].pid
                raise WorkerGroupError(f"worker rank {rank} (pid {pid}) exited")
        if self.monitor in events:
            event = parse_monitor_message(self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and self._is_serving:
                rank = self.fd_ranks.get(int(event["value"]))
                if rank is None and len(self.fd_ranks) == self.tp_size:
                    return  # a refused latecomer left, not a rank
                self._name_exited_rank()
                who = "a worker" if rank is None else f"rank {rank}"
                raise WorkerGroupError(f"{who} disconnected from {event['endpoint']!r}")

    def _raise_if_a_rank_is_gone(self) -> None:
        """A rank's failure may echo another rank's death (its all-reduce broke): name the dead."""
        side = zmq.Poller()
        side.register(self.monitor, zmq.POLLIN)
        for pidfd in self.sentinels:
            side.register(pidfd, zmq.POLLIN)
        self._check_side_events(dict(side.poll(SENTINEL_GRACE_MS)))

    def _name_exited_rank(self) -> None:
        """After a disconnect, give a local rank's sentinel a moment, so the error can name it."""
        sentinels = zmq.Poller()
        for pidfd in self.sentinels:
            sentinels.register(pidfd, zmq.POLLIN)
        if self.sentinels:
            self._check_side_events(dict(sentinels.poll(SENTINEL_GRACE_MS)))

    def _decode(self, identity: bytes, frame: bytes) -> WorkerToEngine:
        try:
            return self._decoder.decode(frame)
        except ProtocolError as exc:
            rank = self.ranks_by_identity.get(identity)
            raise WorkerGroupError(f"rank {rank} sent a bad frame: {exc}") from None

    def _refuse_stranger(self, identity: bytes) -> None:
        """A worker that joined after startup: tell it to exit and keep serving the group."""
        reason = f"the engine already serves all {self.tp_size} ranks"
        logger.warning("refused a worker that connected after startup: %s", reason)
        frame = self._encoder.encode(Shutdown(reason=reason, is_failure=True))
        try:
            self.sock.send_multipart((identity, frame), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("refusal not delivered: %s", exc)

    def _broadcast(self, frame: bytes) -> None:
        """Send the same encoded frame to every rank that said hello."""
        sock = self.sock
        for identity, rank in self.ranks_by_identity.items():
            try:  # two plain sends: send_multipart costs a few µs more per rank
                sock.send(identity, zmq.SNDMORE)
                sock.send(frame)
            except zmq.ZMQError as exc:
                raise WorkerGroupError(f"cannot reach rank {rank}: {exc}") from None

    # -- shutdown ------------------------------------------------------------------------------

    def shutdown(self, reason: str, is_failure: bool = False) -> None:
        """Tell every worker still reachable to exit, refused ones included."""
        frame = self._encoder.encode(Shutdown(reason=reason, is_failure=is_failure))
        for identity in self.peers:
            try:
                self.sock.send_multipart((identity, frame), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.debug("shutdown not delivered to %r: %s", identity, exc)

    def close(self) -> None:
        for pidfd in self.sentinels:
            os.close(pidfd)
        self.sentinels.clear()
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
