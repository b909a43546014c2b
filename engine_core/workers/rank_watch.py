"""RankWatch: how the engine notices a lost rank, during a step or between steps: a local rank's
process through a pidfd in the poller (seen within milliseconds), and every worker connection
through the socket monitor's disconnects (ZMQ heartbeats cover remote ranks).

It observes and raises WorkerGroupError naming the rank; that error is defined here, and the
step transport and worker group raise it too, for every fault of a rank. The one thing it does to
a process is kill a retired local rank that did not exit within its grace period (DESIGN.md §8).
"""

import logging
import os
import signal
import socket
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from engine_core.net.curve_refusals import REFUSAL_EVENTS, CurveRefusals

logger = logging.getLogger(__name__)

MONITOR_EVENTS = REFUSAL_EVENTS  # disconnects, and refused handshakes to log
SENTINEL_GRACE_MS = 500  # a dead local process closes its sockets just before its pidfd fires


class WorkerGroupError(RuntimeError):
    """A rank died, vanished, failed, diverged or did not answer in time.

    `cause` is one word for metrics and logs: exited, disconnected, timeout, failed, unreachable
    or protocol. `is_recoverable` is False for faults a new worker generation would repeat (ranks
    that disagree on a token): those stop the engine even when rank recovery is on.
    """

    def __init__(self, message: str, cause: str = "failed", is_recoverable: bool = True) -> None:
        super().__init__(message)
        self.cause = cause
        self.is_recoverable = is_recoverable


class RankWatch:
    """The liveness of one generation's ranks, as the engine's poller sees it.

    Invariants: `sentinels` maps open pidfds, each registered in `poller`, to ranks of the current
    generation, and `pids` names each one's process; `fd_ranks` maps connection fds of current
    ranks only; `retired_fds` (connections of earlier generations) is disjoint from it.
    """

    def __init__(self, monitor: zmq.Socket, poller: zmq.Poller, tp_size: int) -> None:
        self.monitor = monitor
        self.poller = poller
        self.tp_size = tp_size
        self.sentinels: dict[int, int] = {}  # pidfd of a local worker process -> its rank
        self.pids: dict[int, int] = {}  # rank -> pid, of the ranks with a sentinel
        self.fd_ranks: dict[int, int] = {}  # connection fd of a rank's hello -> its rank
        self.retired_fds: set[int] = set()  # connections of retired ranks, not yet closed
        self.is_serving = False  # a disconnect is a lost rank only once the group serves
        self.refusals = CurveRefusals("--worker-address")

    def watch_process(self, rank: int, pid: int, host: str) -> None:
        """Put a local worker's process in the poller, so its death is seen within milliseconds."""
        if host != socket.gethostname():
            return  # a remote rank: ZMQ heartbeats and the step deadline watch it
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError) as exc:
            logger.debug("cannot watch rank %d pid %d: %s", rank, pid, exc)
            return
        self.sentinels[pidfd] = rank
        self.pids[rank] = pid
        self.poller.register(pidfd, zmq.POLLIN)

    def remember_connection(self, frame: zmq.Frame, rank: int) -> None:
        """Map the connection a rank's hello came on to that rank, so a disconnect names it."""
        try:
            fd = frame.get(zmq.SRCFD)
        except (zmq.ZMQError, AttributeError) as exc:  # SRCFD is deprecated in libzmq
            logger.debug("cannot tell rank %d's connection: %s", rank, exc)
            return
        self.retired_fds.discard(fd)  # the number was reused: it is this rank's now
        self.fd_ranks[fd] = rank

    def check(self, events: dict) -> None:
        """Raise WorkerGroupError if `events` show a rank's process exited or its link dropped."""
        for pidfd, rank in self.sentinels.items():
            if pidfd in events:
                raise WorkerGroupError(
                    f"worker rank {rank} (pid {self.pids[rank]}) exited", "exited"
                )
        if self.monitor in events:
            event = parse_monitor_message(self.monitor.recv_multipart())
            was_refused = self.refusals.on_event(event)
            if event["event"] == zmq.EVENT_DISCONNECTED and not was_refused:
                self._check_disconnect(int(event["value"]), event["endpoint"])

    def _check_disconnect(self, fd: int, endpoint: object) -> None:
        if fd in self.retired_fds:
            self.retired_fds.discard(fd)
            logger.info("a retired rank's connection closed")
            return
        if not self.is_serving:
            return
        rank = self.fd_ranks.get(fd)
        if rank is None and len(self.fd_ranks) == self.tp_size:
            return  # a refused latecomer left, not a rank
        self.name_exited_rank()
        who = "a worker" if rank is None else f"rank {rank}"
        raise WorkerGroupError(f"{who} disconnected from {endpoint!r}", "disconnected")

    def raise_if_a_rank_is_gone(self) -> None:
        """A rank's failure may echo another rank's death (its all-reduce broke): name the dead."""
        side = zmq.Poller()
        side.register(self.monitor, zmq.POLLIN)
        for pidfd in self.sentinels:
            side.register(pidfd, zmq.POLLIN)
        self.check(dict(side.poll(SENTINEL_GRACE_MS)))

    def name_exited_rank(self) -> None:
        """After a disconnect, give a local rank's sentinel a moment, so the error can name it."""
        sentinels = zmq.Poller()
        for pidfd in self.sentinels:
            sentinels.register(pidfd, zmq.POLLIN)
        if self.sentinels:
            self.check(dict(sentinels.poll(SENTINEL_GRACE_MS)))

    def retire(self, grace_s: float) -> None:
        """Forget the current generation once it was told to exit: a local rank still alive after
        `grace_s` (stopped, or stuck in a collective with a dead peer) is killed, so that its
        supervisor can start the next generation. Remote ranks exit on their own deadlines."""
        deadline = time.monotonic() + grace_s
        alive = dict(self.sentinels)
        while alive and (remaining_s := deadline - time.monotonic()) > 0:
            waiting = zmq.Poller()
            for pidfd in alive:
                waiting.register(pidfd, zmq.POLLIN)
            for pidfd in dict(waiting.poll(max(1, int(remaining_s * 1000)))):
                alive.pop(pidfd, None)
        for pidfd, rank in alive.items():
            logger.warning(
                "rank %d (pid %d) did not exit within %.1f s of its Shutdown: killing it",
                rank,
                self.pids[rank],
                grace_s,
            )
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError as exc:
                logger.warning("cannot kill rank %d: %s", rank, exc)
        self.close_sentinels()
        self.retired_fds.update(self.fd_ranks)
        self.fd_ranks.clear()
        self.is_serving = False

    def close_sentinels(self) -> None:
        for pidfd in self.sentinels:
            self.poller.unregister(pidfd)
            os.close(pidfd)
        self.sentinels.clear()
        self.pids.clear()

    def check_invariants(self) -> None:
        assert sorted(self.pids) == sorted(self.sentinels.values()), (
            f"pids of ranks {sorted(self.pids)}, sentinels of {sorted(self.sentinels.values())}"
        )
        assert not self.retired_fds & set(self.fd_ranks), (
            f"connections {self.retired_fds & set(self.fd_ranks)} are both current and retired"
        )
