"""WorkerGroup: the engine's worker ROUTER socket, the handshake with every rank, and the per-step
broadcast and gather (the executor), for one worker generation at a time. How a frame reaches
each rank (ZMQ, or the shared-memory ring for same-host ranks) is StepTransport's.

Every wait has a deadline. A rank that dies, vanishes or fails is a WorkerGroupError naming it;
this class never schedules, and it replaces a generation only when told to (DESIGN.md §8).
"""

import logging
import time
from collections.abc import Callable

import msgspec
import zmq

from engine_core.net.endpoints import Endpoints
from engine_core.workers.handshake import HandshakeError, check_hello, check_ready, missing_ranks
from engine_core.workers.rank_agreement import (
    describe_disagreement,
    describe_message,
    with_every_failed_disk_slot,
    with_every_kv_pull_report,
)
from engine_core.workers.rank_watch import MONITOR_EVENTS, RankWatch, WorkerGroupError
from engine_core.workers.step_transport import StepTransport
from protocol.codec import make_encoder, worker_to_engine_decoder
from protocol.errors import ProtocolError
from protocol.kv_cache_spec import KVCacheConfig
from protocol.worker_messages import (
    GrammarBitmask,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    StepGrammarBitmask,
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
        is_shm_ring_enabled: bool = False,
    ) -> None:
        """Binds at `address`, through `endpoints` when given (the engine: a busy address is
        refused by name, and its ipc file is removed at exit), else directly (benchmarks).
        With `is_shm_ring_enabled`, steps reach same-host ranks over a shared-memory ring."""
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
        self.transport = StepTransport(
            self.sock, self.poller, self.watch, step_timeout_s, is_shm_ring_enabled
        )
        self.generation = 1  # one more each time a generation is retired
        self.retired: dict[bytes, tuple[int, int]] = {}  # identity -> (generation, rank)
        self.hellos: dict[int, WorkerHello] = {}
        self.ranks_by_identity: dict[bytes, int] = {}
        self.peers: set[bytes] = set()  # every worker identity heard from, refused ones included
        self.refusals: list[str] = []  # why peers were refused during startup
        self.last_step_id = 0
        # per rank, where it serves pulls of pinned blocks (a prefill engine's, DESIGN.md §12),
        # as its WorkerReady said; refreshed by every generation
        self.kv_transfer_endpoints: list[str | None] = [None] * tp_size
        self.encode_time_s = 0.0  # total seconds encoding steps
        self.transport_time_s = 0.0  # total seconds sending steps and waiting for their replies
        # total seconds the least busy rank spent in the model's forward, as the ranks report it
        self.rank_forward_time_s = 0.0
        self._encoder = make_encoder()
        self._decoder = worker_to_engine_decoder()
        self._is_serving = False

    # -- handshake -----------------------------------------------------------------------------

    def wait_for_hellos(
        self, deadline: float, on_wait: Callable[[], None] | None = None
    ) -> dict[int, WorkerHello]:
        """Collect one valid WorkerHello per rank before `deadline` (a time.monotonic() value).

        A peer that cannot join (a duplicate rank, another model, garbage) is refused by itself:
        it is told to exit and the engine keeps waiting for the real rank until the deadline.
        `on_wait`, when given, runs after each wait of at most WAIT_SLICE_MS that ends without a
        frame (the server answering its clients while a new generation joins); what it raises
        ends the wait.
        """
        while len(self.hellos) < self.tp_size:
            answered = set(self.hellos)
            identity, message = self._recv_handshake(deadline, "WorkerHello", answered, on_wait)
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
        """Admit the ranks that said hello as this generation, starting at config.first_step_id;
        the same-host ones are offered a fresh ring."""
        ring_name, reader_ranks = self.transport.open_ring(self.hellos)
        config = msgspec.structs.replace(
            config,
            generation=self.generation,
            shm_ring_name=ring_name,
            shm_ring_reader_ranks=reader_ranks,
        )
        self.last_step_id = config.first_step_id - 1
        self.transport.send(self.ranks_by_identity, self._encoder.encode(config))

    def wait_for_ready(
        self, num_blocks: int, deadline: float, on_wait: Callable[[], None] | None = None
    ) -> None:
        """Require WorkerReady with exactly `num_blocks` from every rank before `deadline`;
        `on_wait` as in `wait_for_hellos`."""
        ready_ranks: set[int] = set()
        while len(ready_ranks) < self.tp_size:
            identity, message = self._recv_handshake(deadline, "WorkerReady", ready_ranks, on_wait)
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
                    self.transport.on_ready(message.rank, message.is_shm_ring_attached)
                    self.kv_transfer_endpoints[message.rank] = message.kv_transfer_endpoint
                    ready_ranks.add(message.rank)
                case _:
                    raise HandshakeError(f"expected WorkerReady, got {type(message).__name__}")
        self.transport.admit(self.ranks_by_identity)
        self._is_serving = self.watch.is_serving = True

    def _recv_handshake(
        self,
        deadline: float,
        awaited: str,
        answered: set[int],
        on_wait: Callable[[], None] | None,
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
            if on_wait is not None:
                wait_ms = min(wait_ms, WAIT_SLICE_MS)
            events = dict(self.poller.poll(wait_ms))
            self.watch.check(events)
            if self.sock not in events:
                if on_wait is not None:
                    on_wait()
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
        self.transport.broadcast(frame, step_id)
        self.last_step_id = step_id
        self.encode_time_s += encoded - start
        self.transport_time_s += time.perf_counter() - encoded

    def send_grammar_bitmask(self, step_id: int, grammar_bitmask: GrammarBitmask) -> None:
        """Broadcast the bitmask of step `step_id`, the newest step sent, which went out with
        `grammar_bitmask_follows`: each rank reads it after that step and before the next, on
        the step's own channel, and waits for it before sampling."""
        if step_id != self.last_step_id:
            message = f"a grammar bitmask for step {step_id}, but step {self.last_step_id} is last"
            raise WorkerGroupError(message, "protocol", is_recoverable=False)
        start = time.perf_counter()
        frame = self._encoder.encode(StepGrammarBitmask(step_id, self.generation, grammar_bitmask))
        encoded = time.perf_counter()
        self.transport.broadcast_frame(frame)
        self.encode_time_s += encoded - start
        self.transport_time_s += time.perf_counter() - encoded

    def collect(self, step_id: int) -> ModelRunnerOutput:
        """Every rank's reply to `step_id`, the oldest step submitted and not yet collected;
        rank 0's once all agree, with the disk slots that failed on any rank. Which step that
        is, the engine's scheduler records (its steps in flight, in order); this group keeps no
        list of its own."""
        assert step_id <= self.last_step_id, f"collecting step {step_id}, never broadcast"
        start = time.perf_counter()
        outputs = self.gather(step_id)
        # Only the time spent waiting counts: with asynchronous scheduling the ranks ran this
        # step while the engine scheduled the next, and that time is the engine's own.
        self.transport_time_s += time.perf_counter() - start
        disagreement = describe_disagreement(step_id, outputs)
        if disagreement:  # a new generation would diverge again: a bug, not a fault
            raise WorkerGroupError(disagreement, "protocol", is_recoverable=False)
        self.rank_forward_time_s += min(output.forward_s for output in outputs)
        return with_every_kv_pull_report([with_every_failed_disk_slot(outputs), *outputs[1:]])

    def gather(self, step_id: int) -> list[ModelRunnerOutput]:
        """Every rank's ModelRunnerOutput for `step_id`, in rank order, within the step deadline."""
        return self.transport.gather(step_id, self.generation, self._sender_rank)

    def check_idle_events(self, num_steps_in_flight: int) -> None:
        """Between steps: raise if a rank died, disconnected or spoke out of turn. While a step
        is submitted and not yet collected (asynchronous scheduling), what its ranks send over
        ZMQ, a reply or a WorkerFailed, is left for `collect`.

        `num_steps_in_flight`: the steps sent and not yet answered, from the engine's one
        record of them (EngineCore.num_steps_in_flight)."""
        events = dict(self.poller.poll(0))
        self.watch.check(events)
        if self.sock in events and not num_steps_in_flight:
            identity, frame = self.sock.recv_multipart()
            rank = self._sender_rank(identity, "a frame")
            if rank is None:
                return
            match self.transport.decode(rank, frame):
                case WorkerFailed() as failed:
                    raise WorkerGroupError(f"rank {rank} failed: {failed.error}")
                case other:
                    message = f"rank {rank} sent {describe_message(other)} between steps"
                    raise WorkerGroupError(message, "protocol")

    def _sender_rank(self, identity: bytes, what: str) -> int | None:
        """The current rank that sent `what`; None (and it is dealt with) for another peer."""
        if identity in self.retired:
            self._drop_stale(identity, what)
            return None
        rank = self.ranks_by_identity.get(identity)
        if rank is None:
            self._refuse_stranger(identity)
        return rank

    def _refuse_stranger(self, identity: bytes) -> None:
        """A worker that joined after startup: tell it to exit and keep serving the group."""
        reason = f"the engine already serves all {self.tp_size} ranks"
        logger.warning("refused a worker that connected after startup: %s", reason)
        self._tell_to_exit([identity], Shutdown(reason=reason, is_failure=True))

    def _drop_stale(self, identity: bytes, what: str) -> None:
        """A rank of a retired generation woke up (SIGSTOP, a partition): its words are void."""
        generation, rank = self.retired[identity]
        msg = "dropped %s from rank %d of retired worker generation %d (serving %d)"
        logger.warning(msg, what, rank, generation, self.generation)

    # -- generations ---------------------------------------------------------------------------

    def retire_generation(self, reason: str) -> None:
        """Tell every rank of the current generation to exit, close its ring, kill local ones
        that do not exit within RETIRE_GRACE_S, and forget them: the next hellos form
        generation + 1 (DESIGN.md §8)."""
        shutdown = Shutdown(reason=reason, is_failure=True, generation=self.generation)
        self._tell_to_exit(list(self.ranks_by_identity), shutdown)
        self.transport.close_ring()  # after the Shutdown: a reader that sees the close finds it
        for identity, rank in self.ranks_by_identity.items():
            self.retired[identity] = (self.generation, rank)
        self.watch.retire(RETIRE_GRACE_S)
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
        self.transport.tell_to_exit(identities, self._encoder.encode(shutdown))

    def close(self) -> None:
        self.transport.close_ring()  # unlinked: nothing of the engine stays in /dev/shm
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
        self.transport.check_invariants(self.ranks_by_identity)
