"""The steps in flight: each step broadcast to the workers and not yet answered, oldest first.

StepsInFlight is the engine's one record of them: the Scheduler owns it, and the EngineCore and
the worker transport ask it rather than keeping their own. It checks that a worker's reply answers
exactly the oldest step, and never changes a request: the Scheduler applies the reply.
"""

from collections import deque
from dataclasses import dataclass

from engine_core.sched.request import Request
from protocol.buffers import unpack_int32
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True, slots=True, eq=False)
class InFlightStep:
    """One scheduled step: its id, the message sent, and its requests in SchedulerOutput order.

    Invariants: `handles` holds one int32 handle per request, each that request's own, in order,
    and `is_sampling` one flag per request.
    """

    step_id: int
    requests: list[Request]
    handles: bytes  # int32 handles of `requests`, as every rank must echo them
    is_sampling: list[bool]  # per request: the step reaches its end and samples a real token
    scheduler_output: SchedulerOutput  # the message broadcast for this step
    has_logprobs: bool = False  # some request live when it was scheduled asked for logprobs
    # per request, (first position, count) of its chunk; None: no live request asked for
    # prompt logprobs when it was scheduled
    chunks: list[tuple[int, int]] | None = None
    # (handles, step rows) of its constrained requests that sample, when their grammar bitmask
    # follows the step (asynchronous scheduling); None: it rode the step, or there is none
    grammar_rows: tuple[list[int], list[int]] | None = None

    def check_reply(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        """Raise ValueError unless the reply answers this step, for its requests in order."""
        step_id = self.step_id
        if scheduler_output.step_id != step_id or model_runner_output.step_id != step_id:
            raise ValueError(
                f"output for step {model_runner_output.step_id} (scheduled "
                f"{scheduler_output.step_id}): expected step {step_id}"
            )
        if len(model_runner_output.sampled_token_ids) != len(self.handles):
            raise ValueError(
                f"rank {model_runner_output.rank} sampled "
                f"{len(model_runner_output.sampled_token_ids) // 4} tokens for step {step_id}: "
                f"expected one for each of its {len(self.requests)} requests"
            )
        if model_runner_output.handles != self.handles:
            raise ValueError(
                f"rank {model_runner_output.rank} answered step {step_id} for other requests: "
                f"expected {len(self.requests)} handles in SchedulerOutput order"
            )

    def check_invariants(self) -> None:
        assert len(self.is_sampling) == len(self.requests), (
            f"step {self.step_id}: {len(self.is_sampling)} sampling flags, "
            f"{len(self.requests)} requests"
        )
        handles = unpack_int32(self.handles).tolist()
        assert handles == [request.handle for request in self.requests], (
            f"step {self.step_id} has handles {handles} for {len(self.requests)} requests"
        )
        assert self.scheduler_output.step_id == self.step_id, (
            f"step {self.step_id} holds the message of step {self.scheduler_output.step_id}"
        )
        follows = self.scheduler_output.grammar_bitmask_follows
        assert follows == (self.grammar_rows is not None), (
            f"step {self.step_id}: grammar_bitmask_follows {follows} with grammar rows "
            f"{self.grammar_rows}"
        )


class StepsInFlight:
    """The steps broadcast and not yet answered, oldest first: at most one in the synchronous
    loop; two with asynchronous scheduling, which schedules step N+1 while the ranks run step N.

    A step leaves when its reply is applied, or with every other step when none of them will
    ever be answered (a failed worker, a lost worker generation).

    Invariants: at most `max_num_steps` steps, with consecutive step ids, oldest first.
    """

    def __init__(self, max_num_steps: int) -> None:
        self.max_num_steps = max_num_steps
        self._steps: deque[InFlightStep] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def can_add(self) -> bool:
        return len(self._steps) < self.max_num_steps

    def add(self, step: InFlightStep) -> None:
        """Record a step just scheduled, which `can_add` allowed."""
        assert len(self._steps) < self.max_num_steps, f"step {step.step_id}: no room in flight"
        self._steps.append(step)

    def newest(self) -> InFlightStep:
        """The step scheduled last."""
        if not self._steps:
            raise RuntimeError("no step is in flight")
        return self._steps[-1]

    def oldest(self) -> InFlightStep:
        """The step the next reply must answer."""
        if not self._steps:
            raise RuntimeError("no step is in flight")
        return self._steps[0]

    def pop_answered(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> InFlightStep:
        """Remove and return the oldest step, after checking that the output answers it."""
        if not self._steps:
            raise RuntimeError("update_from_output called with no step in flight")
        self._steps[0].check_reply(scheduler_output, model_runner_output)
        return self._steps.popleft()

    def forget(self) -> None:
        """Drop every step: none will be answered (a worker failed, or its generation is gone)."""
        self._steps.clear()

    def check_invariants(self) -> None:
        steps = self._steps
        assert len(steps) <= self.max_num_steps, (
            f"{len(steps)} steps in flight, at most {self.max_num_steps}"
        )
        step_ids = [step.step_id for step in steps]
        if steps:
            first_id = step_ids[0]
            assert step_ids == list(range(first_id, first_id + len(steps))), (
                f"steps in flight {step_ids} are not consecutive"
            )
        for step in steps:
            step.check_invariants()
