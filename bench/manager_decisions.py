"""The decisions of a KVCacheManager replay: recorded by the vLLM peer, checked by kvserve.

Standard library only, like bench/replay.py, so the peer (which never imports kvserve) records with
it. A decision is a prefix hit (its length in tokens) or a refused allocation. The checking side
wraps its manager, compares each decision with the peer's as it is made, and stops the replay at
the first one that differs.
"""

from typing import Any

Decision = tuple[str, int, int]  # ("hit", request index, hit tokens) or ("full", index, 0)


class DecisionMismatch(Exception):
    """The first decision where the two managers disagree, with the agreed run before it."""


class RecordingManager:
    """Forwards ManagerReplay's calls to `manager` and appends each decision to `decisions`.

    Requests are named by their index in the replay's list, so both sides name them alike.
    Invariants: `decisions` holds one entry per lookup and per refused allocation, in call order.
    """

    def __init__(self, manager: Any, requests: list) -> None:
        self.manager = manager
        self.request_idx = {id(request): idx for idx, request in enumerate(requests)}
        self.decisions: list[Decision] = []

    def get_computed_blocks(self, request: Any) -> Any:
        computed = self.manager.get_computed_blocks(request)
        self.record(("hit", self.request_idx[id(request)], computed[1]))
        return computed

    def allocate_slots(self, request: Any, *args: Any) -> Any:
        new_blocks = self.manager.allocate_slots(request, *args)
        if new_blocks is None:
            self.record(("full", self.request_idx[id(request)], 0))
        return new_blocks

    def free(self, request: Any) -> None:
        self.manager.free(request)

    def record(self, decision: Decision) -> None:
        self.decisions.append(decision)


class CheckingManager(RecordingManager):
    """A RecordingManager that raises DecisionMismatch at the first decision unlike `expected`."""

    def __init__(self, manager: Any, requests: list, expected: list[Decision]) -> None:
        super().__init__(manager, requests)
        self.expected = expected

    def record(self, decision: Decision) -> None:
        idx = len(self.decisions)
        theirs = self.expected[idx] if idx < len(self.expected) else None
        if decision != theirs:
            raise DecisionMismatch(
                f"decision {idx} differs: kvserve {decision}, vllm {theirs} "
                f"(the {idx} before agreed; last agreed: {self.decisions[-3:]})"
            )
        self.decisions.append(decision)

    def check_complete(self) -> None:
        """The replay ended where the peer's did, with no decision of the peer's left over."""
        if len(self.decisions) != len(self.expected):
            raise DecisionMismatch(
                f"kvserve made {len(self.decisions)} decisions, vllm {len(self.expected)}: "
                f"the next vllm one is {self.expected[len(self.decisions)]}"
            )
