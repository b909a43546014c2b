"""StepStream: steps run in order on their own thread; replies (with ready times) come back in
step order through take_results, and a failing step is raised there, with no later step run."""

import select
import time

import pytest
import torch

from protocol.worker_messages import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from worker.step_stream import StepStream

WAIT_S = 10.0


class RecordingRunner:
    """Stands in for a ModelRunner: answers each step, slowly, and fails the ones it is told to."""

    def __init__(self, failing_step: int | None = None) -> None:
        self.failing_step = failing_step
        self.ran: list[int] = []
        self.ready_at_s = 0.0
        self.device = torch.device("cpu")

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if step.step_id == self.failing_step:
            raise RuntimeError(f"step {step.step_id} failed")
        time.sleep(0.002)  # long enough that later steps queue behind it
        self.ran.append(step.step_id)
        self.ready_at_s = 1000.0 + step.step_id
        return ModelRunnerOutput(step.step_id, 0, b"", b"", 1)


def make_step(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(step_id, [], CachedRequestData(), b"", 0, [], [])


def take(stream: StepStream, count: int) -> list[tuple[float, bytes]]:
    """At least `count` results, waiting on the stream's wake pipe."""
    results: list[tuple[float, bytes]] = []
    deadline = time.monotonic() + WAIT_S
    while len(results) < count:
        assert time.monotonic() < deadline, f"{len(results)} of {count} results"
        select.select([stream.fileno()], [], [], 0.1)
        results.extend(stream.take_results())
    return results


def test_steps_run_in_order_and_their_replies_come_back_in_order() -> None:
    runner = RecordingRunner()
    stream = StepStream(runner)  # type: ignore[arg-type]
    for step_id in range(1, 6):
        stream.submit(make_step(step_id))
    results = take(stream, 5)
    assert runner.ran == [1, 2, 3, 4, 5]
    assert [ready_at for ready_at, _ in results] == [1001.0, 1002.0, 1003.0, 1004.0, 1005.0]
    stream.close(WAIT_S)


def test_a_failing_step_is_raised_to_the_caller_and_no_later_step_runs() -> None:
    runner = RecordingRunner(failing_step=2)
    stream = StepStream(runner)  # type: ignore[arg-type]
    for step_id in range(1, 5):
        stream.submit(make_step(step_id))
    deadline = time.monotonic() + WAIT_S
    with pytest.raises(RuntimeError, match="step 2 failed"):
        while time.monotonic() < deadline:
            select.select([stream.fileno()], [], [], 0.1)
            stream.take_results()
    assert runner.ran == [1]
    assert stream.failed_step_id == 2
    stream.close(WAIT_S)
