"""One encoder and one typed decoder per socket direction.

Each decoder accepts only the union of messages allowed on its socket, so a malformed or unexpected
frame fails at the boundary with a ProtocolError.
"""

from typing import Generic, TypeVar

import msgspec

from protocol.client_messages import ClientToEngine, EngineToClient
from protocol.errors import ProtocolError
from protocol.kv_events import KVEventBatch
from protocol.worker_messages import EngineToWorker, WorkerToEngine

T = TypeVar("T")


class MessageDecoder(Generic[T]):
    """A msgpack decoder for one message union, raising ProtocolError on any bad frame."""

    def __init__(self, message_type: type[T], socket_name: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._socket_name = socket_name

    def decode(self, frame: bytes | memoryview) -> T:
        try:
            return self._decoder.decode(frame)
        # RecursionError: msgspec decodes nested containers recursively, so a frame of a thousand
        # nested arrays exhausts the stack; it is a bad frame like any other.
        except (
            msgspec.DecodeError,
            msgspec.ValidationError,
            ValueError,
            TypeError,
            RecursionError,
        ) as exc:
            raise ProtocolError(
                f"malformed frame on the {self._socket_name} socket: {exc}"
            ) from None


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def client_to_engine_decoder() -> MessageDecoder[ClientToEngine]:
    return MessageDecoder(ClientToEngine, "client->engine")


def engine_to_client_decoder() -> MessageDecoder[EngineToClient]:
    return MessageDecoder(EngineToClient, "engine->client")


def engine_to_worker_decoder() -> MessageDecoder[EngineToWorker]:
    return MessageDecoder(EngineToWorker, "engine->worker")


def worker_to_engine_decoder() -> MessageDecoder[WorkerToEngine]:
    return MessageDecoder(WorkerToEngine, "worker->engine")


def kv_event_decoder() -> MessageDecoder[KVEventBatch]:
    return MessageDecoder(KVEventBatch, "kv-events")
