"""StepTransport: how each step reaches the ranks of one worker generation and how their replies
come back. Every rank gets its handshake frames and Shutdown over the worker ROUTER; each step goes
over a shared-memory ring to the same-host ranks that attached to it (DESIGN.md §1), which reply
in their lanes of that ring, and over the ROUTER to every other rank, which replies over it too.
Failures (WorkerFailed) always come over the ROUTER; every reply is awaited within the deadline.

It owns the generation's ring (a fresh one, with a new name, per generation; closed and unlinked
when the generation is retired), and never handshakes or decides which generation serves.
"""

import logging
import os
import time
from collections.abc import Callable

import zmq

from engine_core.workers.handshake import HandshakeError
from engine_core.workers.rank_agreement import describe_message
from engine_core.workers.rank_watch import RankWatch, WorkerGroupError
from engine_core.workers.shm_ring_writer import ShmRingWriter
from protocol.codec import worker_to_engine_decoder
from protocol.errors import ProtocolError
from protocol.shm_ring import RingClosedError, RingReaderGoneError, read_host_id
from protocol.worker_messages import ModelRunnerOutput, WorkerFailed, WorkerHello, WorkerToEngine

logger = logging.getLogger(__name__)

NUM_REPLY_SLOTS = 4  # per rank's reply lane: the engine has at most 2 steps submitted, uncollected
REPLY_SPIN_S = 200e-6  # how long the lanes are re-checked (yielding the CPU) before blocking


def choose_ring_ranks(
    hellos: dict[int, WorkerHello], host_id: str | None, is_enabled: bool
) -> list[int]:
    """The ranks offered the ring, in rank order: those that can map it, on this boot of this
    machine. A hostname can repeat across hosts, a boot id cannot."""
    if not is_enabled or host_id is None:
        return []
    return [
        rank
        for rank, hello in sorted(hellos.items())
        if hello.is_shm_ring_capable and hello.host_id == host_id
    ]


class StepTransport:
    """The step path of the engine-worker link, both ways, for the current generation.

    Invariants: `ring` is None or open, with its doorbell in `poller`, and `ring_ranks` lists its
    readers' ranks by reader index (None: released); once admitted, `zmq_ranks` maps the
    identity of every rank that is not an attached reader to its rank and `lanes` names the
    attached readers, so each rank gets every step, and replies to it, exactly one way.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        poller: zmq.Poller,
        watch: RankWatch,
        step_timeout_s: float,
        is_shm_ring_enabled: bool,
    ) -> None:
        """`poller` watches `sock` and every rank's liveness, which `watch` checks."""
        self.sock = sock
        self.poller = poller
        self.watch = watch
        self._decoder = worker_to_engine_decoder()
        self.step_timeout_s = step_timeout_s
        self.is_shm_ring_enabled = is_shm_ring_enabled
        self.host_id = read_host_id()
        self.ring: ShmRingWriter | None = None
        self.ring_ranks: list[int | None] = []  # reader index -> rank; None: released
        self.zmq_ranks: dict[bytes, int] = {}  # identity -> rank, of ranks served over ZMQ
        self.lanes: list[tuple[int, int]] = []  # (reader index, rank) of attached readers
        self.num_ranks = 0  # ranks of the admitted generation
        self.last_step_id = 0  # the last step broadcast
        # ZMQ replies to a later step than the one gathered (asynchronous scheduling: ranks on
        # other links can be a step ahead), kept for its gather: step id -> rank -> reply
        self._early: dict[int, dict[int, ModelRunnerOutput]] = {}
        self.is_admitted = False  # every rank of the generation is ready and served

    # -- the ring ------------------------------------------------------------------------------

    def open_ring(self, hellos: dict[int, WorkerHello]) -> tuple[str | None, list[int]]:
        """A fresh ring for the generation's same-host ranks: its name and reader ranks, or
        (None, []) when no rank can take it."""
        self.close_ring()
        self.ring_ranks = choose_ring_ranks(hellos, self.host_id, self.is_shm_ring_enabled)
        if not self.ring_ranks:
            return None, []
        self.ring = ShmRingWriter(len(self.ring_ranks), num_reply_slots=NUM_REPLY_SLOTS)
        self.poller.register(self.ring.fileno(), zmq.POLLIN)  # rung by a reply while asleep
        logger.info("steps to rank(s) %s go over ring %s", self.ring_ranks, self.ring.name)
        return self.ring.name, list(self.ring_ranks)

    def on_ready(self, rank: int, is_attached: bool) -> None:
        """Record whether `rank` attached to the ring; one that could not keeps ZMQ, and its
        reader slot stops holding frames."""
        if rank not in self.ring_ranks:
            if is_attached:
                raise HandshakeError(f"rank {rank} says it attached to a ring it was not offered")
            return
        if is_attached:
            return
        assert self.ring is not None, "ring ranks without a ring"
        logger.warning(
            "rank %d could not attach to ring %s: its steps go over ZMQ", rank, self.ring.name
        )
        try:
            self.ring.release_reader(self.ring_ranks.index(rank))
        except ValueError as exc:  # it attached after all: it could read steps it would not run
            raise HandshakeError(f"rank {rank} says it did not attach, but {exc}") from None
        self.ring_ranks[self.ring_ranks.index(rank)] = None
        if not any(reader_rank is not None for reader_rank in self.ring_ranks):
            self.close_ring()

    def admit(self, ranks_by_identity: dict[bytes, int]) -> None:
        """Serve the generation once every rank is ready: ring readers off the ring, the rest
        over ZMQ."""
        on_ring = set(self.ring_ranks)
        self.zmq_ranks = {
            identity: rank for identity, rank in ranks_by_identity.items() if rank not in on_ring
        }
        self.lanes = [(idx, rank) for idx, rank in enumerate(self.ring_ranks) if rank is not None]
        self.num_ranks = len(ranks_by_identity)
        self.is_admitted = True

    def close_ring(self) -> None:
        """Close and unlink the generation's ring: a reader left on it gets RingClosedError and
        can never read a later generation's steps, which go over another ring."""
        if self.ring is not None:
            self.poller.unregister(self.ring.fileno())
            self.ring.close()
        self.ring = None
        self.ring_ranks = []
        self.zmq_ranks = {}
        self.lanes = []
        self._early = {}
        self.is_admitted = False

    # -- sending -------------------------------------------------------------------------------

    def broadcast(self, frame: bytes, step_id: int) -> None:
        """Send step `step_id`'s encoded frame to every admitted rank, the ring's readers first."""
        self.last_step_id = step_id
        self.broadcast_frame(frame)

    def broadcast_frame(self, frame: bytes) -> None:
        """Send an encoded frame that belongs to the last step sent (its grammar bitmask) the way
        that step went, so that every rank reads it after the step and before the next one."""
        if self.ring is not None:
            self._write_ring(frame)
        self.send(self.zmq_ranks, frame)

    def _write_ring(self, frame: bytes) -> None:
        ring = self.ring
        assert ring is not None, "a ring write without a ring"
        try:
            ring.write(frame, self.step_timeout_s)
        except TimeoutError as exc:
            message = f"rank {self._slowest_rank()} stopped reading its steps: {exc}"
            raise WorkerGroupError(message, "timeout") from None
        except RingReaderGoneError as exc:
            message = f"rank {self._slowest_rank()} exited: {exc}"
            raise WorkerGroupError(message, "exited") from None
        except RingClosedError as exc:  # a stream timed out midway and closed it
            raise WorkerGroupError(f"cannot send a step: {exc}", "timeout") from None

    def _slowest_rank(self) -> int | None:
        assert self.ring is not None, "no ring to read"
        reader_idx = self.ring.slowest_reader()[0]
        return None if reader_idx is None else self.ring_ranks[reader_idx]

    def send(self, ranks_by_identity: dict[bytes, int], frame: bytes) -> None:
        """Send the same encoded frame to each rank over the ROUTER."""
        sock = self.sock
        for identity, rank in ranks_by_identity.items():
            try:  # two plain sends: send_multipart costs a few µs more per rank
                sock.send(identity, zmq.SNDMORE)
                sock.send(frame)
            except zmq.ZMQError as exc:
                message = f"cannot reach rank {rank}: {exc}"
                raise WorkerGroupError(message, "unreachable") from None

    def tell_to_exit(self, identities: list[bytes], frame: bytes) -> None:
        """Best effort: a peer that is gone or not reading is past telling."""
        for identity in identities:
            try:
                self.sock.send_multipart((identity, frame), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.debug("Shutdown not delivered to %r: %s", identity, exc)

    # -- replies -------------------------------------------------------------------------------

    def gather(
        self, step_id: int, generation: int, sender_rank: Callable[[bytes, str], int | None]
    ) -> list[ModelRunnerOutput]:
        """Every rank's ModelRunnerOutput for `step_id`, in rank order, within the step deadline:
        ring readers' from their lanes (spun for briefly, then slept on), the others' over ZMQ.
        `sender_rank` names the current rank behind an identity, or deals with another peer."""
        outputs: list[ModelRunnerOutput | None] = [None] * self.num_ranks
        for rank, early in self._early.pop(step_id, {}).items():
            outputs[rank] = early
        num_pending = sum(out is None for out in outputs)
        lanes = [(idx, rank) for idx, rank in self.lanes if outputs[rank] is None]
        deadline = time.monotonic() + self.step_timeout_s
        spin_until = time.monotonic() + REPLY_SPIN_S
        while num_pending:
            if lanes:
                num_taken, lanes = self._take_lane_replies(step_id, generation, outputs, lanes)
                num_pending -= num_taken
                if not num_pending:
                    break
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                missing = [rank for rank, out in enumerate(outputs) if out is None]
                raise WorkerGroupError(
                    f"no reply to step {step_id} from rank(s) {missing} in {self.step_timeout_s} s",
                    "timeout",
                )
            if lanes and time.monotonic() < spin_until:
                os.sched_yield()
                continue
            events = self._sleep(lanes, remaining_s)
            if events is None:
                continue  # a lane reply came in meanwhile
            if len(events) > (self.sock in events):
                self.watch.check(events)
            if self.sock in events:
                num_pending -= self._drain_replies(
                    step_id, generation, outputs, num_pending, sender_rank
                )
        return outputs  # type: ignore[return-value]  # no None left

    def _sleep(self, lanes: list[tuple[int, int]], remaining_s: float) -> dict | None:
        """Block on the ROUTER, the ranks' liveness and, for `lanes`, the ring's doorbell; None
        (and no block) when a lane reply is already there."""
        ring = self.ring
        is_asleep = False
        if lanes:
            assert ring is not None, "reply lanes without a ring"
            is_asleep = ring.begin_reply_sleep([reader_idx for reader_idx, _ in lanes])
            if not is_asleep:
                return None
        try:
            return dict(self.poller.poll(max(1, int(remaining_s * 1000))))
        finally:
            if is_asleep and ring is not None:
                ring.end_reply_sleep()

    def _take_lane_replies(
        self,
        step_id: int,
        generation: int,
        outputs: list[ModelRunnerOutput | None],
        lanes: list[tuple[int, int]],
    ) -> tuple[int, list[tuple[int, int]]]:
        """Take the lane replies that arrived: how many, and the lanes still awaited."""
        ring = self.ring
        assert ring is not None, "reply lanes without a ring"
        awaited = []
        for reader_idx, rank in lanes:
            frame = ring.read_reply(reader_idx)
            if frame is None:
                awaited.append((reader_idx, rank))
            elif not self._accept(step_id, generation, rank, self.decode(rank, frame), outputs):
                message = f"rank {rank} skipped step {step_id} in its reply lane"
                raise WorkerGroupError(message, "protocol")
        return len(lanes) - len(awaited), awaited

    def _drain_replies(
        self,
        step_id: int,
        generation: int,
        outputs: list[ModelRunnerOutput | None],
        num_pending: int,
        sender_rank: Callable[[bytes, str], int | None],
    ) -> int:
        """Read the ZMQ replies that arrived, stopping once none is pending (no needless recv)."""
        num_received = 0
        while num_received < num_pending:
            try:
                identity, frame = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return num_received
            rank = sender_rank(identity, "a reply")
            if rank is not None:
                num_received += self._accept(
                    step_id, generation, rank, self.decode(rank, frame), outputs
                )
        return num_received

    def _accept(
        self,
        step_id: int,
        generation: int,
        rank: int,
        message: WorkerToEngine,
        outputs: list[ModelRunnerOutput | None],
    ) -> bool:
        """File `rank`'s reply to `step_id` (True), or keep its reply to a later step broadcast
        already (False); raise WorkerGroupError for anything else."""
        match message:
            case ModelRunnerOutput() as out if (
                out.step_id == step_id and out.rank == rank and out.generation == generation
            ):
                if outputs[rank] is not None:
                    error = f"rank {rank} replied twice to step {step_id}"
                    raise WorkerGroupError(error, "protocol")
                outputs[rank] = out
                return True
            case ModelRunnerOutput() as out if (
                step_id < out.step_id <= self.last_step_id
                and out.rank == rank
                and out.generation == generation
                and rank not in self._early.get(out.step_id, {})
            ):
                self._early.setdefault(out.step_id, {})[rank] = out
                return False
            case WorkerFailed() as failed:
                self.watch.raise_if_a_rank_is_gone()
                raise WorkerGroupError(
                    f"rank {rank} failed at step {failed.step_id}: {failed.error}"
                )
            case other:
                raise WorkerGroupError(
                    f"rank {rank} sent {describe_message(other)} while step {step_id} was awaited",
                    "protocol",
                )

    def decode(self, rank: int, frame: bytes) -> WorkerToEngine:
        try:
            return self._decoder.decode(frame)
        except ProtocolError as exc:
            raise WorkerGroupError(f"rank {rank} sent a bad frame: {exc}", "protocol") from None

    def check_invariants(self, ranks_by_identity: dict[bytes, int]) -> None:
        assert (self.ring is None) == (not self.ring_ranks), (
            f"ring {self.ring and self.ring.name} with reader ranks {self.ring_ranks}"
        )
        if self.ring is not None:
            self.ring.check_invariants()
        if self.is_admitted:
            on_ring = [rank for rank in self.ring_ranks if rank is not None]
            served = sorted([*self.zmq_ranks.values(), *on_ring])
            assert served == sorted(ranks_by_identity.values()), (
                f"ranks {served} get steps, ranks {sorted(ranks_by_identity.values())} admitted"
            )
