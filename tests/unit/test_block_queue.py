"""FreeKVCacheBlockQueue: exact order after every operation, and errors that name the block."""

import pytest

from engine_core.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock


def make_queue(num_blocks: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(idx) for idx in range(num_blocks)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def queued_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    queue.check_invariants()
    return [block.block_id for block in queue.get_all_free_blocks()]


def test_new_queue_holds_blocks_in_id_order() -> None:
    _, queue = make_queue(4)
    assert queued_ids(queue) == [0, 1, 2, 3]
    assert queue.num_free_blocks == 4 and len(queue) == 4


def test_empty_queue_links_head_to_tail() -> None:
    _, queue = make_queue(0)
    assert queued_ids(queue) == []
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail


def test_popleft_takes_the_head_and_unlinks_it() -> None:
    blocks, queue = make_queue(3)
    assert queue.popleft() is blocks[0]
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    assert queued_ids(queue) == [1, 2]


def test_popleft_on_empty_queue_raises() -> None:
    _, queue = make_queue(1)
    queue.popleft()
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()
    assert queued_ids(queue) == []


def test_popleft_n_takes_blocks_in_queue_order() -> None:
    blocks, queue = make_queue(5)
    popped = queue.popleft_n(3)
    assert popped == blocks[:3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    assert queued_ids(queue) == [3, 4]


def test_popleft_n_zero_returns_empty_list() -> None:
    _, queue = make_queue(2)
    assert queue.popleft_n(0) == []
    assert queued_ids(queue) == [0, 1]


def test_popleft_n_all_blocks_empties_the_queue() -> None:
    blocks, queue = make_queue(3)
    assert queue.popleft_n(3) == blocks
    assert queued_ids(queue) == []


@pytest.mark.parametrize("num_blocks", [4, -1])
def test_popleft_n_beyond_free_count_or_negative_raises_and_changes_nothing(
    num_blocks: int,
) -> None:
    _, queue = make_queue(3)
    with pytest.raises(ValueError, match=f"cannot pop {num_blocks} blocks"):
        queue.popleft_n(num_blocks)
    assert queued_ids(queue) == [0, 1, 2]


def test_remove_unlinks_a_block_from_the_middle() -> None:
    blocks, queue = make_queue(4)
    queue.remove(blocks[2])
    assert queued_ids(queue) == [0, 1, 3]
    queue.remove(blocks[0])
    queue.remove(blocks[3])
    assert queued_ids(queue) == [1]


def test_remove_of_a_block_not_in_the_queue_raises_naming_it() -> None:
    blocks, queue = make_queue(3)
    queue.remove(blocks[1])
    with pytest.raises(ValueError, match="block 1: it is not in the free queue"):
        queue.remove(blocks[1])
    assert queued_ids(queue) == [0, 2]


def test_append_puts_a_block_at_the_tail() -> None:
    _, queue = make_queue(3)
    first = queue.popleft()
    queue.append(first)
    assert queued_ids(queue) == [1, 2, 0]


def test_append_n_keeps_the_given_order_at_the_tail() -> None:
    _, queue = make_queue(5)
    popped = queue.popleft_n(3)
    queue.append_n([popped[2], popped[0], popped[1]])
    assert queued_ids(queue) == [3, 4, 2, 0, 1]


def test_prepend_n_puts_the_first_given_block_at_the_head() -> None:
    blocks, queue = make_queue(5)
    popped = queue.popleft_n(3)
    queue.prepend_n([popped[2], popped[1]])
    assert queued_ids(queue) == [2, 1, 3, 4]
    assert queue.popleft() is blocks[2]


def test_prepend_n_and_append_n_into_an_empty_queue() -> None:
    _, queue = make_queue(4)
    popped = queue.popleft_n(4)
    queue.prepend_n(popped[:2])
    queue.append_n(popped[2:])
    assert queued_ids(queue) == [0, 1, 2, 3]


def test_empty_append_n_and_prepend_n_change_nothing() -> None:
    _, queue = make_queue(2)
    queue.append_n([])
    queue.prepend_n([])
    assert queued_ids(queue) == [0, 1]


def test_check_invariants_catches_a_broken_count() -> None:
    _, queue = make_queue(3)
    queue.num_free_blocks = 2
    with pytest.raises(AssertionError, match="num_free_blocks is 2"):
        queue.check_invariants()


def test_check_invariants_catches_a_broken_back_link() -> None:
    blocks, queue = make_queue(3)
    blocks[2].prev_free_block = blocks[0]
    with pytest.raises(AssertionError, match="links back"):
        queue.check_invariants()


def test_block_repr_names_neighbours_by_id() -> None:
    blocks, _ = make_queue(3)
    assert "prev=0, next=2" in repr(blocks[1])
