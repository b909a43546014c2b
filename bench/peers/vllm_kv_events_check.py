"""A subscriber written against vLLM 0.33.0's own KV-event types reads a live kvserve stream, then
replays it through vLLM's replay protocol, and prints what it found as one JSON line.

Driven by bench/kv_events_wire.py: prints `ready` once subscribed, and stops at `stop` on stdin.
Runs under the peer interpreter and never imports kvserve.
"""

import argparse
import json
import select
import sys
import time

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

POLL_MS = 50
QUIET_S = 1.0  # after `stop`, the stream is over once this long passes without a frame
STOP_TIMEOUT_S = 600.0  # the driver must say `stop` within this
REPLAY_WAIT_MS = 10_000  # the longest wait for one replay frame
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", required=True, help="the engine's KV-event PUB address")
    parser.add_argument("--replay-endpoint", required=True, help="its replay ROUTER address")
    parser.add_argument("--topic", default="", help="the topic kvserve publishes under")
    return parser.parse_args()


def receive_live(sub: zmq.Socket) -> list[tuple[bytes, int, bytes]]:
    """(topic, seq, payload) of every frame until `stop` on stdin and QUIET_S of silence."""
    frames: list[tuple[bytes, int, bytes]] = []
    deadline_s = time.monotonic() + STOP_TIMEOUT_S
    stop_s: float | None = None
    last_frame_s = time.monotonic()
    while time.monotonic() < deadline_s:
        if sub.poll(POLL_MS):
            topic, seq, payload = sub.recv_multipart()
            frames.append((topic, int.from_bytes(seq, "big"), payload))
            last_frame_s = time.monotonic()
        elif stop_s is None and select.select([sys.stdin], [], [], 0)[0]:
            sys.stdin.readline()  # `stop`, or the end of stdin when the driver is gone
            stop_s = time.monotonic()
        if stop_s is not None and time.monotonic() - max(stop_s, last_frame_s) > QUIET_S:
            return frames
    raise TimeoutError(f"no stop on stdin in {STOP_TIMEOUT_S} s")


def replay(ctx: zmq.Context, endpoint: str, start_seq: int) -> tuple[list[list[bytes]], bool]:
    """vLLM's replay protocol: the answer frames before the end marker, and whether that marker
    is exactly (b"", b"", -1, b"")."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start_seq.to_bytes(8, "big", signed=True)))
    answers: list[list[bytes]] = []
    try:
        while True:
            if not dealer.poll(REPLAY_WAIT_MS):
                raise TimeoutError(f"no replay frame from {endpoint} in {REPLAY_WAIT_MS} ms")
            frames = dealer.recv_multipart()
            if len(frames) == 4 and frames[2] == END_OF_REPLAY:
                return answers, frames == [b"", b"", END_OF_REPLAY, b""]
            answers.append(frames)
    finally:
        dealer.close()


def apply(batch: KVEventBatch, keys: set[str], counts: dict[str, int]) -> None:
    """A router's view: the cached hashes as `hash_hex:group_idx`."""
    for event in batch.events:
        counts[type(event).__name__] += 1
        if isinstance(event, BlockStored):
            keys.update(f"{h.hex()}:{event.group_idx}" for h in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            keys.difference_update(f"{h.hex()}:{event.group_idx}" for h in event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            keys.clear()


def check_payloads(payloads: list[bytes]) -> dict:
    """Decode each payload with vLLM's KVEventBatch decoder and re-encode it with vLLM's encoder."""
    decoder, encoder = msgspec.msgpack.Decoder(KVEventBatch), msgspec.msgpack.Encoder()
    num_errors = num_mismatches = 0
    keys: set[str] = set()
    counts = dict.fromkeys(("BlockStored", "BlockRemoved", "AllBlocksCleared"), 0)
    media: set[str] = set()
    ranks: set[str] = set()
    for payload in payloads:
        try:
            batch = decoder.decode(payload)
        except msgspec.DecodeError:
            num_errors += 1
            continue
        num_mismatches += encoder.encode(batch) != payload
        ranks.add(str(batch.data_parallel_rank))
        media.update(str(e.medium) for e in batch.events if not isinstance(e, AllBlocksCleared))
        apply(batch, keys, counts)
    return {
        "num_decode_errors": num_errors,
        "num_reencode_mismatches": num_mismatches,
        "event_counts": counts,
        "media": sorted(media),
        "data_parallel_ranks": sorted(ranks),
        "keys": sorted(keys),
    }


def main() -> None:
    args = parse_args()
    topic = args.topic.encode()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(args.endpoint)
    print("ready", flush=True)
    live = receive_live(sub)
    answers, is_end_marker_vllms = replay(ctx, args.replay_endpoint, 0)
    replayed = {int.from_bytes(f[2], "big"): f for f in answers if len(f) == 4}
    live_seqs = [seq for _, seq, _ in live]
    middle = len(replayed) // 2
    middle_answers, _ = replay(ctx, args.replay_endpoint, middle)
    result = {
        "num_live": len(live),
        "first_live_seq": live_seqs[0] if live_seqs else None,
        "is_live_consecutive": live_seqs == list(range(live_seqs[0], live_seqs[0] + len(live)))
        if live_seqs
        else False,
        "num_live_wrong_topic": sum(t != topic for t, _, _ in live),
        "num_replayed": len(answers),
        "is_replay_shape_vllms": all(len(f) == 4 and f[:2] == [b"", topic] for f in answers),
        "is_replay_from_0_complete": sorted(replayed) == list(range(len(answers))),
        "is_end_marker_vllms": is_end_marker_vllms,
        "is_middle_replay_right": [int.from_bytes(f[2], "big") for f in middle_answers]
        == list(range(middle, len(answers))),
        "num_live_replay_mismatches": sum(
            seq not in replayed or replayed[seq][3] != payload for _, seq, payload in live
        ),
        "live": check_payloads([payload for _, _, payload in live]),
        "replay": check_payloads([replayed[seq][3] for seq in sorted(replayed)]),
    }
    ctx.destroy(linger=0)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
