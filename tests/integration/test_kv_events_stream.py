"""A subscriber rebuilds the engine's prefix-cache map from the KV-event stream alone: through a
workload small enough to evict, batches dropped on purpose and recovered by vLLM's replay
protocol, and a reset; after each phase its set of hashes equals the engine's map.
"""

import json
import random

import pytest
import zmq

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from engine_core.kv_cache.hashing import make_block_hash_with_group_id
from protocol.codec import kv_event_decoder
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, free_tcp_ports, launch, stop_launch, wait_for

pytestmark = pytest.mark.integration

CLIENT_TIMEOUT_S = 90.0
TOPIC = b"kv"
REPLAY_WAIT_MS = 10_000  # the longest wait for one frame of a replay answer
SYNC_TIMEOUT_S = 20.0  # the stream must catch up with the engine's map within this
SEQ_SIZE_BYTES = 8
END_OF_REPLAY = -1


class MapSubscriber:
    """Applies the stream in sequence order, replaying from the first missing seq on a gap.

    `keys` holds `block_hash_with_group_id` keys, as the engine's map does.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str) -> None:
        self.keys: set[bytes] = set()
        self.next_seq = 0
        self.num_to_drop = 0  # live batches still to drop on purpose
        self.num_dropped = self.num_gaps = self.num_removed = self.num_cleared = 0
        self.decoder = kv_event_decoder()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)

    def drain(self) -> None:
        """Take every batch already received, without waiting for more."""
        while self.sub.poll(0):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC, f"got topic {topic!r}, expected {TOPIC!r}"
            seq = int.from_bytes(seq_bytes, "big")
            if self.num_to_drop > 0:
                self.num_to_drop -= 1
                self.num_dropped += 1
                continue
            if seq > self.next_seq:  # a gap: batches next_seq..seq-1 never arrived
                self.num_gaps += 1
                self.replay_from(self.next_seq)
            if seq == self.next_seq:
                self.apply(seq, payload)

    def replay_from(self, start_seq: int) -> None:
        """vLLM's replay: send (b"", start_seq), read (b"", topic, seq, payload) until -1."""
        self.replay.send_multipart((b"", start_seq.to_bytes(SEQ_SIZE_BYTES, "big", signed=True)))
        while True:
            assert self.replay.poll(REPLAY_WAIT_MS), f"no replay frame in {REPLAY_WAIT_MS} ms"
            empty, topic, seq_bytes, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            assert empty == b"", f"replay frame opens with {empty!r}, expected b''"
            if seq == END_OF_REPLAY:
                assert (topic, payload) == (b"", b""), "the end marker carries no topic or data"
                return
            assert topic == TOPIC and seq >= start_seq, f"replayed {topic!r} seq {seq}"
            if seq == self.next_seq:
                self.apply(seq, payload)

    def apply(self, seq: int, payload: bytes) -> None:
        for event in self.decoder.decode(payload).events:
            match event:
                case BlockStored():
                    self.keys.update(key(h, event.group_idx) for h in event.block_hashes)
                case BlockRemoved():
                    self.num_removed += 1
                    for block_hash in event.block_hashes:
                        assert key(block_hash, event.group_idx) in self.keys, "unknown removal"
                        self.keys.remove(key(block_hash, event.group_idx))
                case AllBlocksCleared():
                    self.num_cleared += 1
                    self.keys.clear()
        self.next_seq = seq + 1


def key(block_hash: bytes, group_idx: int | None) -> bytes:
    assert group_idx is not None, "kvserve always names the group"
    return bytes(make_block_hash_with_group_id(block_hash, group_idx))


def engine_keys(client: EngineClient) -> set[bytes]:
    counts = client.call_utility("get_cached_block_hashes")
    assert isinstance(counts, dict), counts
    return {bytes.fromhex(hex_key) for hex_key in counts}


def assert_map_rebuilt(subscriber: MapSubscriber, client: EngineClient, phase: str) -> None:
    """The engine is idle, so its map is final; the stream must reach exactly that set."""
    expected = engine_keys(client)

    def caught_up() -> bool:
        subscriber.drain()
        return subscriber.keys == expected

    try:
        wait_for(caught_up, SYNC_TIMEOUT_S, f"the stream matching the engine's map {phase}")
    except TimeoutError:
        missing, extra = len(expected - subscriber.keys), len(subscriber.keys - expected)
        raise AssertionError(f"{phase}: {missing} hashes missing, {extra} extra") from None
    num_before = subscriber.next_seq
    subscriber.replay_from(subscriber.next_seq)  # nothing was published that we did not apply
    assert subscriber.next_seq == num_before, f"{phase}: batches after the map matched"


def serve(client: EngineClient, prompts: list[list[int]], wave: str) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)  # decode fills blocks: many batches
    req_ids = [f"{wave}-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(req_ids, prompts, strict=True):
        client.add_request(make_request(req_id, prompt, params))
    for req_id, result in client.run_until_finished(req_ids, CLIENT_TIMEOUT_S).items():
        assert result.error is None, f"{req_id} failed: {result.error}"


def wave_prompts(seed: int) -> list[list[int]]:
    """Six prompts on one 48-token prefix, two of them identical (their blocks cached twice)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(48)]
    tails = [[rng.randrange(3, 500) for _ in range(8 + 4 * i)] for i in range(5)]
    return [prefix + tail for tail in tails] + [prefix + tails[0]]


@pytest.mark.timeout(150)
def test_the_stream_rebuilds_the_map_through_eviction_gaps_and_reset(
    processes: Processes, addresses: dict
) -> None:
    port, replay_port = free_tcp_ports(2)
    events_config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": TOPIC.decode(),
    }
    config_json = json.dumps(events_config)
    small_pool = ["--num-gpu-blocks-override", "24", "--max-model-len", "256"]
    launch(processes, addresses, 1, "checksum", "--kv-events-config", config_json, *small_pool)
    ctx = zmq.Context()
    try:
        subscriber = MapSubscriber(ctx, events_config["endpoint"], events_config["replay_endpoint"])
        with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
            serve(client, wave_prompts(seed=1), "a")
            assert_map_rebuilt(subscriber, client, "after the first wave")
            num_gaps, subscriber.num_to_drop = subscriber.num_gaps, 2
            serve(client, wave_prompts(seed=2), "b")  # evicts the first wave's blocks
            assert_map_rebuilt(subscriber, client, "after eviction and a gap")
            assert subscriber.num_dropped == 2 and subscriber.num_gaps == num_gaps + 1
            assert subscriber.num_removed > 0, "the small pool evicted nothing"
            assert client.reset_prefix_cache() is True
            assert_map_rebuilt(subscriber, client, "after the reset")
            assert subscriber.num_cleared == 1 and subscriber.keys == set()
            serve(client, wave_prompts(seed=3), "c")
            assert_map_rebuilt(subscriber, client, "after a wave on the reset cache")
            assert subscriber.keys, "the last wave cached nothing"
    finally:
        ctx.destroy(linger=0)
    stop_launch(processes)
