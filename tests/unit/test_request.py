"""Request: int32 tokens, block hashes that grow with generated tokens, status and order."""

from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_core.kv_cache.hashing import BlockHasher, first_block_extra_keys
from engine_core.sched.request import Request, RequestStatus
from protocol.client_messages import FinishReason
from protocol.sampling import SamplingParams

BLOCK_SIZE = 4
HASHER = BlockHasher(BLOCK_SIZE)


def make_request(token_ids: list[int], **kwargs: object) -> Request:
    return Request("r", token_ids, SamplingParams(), block_hasher=HASHER, **kwargs)


def test_tokens_live_in_one_int32_array() -> None:
    request = make_request([1, 2, 3])
    assert isinstance(request.all_token_ids, array) and request.all_token_ids.typecode == "i"
    request.append_output_token_ids(4)
    request.append_output_token_ids([5, 6])
    assert list(request.all_token_ids) == [1, 2, 3, 4, 5, 6]
    assert list(request.prompt_token_ids) == [1, 2, 3]
    assert list(request.output_token_ids) == [4, 5, 6]
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (6, 3, 3)


def test_prompt_hashes_cover_only_full_blocks() -> None:
    request = make_request(list(range(10)))
    assert request.block_hashes == HASHER.hash_prefix(list(range(10)))
    assert len(request.block_hashes) == 2


def test_block_hashes_grow_when_generated_tokens_fill_a_block() -> None:
    request = make_request(list(range(6)))
    assert len(request.block_hashes) == 1
    request.append_output_token_ids(6)
    assert len(request.block_hashes) == 1  # 7 tokens: block 1 is not full yet
    first_two = list(request.block_hashes)
    request.append_output_token_ids(7)
    assert len(request.block_hashes) == 2
    assert request.block_hashes[0] == first_two[0]  # earlier hashes never change
    assert request.block_hashes[1] == HASHER.hash_block(first_two[0], [4, 5, 6, 7])


@given(
    prompt=st.lists(st.integers(0, 1000), min_size=1, max_size=20),
    outputs=st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=5), max_size=6),
)
def test_incremental_hashes_equal_hashing_all_tokens_at_once(
    prompt: list[int], outputs: list[list[int]]
) -> None:
    request = make_request(prompt, cache_salt="s")
    for chunk in outputs:
        request.append_output_token_ids(chunk)
        expected = HASHER.hash_prefix(request.all_token_ids, first_block_extra_keys("s"))
        assert request.block_hashes == expected


def test_cache_salt_changes_every_block_hash() -> None:
    plain = make_request(list(range(8)))
    salted = make_request(list(range(8)), cache_salt="tenant")
    assert all(a != b for a, b in zip(plain.block_hashes, salted.block_hashes, strict=True))


def test_without_a_hasher_no_hashes_are_computed() -> None:
    request = Request("r", list(range(8)), SamplingParams())
    request.append_output_token_ids([1, 2, 3, 4])
    assert request.block_hashes == []


def test_new_request_is_waiting_with_nothing_computed() -> None:
    request = make_request([1, 2])
    assert request.status is RequestStatus.WAITING and not request.is_finished()
    assert request.num_computed_tokens == 0 and request.num_cached_tokens is None


def test_finished_statuses_map_to_finish_reasons() -> None:
    assert RequestStatus.FINISHED_STOPPED.finish_reason is FinishReason.STOP
    assert RequestStatus.FINISHED_LENGTH_CAPPED.finish_reason is FinishReason.LENGTH
    assert RequestStatus.FINISHED_ABORTED.finish_reason is FinishReason.ABORT
    assert RequestStatus.FINISHED_ERROR.finish_reason is FinishReason.ERROR
    assert RequestStatus.RUNNING.finish_reason is None and not RequestStatus.PREEMPTED.is_finished


def test_priority_order_is_priority_then_arrival_then_handle() -> None:
    early = make_request([1], priority=1, arrival_time=1.0, handle=2)
    late = make_request([1], priority=1, arrival_time=2.0, handle=1)
    urgent = make_request([1], priority=0, arrival_time=3.0, handle=3)
    tie = make_request([1], priority=1, arrival_time=1.0, handle=4)
    assert sorted([late, tie, early, urgent]) == [urgent, early, tie, late]


def test_check_invariants_names_a_request_computed_past_its_tokens() -> None:
    request = make_request(list(range(6)))
    request.check_invariants()
    request.num_computed_tokens = 7
    with pytest.raises(AssertionError, match="computed=7"):
        request.check_invariants()
