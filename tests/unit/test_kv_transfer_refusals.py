"""What a prefill rank answers to pulls it refuses, what a decode rank says of pulls it cannot
run (worker/kv_transfer.py), and why a decode engine does not pull a handle
(engine_core/kv_transfer/pulls.py): every refusal names the field and the value it refused, so
an operator reading the log of a forged or broken peer knows what was wrong. The server is
called through `answer`, its one entry below the socket; nothing is bound.
"""

import msgspec
import pytest
import torch

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_transfer.pulls import KVTransferPulls
from protocol import PROTOCOL_VERSION
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from protocol.kv_transfer import (
    KVPin,
    KVPull,
    KVPullReply,
    KVTransferHandle,
    KVTransferLayout,
    KVTransferOrders,
)
from protocol.sampling import SamplingParams
from worker.kv_transfer import KVPullError, KVTransferRank

NUM_BLOCKS, PAGE_BYTES = 8, 16
LAYOUT = KVTransferLayout("checksum", 4, "float32", 1, PAGE_BYTES)
SECRET = "ab" * 16


@pytest.fixture
def rank() -> KVTransferRank:
    served = KVTransferRank(0, [torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.uint8)], LAYOUT)
    served.apply(KVTransferOrders(pins=[KVPin(3, SECRET, [2, 5])]))
    yield served
    served.close()


def refusal(rank: KVTransferRank, fields: object) -> str:
    """The server's reason for refusing the pull request laid out as `fields` (tag first)."""
    frame = msgspec.msgpack.encode(fields)
    reply = msgspec.msgpack.decode(rank.answer(frame)[0], type=KVPullReply)
    assert not reply.ok and reply.error is not None
    return reply.error


def pull_request(**changed: object) -> list[object]:
    """A KVPullRequest's wire fields, tag first, with `changed` ones replaced."""
    fields: dict[str, object] = dict(
        protocol_version=PROTOCOL_VERSION,
        rank=0,
        transfer_id=3,
        secret=SECRET,
        first_block_idx=0,
        block_ids=[2, 5],
        layout=list(msgspec.structs.astuple(LAYOUT)),
    )
    return ["KVPullRequest", *{**fields, **changed}.values()]


def test_a_malformed_pull_is_refused_naming_the_field_and_its_value(rank: KVTransferRank) -> None:
    reason = refusal(rank, pull_request(secret="zz" * 16))
    assert "secret" in reason and "zz" * 16 in reason
    reason = refusal(rank, pull_request(block_ids=[2, -5]))
    assert "block_ids[1]" in reason and "-5" in reason
    reason = refusal(rank, ["KVPullDone", PROTOCOL_VERSION, 0, "three", SECRET, 0, [2, 5]])
    assert "transfer_id" in reason and "'three'" in reason
    assert rank.num_served == 0 and rank.num_refused == 3


def test_a_pull_the_decode_rank_cannot_run_names_the_field_and_its_value() -> None:
    rank = KVTransferRank(0, [torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.uint8)], LAYOUT)
    try:
        pull = KVPull(1, 3, SECRET, ["inproc://p"], 0, [2, 5], [1, 2], LAYOUT)
        with pytest.raises(KVPullError, match=r"src_block_ids \[2, 5, 6\].* dst_block_ids"):
            rank.pull(msgspec.structs.replace(pull, src_block_ids=[2, 5, 6]))
        with pytest.raises(KVPullError, match=r"dst_block_ids \[1, 8\]"):
            rank.pull(msgspec.structs.replace(pull, dst_block_ids=[1, 8]))
        with pytest.raises(KVPullError, match=r"endpoints \[\]"):
            rank.pull(msgspec.structs.replace(pull, endpoints=[]))
    finally:
        rank.close()


@pytest.mark.parametrize(
    "fields",
    [[[[]]], ["Nope", 1], [["KVPullRequest"], 1], [], "KVPullRequest"],
    ids=["nested", "unknown-tag", "list-tag", "empty", "not-an-array"],
)
def test_any_frame_whatever_is_answered_with_a_refusal(
    rank: KVTransferRank, fields: object
) -> None:
    """The serving thread answers every frame: a reason it cannot spell as fields is msgspec's."""
    assert refusal(rank, fields).startswith("malformed pull: ")


def test_a_handle_the_decode_engine_does_not_pull_is_named_by_field_and_value() -> None:
    """KVTransferPulls._refusal: the handle's num_tokens, block_ids and endpoints, as they came,
    against what this engine expected (the request then computes its prompt)."""
    groups = [KVCacheGroupSpec(["layers.0"], FullAttentionSpec(4, 1, 4, "float32"))]
    pulls = KVTransferPulls(BlockPool(NUM_BLOCKS, enable_caching=True), 4, LAYOUT, groups)
    handle = KVTransferHandle("e", 3, SECRET, [2, 5], 9, ["inproc://p"], LAYOUT)
    request = EngineCoreRequest("r", pack_int32(list(range(9))), SamplingParams(), 0.0)

    def refusal_of(**changed: object) -> str | None:
        changed_handle = msgspec.structs.replace(handle, **changed)
        return pulls._refusal(msgspec.structs.replace(request, kv_transfer_handle=changed_handle))

    assert refusal_of() is None
    assert refusal_of(num_tokens=8) == "the handle's num_tokens 8 != the prompt's 9"
    assert refusal_of(endpoints=[]) == (
        "the handle's endpoints name 0 ranks: expected its layout's tp_size 1"
    )
    two_groups = KVTransferPulls(BlockPool(NUM_BLOCKS, True), 4, LAYOUT, groups * 2)
    odd = msgspec.structs.replace(
        request, kv_transfer_handle=msgspec.structs.replace(handle, block_ids=[2, 5, 6])
    )
    assert two_groups._refusal(odd) == (
        "the handle's block_ids hold 3 ids: expected one equal run per KV-cache group, of 2"
    )
