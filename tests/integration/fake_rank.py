"""FakeRank: a DEALER that speaks the worker side of the protocol by hand, so that tests can send
any WorkerHello, withhold a reply, or answer for a retired worker generation.
"""

import os
from typing import TypeVar

import zmq

from protocol import PROTOCOL_VERSION
from protocol.codec import engine_to_worker_decoder, make_encoder
from protocol.worker_messages import ModelRunnerOutput, Shutdown, WorkerHello, WorkerReady
from worker.models.registry import get_model_info

T = TypeVar("T")

SHUTDOWN_WAIT_MS = 20_000


class FakeRank:
    """A socket that speaks the worker side of the handshake, so tests can send any WorkerHello."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def hello(self, rank: int, tp_size: int, model: str) -> None:
        info = get_model_info(model, 16)
        hello = WorkerHello(
            PROTOCOL_VERSION, rank, tp_size, os.getpid(), "elsewhere", "cpu", info, 64
        )
        self.sock.send(make_encoder().encode(hello))

    def expect_shutdown(self) -> Shutdown:
        return self.expect(Shutdown)

    def expect(self, message_type: type[T]) -> T:
        assert self.sock.poll(SHUTDOWN_WAIT_MS), f"no {message_type.__name__} from the engine"
        message = engine_to_worker_decoder().decode(self.sock.recv())
        assert isinstance(message, message_type), message
        return message

    def send(self, message: WorkerReady | ModelRunnerOutput) -> None:
        self.sock.send(make_encoder().encode(message))
