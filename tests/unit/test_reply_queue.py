"""ReplyQueue: held step replies leave in step order, each no earlier than its ready time."""

import time

from worker.reply_queue import ReplyQueue, sleep_until


def test_replies_leave_in_order_and_a_ready_one_waits_behind_one_that_is_not() -> None:
    queue = ReplyQueue()
    assert queue.next_ready_at() is None and queue.pop_due(1e9) == []
    queue.put(10.0, b"step 1")
    queue.put(5.0, b"step 2")  # ready first, but its step came second
    queue.put(12.0, b"step 3")
    assert queue.next_ready_at() == 10.0
    assert queue.pop_due(9.9) == []
    assert queue.pop_due(11.0) == [b"step 1", b"step 2"]
    assert len(queue) == 1 and queue.next_ready_at() == 12.0
    assert queue.pop_due(12.0) == [b"step 3"]
    assert len(queue) == 0


def test_drop_forgets_every_held_reply() -> None:
    queue = ReplyQueue()
    queue.put(1.0, b"a")
    queue.put(2.0, b"b")
    assert queue.drop() == 2
    assert len(queue) == 0 and queue.next_ready_at() is None and queue.drop() == 0


def test_sleep_until_returns_no_earlier_than_its_deadline() -> None:
    deadline = time.perf_counter() + 0.003
    sleep_until(deadline)
    assert time.perf_counter() >= deadline
    sleep_until(deadline - 1.0)  # passed already: returns at once
