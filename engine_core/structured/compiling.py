"""CompilingRequests: the constrained requests an engine holds while their grammars compile off
the step loop, each until it is queued or refused. It never schedules and never builds a
Request: the EngineCore hands each one to the Scheduler once its grammar is ready.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_core.structured.manager import StructuredOutputManager
from protocol.client_messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from protocol.sampling import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar


@dataclass(frozen=True, slots=True)
class CompilingRequest:
    request: EngineCoreRequest
    client_id: bytes


class CompilingRequests:
    """Requests by scoped id, each with its grammar compiling on the manager's compile thread.

    Invariants: the keys are exactly the manager's compiles in flight (`manager.compiling`);
    `num_by_client` counts them by client, with no zero entries.
    """

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager
        self._requests: dict[str, CompilingRequest] = {}
        # a client's requests held here are live: they count toward its share of the engine
        self.num_by_client: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def __iter__(self) -> Iterator[tuple[str, CompilingRequest]]:
        """(scoped id, request), a snapshot: ending requests while iterating is safe."""
        return iter(list(self._requests.items()))

    def start(
        self, req_id: str, request: EngineCoreRequest, client_id: bytes, spec: StructuredOutputs
    ) -> None:
        """Hold `request` (scoped id `req_id`) while `spec` compiles."""
        self.manager.start_compile(req_id, spec)
        self._requests[req_id] = CompilingRequest(request, client_id)
        self.num_by_client[client_id] = self.num_by_client.get(client_id, 0) + 1

    def _release(self, req_id: str) -> CompilingRequest | None:
        held = self._requests.pop(req_id, None)
        if held is not None:
            num_held = self.num_by_client.pop(held.client_id) - 1
            if num_held:
                self.num_by_client[held.client_id] = num_held
        return held

    def has_ready(self) -> bool:
        """Whether some compile ended that `take_ready` has not handed over."""
        return self.manager.has_compiled()

    def take_ready(
        self,
    ) -> list[tuple[CompilingRequest, "xgrammar.CompiledGrammar | str"]]:
        """The requests whose compiles ended, oldest first, each with its compiled grammar or
        the reason it does not compile; they are no longer held."""
        return [
            (held, compiled)
            for req_id, compiled in self.manager.take_compiled()
            if (held := self._release(req_id)) is not None
        ]

    def end(
        self, req_id: str, finish_reason: FinishReason, error: str | None
    ) -> tuple[bytes, EngineCoreOutput] | None:
        """Stop holding a request whose grammar compiles (aborted, or the engine failed): its
        client and final output; None when `req_id` is not held."""
        held = self._release(req_id)
        if held is None:
            return None
        self.manager.cancel_compile(req_id)
        final = EngineCoreOutput(held.request.req_id, [], finish_reason, 0, error)
        return held.client_id, final

    def check_invariants(self) -> None:
        held, compiling = set(self._requests), set(self.manager.compiling)
        assert held == compiling, f"holding {sorted(held)}, compiling {sorted(compiling)}"
        counted: dict[bytes, int] = {}
        for one in self._requests.values():
            counted[one.client_id] = counted.get(one.client_id, 0) + 1
        assert counted == self.num_by_client, f"held {counted}, counted {self.num_by_client}"
