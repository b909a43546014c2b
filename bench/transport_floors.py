"""The floors bench/transport.py measures steps against: 1-byte round trips to echo processes,
over ZMQ both ways, over the shared-memory ring with ZMQ replies, and over rings both ways."""

import multiprocessing
import time

import zmq

from bench.transport_ranks import (
    HANDSHAKE_TIMEOUT_S,
    QUIT,
    STEP_TIMEOUT_S,
    pong_main,
    shm_echo_main,
)
from engine_core.workers.shm_ring_writer import ShmRingWriter
from worker.shm_ring_reader import ShmRingReader


def recv_within(sock: zmq.Socket, timeout_s: float, what: str) -> list[bytes]:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no {what} in {timeout_s} s")
    return sock.recv_multipart()


class PingPong:
    """A 1-byte round trip to `num_echoes` echo processes, answered over ROUTER/DEALER over ipc:
    the ping goes over that pair too (the ZMQ floor) or over a ring with one reader per echo (the
    ring's floor; `spin_s=0` keeps the readers asleep between pings, so each pays its doorbell)."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        is_ring: bool,
        spin_s: float | None = None,
        num_echoes: int = 1,
    ) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(address)
        self.ring = ShmRingWriter(num_echoes) if is_ring else None
        ring_name = None if self.ring is None else self.ring.name
        spawn = multiprocessing.get_context("spawn")
        self.procs = [
            spawn.Process(target=pong_main, args=(address, ring_name, spin_s, idx))
            for idx in range(num_echoes)
        ]
        for proc in self.procs:
            proc.start()
        self.identities = [
            recv_within(self.router, HANDSHAKE_TIMEOUT_S, "hello from pong")[0] for _ in self.procs
        ]

    def ping(self, frame: bytes) -> None:
        if self.ring is not None:
            self.ring.write(frame, STEP_TIMEOUT_S)
            return
        for identity in self.identities:
            self.router.send_multipart((identity, frame))

    def sample(self, num_iters: int) -> list[float]:
        samples = []
        for _ in range(num_iters):
            start = time.perf_counter()
            self.ping(b"x")
            for _ in self.identities:
                recv_within(self.router, STEP_TIMEOUT_S, "pong")
            samples.append(time.perf_counter() - start)
        return samples

    def close(self) -> None:
        self.ping(QUIT)
        for proc in self.procs:
            proc.join(STEP_TIMEOUT_S)
        self.router.close(linger=0)
        if self.ring is not None:
            self.ring.close()


class ShmPingPong:
    """A 1-byte round trip to `num_echoes` processes over shared memory both ways: the ping over
    the ring, each pong over a ring the echo owns. Not the path measured for steps (their
    replies stay on ZMQ), but the floor that replies over per-rank rings would have."""

    def __init__(self, num_echoes: int) -> None:
        self.ring = ShmRingWriter(num_echoes)
        spawn = multiprocessing.get_context("spawn")
        pipes = [spawn.Pipe() for _ in range(num_echoes)]
        self.procs = [
            spawn.Process(target=shm_echo_main, args=(self.ring.name, idx, child))
            for idx, (_, child) in enumerate(pipes)
        ]
        for proc in self.procs:
            proc.start()
        self.replies = []
        for parent, _ in pipes:
            if not parent.poll(HANDSHAKE_TIMEOUT_S):
                raise TimeoutError(f"no reply ring from an echo in {HANDSHAKE_TIMEOUT_S} s")
            self.replies.append(ShmRingReader(parent.recv(), 0))

    def sample(self, num_iters: int) -> list[float]:
        samples = []
        for _ in range(num_iters):
            start = time.perf_counter()
            self.ring.write(b"x", STEP_TIMEOUT_S)
            for reader in self.replies:
                reader.read(STEP_TIMEOUT_S)
            samples.append(time.perf_counter() - start)
        return samples

    def close(self) -> None:
        self.ring.write(QUIT, STEP_TIMEOUT_S)
        for proc in self.procs:
            proc.join(STEP_TIMEOUT_S)
        for reader in self.replies:
            reader.close()
        self.ring.close()
