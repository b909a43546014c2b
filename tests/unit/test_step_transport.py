"""Which ranks take their steps over the shared-memory ring, and the ring's life per generation
(DESIGN.md §1), without processes: the ring is offered only to capable ranks on this boot of this
machine, a rank that cannot attach has its reader slot released, and a closed ring leaves nothing
in /dev/shm. The older wire shapes of WorkerHello, WorkerReady and KVCacheConfig still decode.
"""

import argparse
import os

import msgspec
import pytest
import zmq

from deploy.flags import ENGINE_FLAGS, add_flags, build_config
from engine_core.workers.handshake import HandshakeError
from engine_core.workers.step_transport import StepTransport, choose_ring_ranks
from protocol import PROTOCOL_VERSION
from protocol.codec import engine_to_worker_decoder, worker_to_engine_decoder
from protocol.config import EngineConfig
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from protocol.shm_ring import ReaderState
from protocol.worker_messages import ModelInfo, WorkerHello, WorkerReady
from worker.shm_ring_reader import SHM_FOLDER, ShmRingReader

GROUPS = [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(4, 2, 8, "float32"))]
MODEL = ModelInfo("checksum", 1024, [], 256, GROUPS)
HERE = "boot-here"


def hello(rank: int, host_id: str | None = HERE, is_capable: bool = True) -> WorkerHello:
    return WorkerHello(
        PROTOCOL_VERSION, rank, 3, 100 + rank, "node", "cpu", MODEL, 64, host_id, is_capable
    )


def transport(is_enabled: bool = True) -> StepTransport:
    """A transport whose socket and watch are never used by the calls tested here; its poller
    only holds the ring's doorbell."""
    steps = StepTransport(None, zmq.Poller(), None, 5.0, is_enabled)  # type: ignore[arg-type]
    steps.host_id = HERE
    return steps


def test_the_ring_is_offered_to_capable_ranks_of_this_boot_only() -> None:
    hellos = {0: hello(0), 1: hello(1, host_id="boot-elsewhere"), 2: hello(2)}
    assert choose_ring_ranks(hellos, HERE, True) == [0, 2]
    hellos[2] = hello(2, is_capable=False)
    assert choose_ring_ranks(hellos, HERE, True) == [0]
    assert choose_ring_ranks(hellos, HERE, False) == [], "--no-enable-shm-ring"
    assert choose_ring_ranks(hellos, None, True) == [], "an engine that knows no boot id"
    assert choose_ring_ranks({0: hello(0, host_id=None)}, HERE, True) == []


def test_a_rank_that_cannot_attach_is_released_and_served_over_zmq() -> None:
    steps = transport()
    name, reader_ranks = steps.open_ring({0: hello(0), 1: hello(1), 2: hello(2)})
    assert name is not None and reader_ranks == [0, 1, 2]
    ring = steps.ring
    assert ring is not None
    with ShmRingReader(name, 0), ShmRingReader(name, 2):
        steps.on_ready(0, True)
        steps.on_ready(1, False)
        steps.on_ready(2, True)
        assert ring.reader_states() == [
            ReaderState.ATTACHED,
            ReaderState.DETACHED,
            ReaderState.ATTACHED,
        ]
        steps.admit({b"a": 0, b"b": 1, b"c": 2})
        assert steps.zmq_ranks == {b"b": 1}
        steps.check_invariants({b"a": 0, b"b": 1, b"c": 2})
        steps.close_ring()
    assert name not in os.listdir(SHM_FOLDER)
    assert steps.ring is None and steps.zmq_ranks == {}


def test_every_generation_gets_a_ring_of_its_own_and_the_last_one_out_closes_it() -> None:
    steps = transport()
    first, _ = steps.open_ring({0: hello(0)})
    second, _ = steps.open_ring({0: hello(0)})
    assert first != second
    assert first not in os.listdir(SHM_FOLDER), "the earlier generation's ring was not unlinked"
    steps.on_ready(0, False)  # its only reader cannot attach: the ring has no use left
    assert steps.ring is None and second not in os.listdir(SHM_FOLDER)


def test_no_ring_when_disabled_and_a_rank_claiming_one_is_refused() -> None:
    steps = transport(is_enabled=False)
    assert steps.open_ring({0: hello(0), 1: hello(1)}) == (None, [])
    steps.on_ready(0, False)
    with pytest.raises(HandshakeError, match="rank 1 says it attached to a ring it was not"):
        steps.on_ready(1, True)


def test_a_rank_that_attached_but_says_it_did_not_is_refused() -> None:
    steps = transport()
    name, _ = steps.open_ring({0: hello(0)})
    assert name is not None
    with ShmRingReader(name, 0), pytest.raises(HandshakeError, match="rank 0 says it did not"):
        steps.on_ready(0, False)
    steps.close_ring()


def test_messages_of_the_previous_wire_shape_decode_with_the_ring_off() -> None:
    """A rank or engine built before the ring speaks the same protocol version: its shorter
    arrays must decode, with no ring offered, capable or attached."""
    encode = msgspec.msgpack.encode
    old_hello = ["WorkerHello", PROTOCOL_VERSION, 0, 1, 7, "node", "cpu", MODEL, 64]
    decoded = worker_to_engine_decoder().decode(encode(old_hello))
    assert isinstance(decoded, WorkerHello)
    assert decoded.host_id is None and decoded.is_shm_ring_capable is False
    ready = worker_to_engine_decoder().decode(encode(["WorkerReady", 0, 64, 2]))
    assert ready == WorkerReady(0, 64, 2, is_shm_ring_attached=False)
    config = engine_to_worker_decoder().decode(encode(["KVCacheConfig", 64, GROUPS, False, 2, 9]))
    assert isinstance(config, KVCacheConfig)
    assert config.shm_ring_name is None and config.shm_ring_reader_ranks == []


def test_the_engine_flag_turns_the_ring_off() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, ENGINE_FLAGS, EngineConfig)
    default = build_config(parser.parse_args([]), ENGINE_FLAGS, EngineConfig)
    turned_off = build_config(
        parser.parse_args(["--no-enable-shm-ring"]), ENGINE_FLAGS, EngineConfig
    )
    assert default.enable_shm_ring is True and turned_off.enable_shm_ring is False
