"""GrammarSteps: the Scheduler's side of structured outputs. It admits a constrained request's
grammar, says which rows of a step sample under a grammar and whether their bitmask rides the
step or follows it, and turns each sampled token into the grammar's verdict. Grammar state is
the StructuredOutputManager's; a Request is never changed here (the Scheduler owns it).
"""

import logging
from typing import TYPE_CHECKING

import msgspec

from engine_core.sched.in_flight_step import StepsInFlight
from engine_core.sched.request import Request, RequestStatus
from engine_core.structured.manager import StructuredOutputManager
from protocol.worker_messages import GrammarBitmask, SchedulerOutput

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

NO_VOCABULARY = (
    "structured outputs need the tokenizer's vocabulary, and this engine has none: serve a "
    "checkpoint folder holding tokenizer.json, or start the engine through `kvserve serve` or "
    "`LLM`, which name the tokenizer"
)

GrammarRows = tuple[list[int], list[int]]  # (handles, step rows) of a step's constrained rows


class GrammarSteps:
    """`manager`: the grammar owner; None refuses constrained requests.

    `defers_bitmask` (asynchronous scheduling through an executor that can send a step's bitmask
    after it): a constrained request keeps its one-step lookahead like any other. A step planned
    while an older one is in flight then says `grammar_bitmask_follows`, and the engine sends its
    bitmask (`take_bitmask`) once it has applied the older step's reply. Without it, a
    constrained request is planned for its next token only once its last one is back, and every
    bitmask rides its step.
    """

    def __init__(self, manager: StructuredOutputManager | None, defers_bitmask: bool) -> None:
        self.manager = manager
        self.defers_bitmask = defers_bitmask
        self._last_deferred_step_id = 0  # the last step whose bitmask followed it

    def admit(self, request: Request, compiled: "xgrammar.CompiledGrammar | None") -> str | None:
        """Start the grammar of a constrained request being queued (compiling it now unless
        `compiled` is given); why it cannot be served, or None."""
        spec = request.sampling_params.structured_outputs
        assert spec is not None, "admit is for constrained requests"
        if self.manager is None:
            return NO_VOCABULARY
        try:
            self.manager.add_request(request.handle, spec, compiled)
        except ValueError as exc:
            return str(exc)
        return None

    def skips_lookahead(self, request: Request) -> bool:
        """Whether a constrained request must wait for its last token before it is planned
        again: when its next bitmask cannot follow the step."""
        return request.sampling_params.structured_outputs is not None and not self.defers_bitmask

    def plan(
        self,
        output: SchedulerOutput,
        requests: list[Request],
        is_sampling: list[bool],
        has_older_step: bool,
    ) -> tuple[SchedulerOutput, GrammarRows | None]:
        """The step as sent, carrying its constrained rows' bitmask or saying that it follows,
        and those rows when it follows (for `take_bitmask`)."""
        manager = self.manager
        if manager is None or not manager.matchers:
            return output, None
        rows = grammar_rows(requests, is_sampling)
        if rows is None:
            return output, None
        if self.defers_bitmask and has_older_step:
            # the step in flight may sample a constrained request's last token, which its
            # bitmask here depends on: the bitmask follows once that step is applied
            return msgspec.structs.replace(output, grammar_bitmask_follows=True), rows
        # every constrained request's tokens are known: the bitmask rides the step
        return msgspec.structs.replace(output, grammar_bitmask=manager.grammar_bitmask(*rows)), None

    def take_bitmask(self, steps_in_flight: StepsInFlight) -> tuple[int, GrammarBitmask] | None:
        """(step id, bitmask) of the newest step in flight when its bitmask follows it and every
        older step is applied, so its constrained requests' grammars hold all their tokens but
        the ones it samples; None otherwise. A request that finished meanwhile gets a row that
        allows every token: what it samples is dropped."""
        if len(steps_in_flight) != 1:
            return None
        step = steps_in_flight.newest()
        if step.grammar_rows is None or step.step_id <= self._last_deferred_step_id:
            return None
        assert self.manager is not None  # it set grammar_rows
        self._last_deferred_step_id = step.step_id
        return step.step_id, self.manager.grammar_bitmask(*step.grammar_rows)

    def advance(self, request: Request, token_id: int) -> tuple[RequestStatus | None, str | None]:
        """Feed a constrained request's sampled token to its grammar: (FINISHED_STOPPED, None)
        once the grammar has ended, (FINISHED_ERROR, why) if it refuses the token, else none."""
        manager = self.manager
        assert manager is not None  # admission refuses constrained requests without one
        if not manager.accept_token(request.handle, token_id):
            error = (
                f"structured outputs: the grammar refused sampled token {token_id} at output "
                f"position {request.num_output_tokens - 1}"
            )
            logger.error("request %r: %s", request.client_req_id, error)
            return RequestStatus.FINISHED_ERROR, error
        if manager.is_terminated(request.handle):
            return RequestStatus.FINISHED_STOPPED, None
        return None, None

    def forget(self, request: Request) -> None:
        """Drop a finished request's grammar, if it had one."""
        if self.manager is not None:
            self.manager.remove_request(request.handle)

    def check_invariants(self, requests: list[Request]) -> None:
        """`requests`: the live ones; the constrained among them each have a matcher."""
        if self.manager is not None:
            self.manager.check_invariants(
                {r.handle for r in requests if r.sampling_params.structured_outputs is not None}
            )


def grammar_rows(requests: list[Request], is_sampling: list[bool]) -> GrammarRows | None:
    """(handles, step rows) of the step's constrained requests that sample; None if none."""
    handles: list[int] = []
    req_idxs: list[int] = []
    for req_idx, (request, samples) in enumerate(zip(requests, is_sampling, strict=True)):
        if samples and request.sampling_params.structured_outputs is not None:
            handles.append(request.handle)
            req_idxs.append(req_idx)
    return (handles, req_idxs) if handles else None
