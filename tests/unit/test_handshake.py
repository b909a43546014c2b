"""The engine's handshake rules (DESIGN.md §6) and the rank-agreement check, without sockets."""

import pytest

from engine_core.workers.handshake import (
    HandshakeError,
    check_hello,
    check_ready,
    describe_model_difference,
    missing_ranks,
)
from engine_core.workers.rank_agreement import describe_disagreement
from protocol import PROTOCOL_VERSION
from protocol.buffers import pack_int32
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from protocol.worker_messages import ModelInfo, ModelRunnerOutput, WorkerHello, WorkerReady

GROUPS = [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(4, 2, 8, "float32"))]
MODEL = ModelInfo("checksum", 1024, [], 256, GROUPS)


def hello(rank: int, tp_size: int = 2, model: ModelInfo = MODEL, **changes: object) -> WorkerHello:
    fields = dict(
        protocol_version=PROTOCOL_VERSION,
        rank=rank,
        tp_size=tp_size,
        pid=100 + rank,
        host="node",
        device="cpu",
        model_info=model,
        num_blocks_available=64,
    )
    fields.update(changes)
    return WorkerHello(**fields)


def test_a_group_of_valid_hellos_is_accepted() -> None:
    known: dict[int, WorkerHello] = {}
    for rank in (1, 0):
        check_hello(hello(rank), 2, known)
        known[rank] = hello(rank)
    assert missing_ranks(2, known) == []


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (hello(1, protocol_version=PROTOCOL_VERSION + 1), "speaks protocol version"),
        (hello(1, tp_size=4), "has tp_size=4, expected 2"),
        (hello(2), "outside the group: expected a rank in [0, 2)"),
        (hello(0), "duplicate rank 0 (pid 100 on node): rank 0 already joined from pid 100"),
        (hello(1, num_blocks_available=1), "can hold 1 blocks, expected at least 2"),
        (
            hello(1, model=ModelInfo("tiny-llama", 512, [2], 256, GROUPS)),
            "runs another model than rank 0: name is 'tiny-llama', expected 'checksum'",
        ),
    ],
)
def test_a_bad_hello_is_refused_with_what_differed(bad: WorkerHello, reason: str) -> None:
    with pytest.raises(HandshakeError) as refused:
        check_hello(bad, 2, {0: hello(0)})
    assert reason in str(refused.value)


def test_model_difference_names_the_first_differing_field() -> None:
    other = ModelInfo("checksum", 1024, [], 512, GROUPS)
    assert describe_model_difference(MODEL, other) == "max_model_len is 512, expected 256"
    assert describe_model_difference(MODEL, MODEL) is None


def test_ready_must_report_the_agreed_num_blocks_once() -> None:
    check_ready(WorkerReady(0, 40), 40, set())
    with pytest.raises(HandshakeError, match="allocated 39 blocks, expected 40"):
        check_ready(WorkerReady(1, 39), 40, {0})
    with pytest.raises(HandshakeError, match="WorkerReady twice"):
        check_ready(WorkerReady(0, 40), 40, {0})
    with pytest.raises(HandshakeError, match="ready for worker generation 1, expected 2"):
        check_ready(WorkerReady(0, 40, generation=1), 40, set(), generation=2)


def test_missing_ranks_are_named_in_order() -> None:
    assert missing_ranks(4, {2: hello(2)}) == [0, 1, 3]


def test_disagreeing_ranks_are_named() -> None:
    def output(rank: int, tokens: list[int]) -> ModelRunnerOutput:
        return ModelRunnerOutput(5, rank, pack_int32([1, 2]), pack_int32(tokens))

    agreeing = [output(0, [7, 8]), output(1, [7, 8]), output(2, [7, 8])]
    assert describe_disagreement(5, agreeing) is None
    differing = [output(0, [7, 8]), output(1, [7, 9]), output(2, [7, 8]), output(3, [0, 8])]
    assert describe_disagreement(5, differing) == (
        "ranks disagree on the tokens of step 5: rank(s) [1, 3] differ from rank 0"
    )
