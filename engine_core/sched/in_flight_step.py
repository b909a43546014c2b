"""InFlightStep: the step broadcast to the workers and not yet answered.

It checks that a worker's reply answers exactly that step, and never changes a request.
"""

from dataclasses import dataclass

from engine_core.sched.request import Request
from protocol.buffers import unpack_int32
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True, slots=True, eq=False)
class InFlightStep:
    """One scheduled step: its id, and its requests in SchedulerOutput order.

    Invariants: `handles` holds one int32 handle per request, each that request's own, in order,
    and `is_sampling` one flag per request.
    """

    step_id: int
    requests: list[Request]
    handles: bytes  # int32 handles of `requests`, as every rank must echo them
    is_sampling: list[bool]  # per request: the step reaches its end and samples a real token

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
