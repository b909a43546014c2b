"""The rank-to-rank transfer of P/D over real sockets, in one process: a prefill rank's server
(ipc, and tcp with the deployment's CURVE keys) and a decode rank's puller, on CPU page tensors.

The pulled pages equal the served ones; a pull of blocks outside the pin, with another secret,
from another rank or layout, or after the unpin is refused and reads nothing; a peer holding
other CURVE keys is refused by the rank's ZAP handler before a frame passes; a server that is gone
costs the pull a timeout.
"""

import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from deploy.keys import keygen, load_curve_keys
from protocol import PROTOCOL_VERSION
from protocol.kv_transfer import (
    KVPin,
    KVPull,
    KVPullRequest,
    KVTransferLayout,
    KVTransferOrders,
)
from worker import kv_transfer
from worker.kv_transfer import KVTransferRank

pytestmark = pytest.mark.integration

NUM_BLOCKS, PAGE_BYTES, NUM_TENSORS = 16, 64, 2
LAYOUT = KVTransferLayout("checksum", 4, "float32", 1, PAGE_BYTES * NUM_TENSORS)
SECRET = "ab" * 16


def pages(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (NUM_BLOCKS, PAGE_BYTES), dtype=torch.uint8, generator=generator)
        for _ in range(NUM_TENSORS)
    ]


def pull_of(endpoint: str, first: int, src: list[int], dst: list[int], **changes: object) -> KVPull:
    pull = KVPull(0, 1, SECRET, [endpoint], first, src, dst, LAYOUT)
    return msgspec.structs.replace(pull, **changes)


def run_pulls(rank: KVTransferRank, pulls: list[KVPull]) -> tuple[list[int], int]:
    """Order `pulls` (numbered 1, 2, ...) as a step would, and wait until the puller thread
    reported each: the failed ones' numbers, and the bytes moved."""
    numbered = [msgspec.structs.replace(pull, pull_id=idx + 1) for idx, pull in enumerate(pulls)]
    rank.apply(KVTransferOrders(pulls=numbered))
    finished: list[int] = []
    failed: list[int] = []
    num_bytes = 0
    deadline = time.monotonic() + 30
    while len(finished) < len(pulls):
        assert time.monotonic() < deadline, f"pulls {finished} of {len(pulls)} reported"
        done, done_failed, done_bytes = rank.take_finished()
        finished += done
        failed += done_failed
        num_bytes += done_bytes
        time.sleep(0.01)
    assert sorted(finished) == list(range(1, len(pulls) + 1))
    return sorted(failed), num_bytes


def check_transfer(server: KVTransferRank, client: KVTransferRank, endpoint: str) -> None:
    server.apply(KVTransferOrders(pins=[KVPin(1, SECRET, [3, 7, 5, 9])]))
    failed, num_bytes = run_pulls(client, [pull_of(endpoint, 1, [7, 5], [2, 4])])
    assert failed == [] and num_bytes == 2 * PAGE_BYTES * NUM_TENSORS
    for served, pulled in zip(server.device_pages, client.device_pages, strict=True):
        assert torch.equal(pulled[[2, 4]], served[[7, 5]])
    # over ipc the pages came through a /dev/shm segment, which the puller removed
    assert server._shm.num_made == endpoint.startswith("ipc://")
    server._shm.sweep()
    assert not server._shm.made
    before = [tensor.clone() for tensor in client.device_pages]
    refused = [
        pull_of(endpoint, 0, [7, 5], [6, 8]),  # not where they were pinned
        pull_of(endpoint, 3, [9, 10], [6, 8]),  # past the pin
        pull_of(endpoint, 0, [3], [6], secret="cd" * 16),
        pull_of(endpoint, 0, [3], [6], transfer_id=2),
        pull_of(endpoint, 0, [3], [6], layout=msgspec.structs.replace(LAYOUT, block_size=8)),
    ]
    failed, _ = run_pulls(client, refused)
    assert len(failed) == len(refused) and server.num_refused == len(refused)
    server.apply(KVTransferOrders(unpins=[1]))
    failed, _ = run_pulls(client, [pull_of(endpoint, 0, [3], [6])])
    assert failed == [1]
    assert all(torch.equal(a, b) for a, b in zip(before, client.device_pages, strict=True))


@pytest.mark.timeout(60)
def test_ipc_pulls_move_pinned_pages_only(tmp_path: Path) -> None:
    server, client = KVTransferRank(0, pages(1), LAYOUT), KVTransferRank(0, pages(2), LAYOUT)
    try:
        endpoint = server.serve(f"ipc://{tmp_path}", generation=1)
        check_transfer(server, client, endpoint)
    finally:
        server.close()
        client.close()


@pytest.mark.timeout(90)
def test_tcp_pulls_with_curve_admit_only_the_worker_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keygen(tmp_path / "keys")
    worker_keys = load_curve_keys(tmp_path / "keys", "worker")
    server = KVTransferRank(0, pages(1), LAYOUT, worker_keys)
    client = KVTransferRank(0, pages(2), LAYOUT, worker_keys)
    monkeypatch.setattr(kv_transfer, "PULL_TIMEOUT_S", 1.0)
    client_keys = load_curve_keys(tmp_path / "keys", "client")
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)  # knows the server's key, holds another keypair
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.setsockopt(zmq.CURVE_SERVERKEY, worker_keys.public_key.encode())
    stranger.setsockopt(zmq.CURVE_PUBLICKEY, client_keys.public_key.encode())
    stranger.setsockopt(zmq.CURVE_SECRETKEY, client_keys.secret_key.encode())
    try:
        endpoint = server.serve("tcp://127.0.0.1", generation=1)
        assert endpoint.startswith("tcp://127.0.0.1:")
        check_transfer(server, client, endpoint)
        server.apply(KVTransferOrders(pins=[KVPin(1, SECRET, [3])]))
        num_refused = server.num_refused
        stranger.connect(endpoint)
        request = KVPullRequest(PROTOCOL_VERSION, 0, 1, SECRET, 0, [3], LAYOUT)
        stranger.send(msgspec.msgpack.encode(request))
        assert not stranger.poll(1000), "a peer with other keys got an answer"
        assert server.num_refused == num_refused + 1  # by ZAP, before any frame
        # a server that is gone: the pull times out and reads nothing
        server.close()
        failed, _ = run_pulls(client, [pull_of(endpoint, 0, [3], [6])])
        assert failed == [1]
    finally:
        server.close()
        client.close()
        stranger.close()
        ctx.term()


@pytest.mark.timeout(60)
def test_a_wildcard_tcp_address_announces_the_host_that_routes_to_the_engine() -> None:
    server, client = KVTransferRank(0, pages(1), LAYOUT), KVTransferRank(0, pages(2), LAYOUT)
    try:
        endpoint = server.serve("tcp://*", generation=1, peer_address="tcp://127.0.0.1:5560")
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
        check_transfer(server, client, endpoint)
    finally:
        server.close()
        client.close()


@pytest.mark.timeout(60)
def test_pulls_by_position_move_several_groups_blocks_and_never_the_null_block(
    tmp_path: Path,
) -> None:
    """A hybrid model's pin holds one run per KV-cache group, NULL_BLOCK_ID where a sliding
    window dropped a block: a pull names each block's position in it (src_block_idxs), and
    the null block, or a block named at another position, is refused."""
    server, client = KVTransferRank(0, pages(1), LAYOUT), KVTransferRank(0, pages(2), LAYOUT)
    try:
        endpoint = server.serve(f"ipc://{tmp_path}", generation=1)
        server.apply(KVTransferOrders(pins=[KVPin(1, SECRET, [3, 4, 0, 7, 5, 9])]))
        pull = pull_of(endpoint, 0, [9, 4], [2, 6], src_block_idxs=[5, 1])
        failed, num_bytes = run_pulls(client, [pull])
        assert failed == [] and num_bytes == 2 * PAGE_BYTES * NUM_TENSORS
        for served, pulled in zip(server.device_pages, client.device_pages, strict=True):
            assert torch.equal(pulled[[2, 6]], served[[9, 4]])
        refused = [
            pull_of(endpoint, 0, [0], [8], src_block_idxs=[2]),  # the null block
            pull_of(endpoint, 0, [7], [8], src_block_idxs=[4]),  # pinned, at another place
            pull_of(endpoint, 0, [7], [8], src_block_idxs=[6]),  # past the pin
        ]
        failed, _ = run_pulls(client, refused)
        assert failed == [1, 2, 3] and server.num_refused == 3
    finally:
        server.close()
        client.close()


@pytest.mark.timeout(60)
def test_a_decode_rank_of_a_larger_tp_size_pulls_its_slice_of_the_heads(tmp_path: Path) -> None:
    """Prefill TP 1, decode TP 2: decode rank 1 pulls from prefill rank 0 the second half of
    each page's KV heads (pages of 8 rows of 4 heads of 2 bytes here), exactly as its own."""
    head_view = (8, 4, 2)  # 8 * 4 * 2 == PAGE_BYTES
    server = KVTransferRank(0, pages(1), LAYOUT, head_view=head_view)
    half = msgspec.structs.replace(LAYOUT, tp_size=2, page_bytes=LAYOUT.page_bytes // 2)
    client = KVTransferRank(1, [page[:, : PAGE_BYTES // 2].clone() for page in pages(2)], half)
    try:
        endpoint = server.serve(f"ipc://{tmp_path}", generation=1)
        server.apply(KVTransferOrders(pins=[KVPin(1, SECRET, [3, 7, 5])]))
        failed, num_bytes = run_pulls(client, [pull_of(endpoint, 1, [7, 5], [2, 4], layout=half)])
        assert failed == [] and num_bytes == 2 * PAGE_BYTES // 2 * NUM_TENSORS
        for served, pulled in zip(server.device_pages, client.device_pages, strict=True):
            heads = served[[7, 5]].reshape(2, 8, 4, 2)[:, :, 2:4, :].reshape(2, -1)
            assert torch.equal(pulled[[2, 4]], heads)
        # a decode side whose pages do not split this one's (TP 3 of whole pages) is refused
        odd = msgspec.structs.replace(LAYOUT, tp_size=3)
        failed, _ = run_pulls(client, [pull_of(endpoint, 1, [7], [6], layout=odd)])
        assert failed == [1] and server.num_refused == 1
    finally:
        server.close()
        client.close()
