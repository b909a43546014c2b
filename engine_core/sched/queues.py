"""The waiting queues of the scheduler: first come first served, or by (priority, arrival).

A queue holds `Request` objects only; it never touches their status or their blocks.
"""

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from engine_core.sched.request import Request
from protocol.config import SchedulingPolicy


class FCFSRequestQueue:
    """Requests in arrival order; a preempted request goes back to the front.

    Invariants: no request appears twice.
    """

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        """Put a preempted request first, so it resumes before anything newer."""
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek on an empty waiting queue")
        return self._queue[0]

    def pop_request(self) -> Request:
        if not self._queue:
            raise IndexError("pop on an empty waiting queue")
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = {id(request) for request in requests}
        self._queue = deque(request for request in self._queue if id(request) not in doomed)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def check_invariants(self) -> None:
        ids = [id(request) for request in self._queue]
        assert len(ids) == len(set(ids)), f"a request appears twice in the waiting queue: {ids}"


class PriorityRequestQueue:
    """Requests ordered by (priority, arrival_time, handle): lower values run first.

    A preempted request simply re-enters at its place in that order.
    Invariants: the list is a heap under `Request.__lt__`, and no request appears twice.
    """

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def prepend_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek on an empty waiting queue")
        return self._heap[0]

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop on an empty waiting queue")
        return heapq.heappop(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = {id(request) for request in requests}
        self._heap = [request for request in self._heap if id(request) not in doomed]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Requests in scheduling order (a sorted copy; the heap itself is not ordered)."""
        return iter(sorted(self._heap))

    def check_invariants(self) -> None:
        heap = self._heap
        for idx in range(1, len(heap)):
            parent = heap[(idx - 1) // 2]
            assert not heap[idx] < parent, f"waiting heap out of order at {idx}: {heap[idx]!r}"
        ids = [id(request) for request in heap]
        assert len(ids) == len(set(ids)), "a request appears twice in the waiting queue"


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    if policy == SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    raise ValueError(
        f"unknown scheduling policy {policy!r}: expected one of {list(SchedulingPolicy)}"
    )
