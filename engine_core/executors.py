"""The executors an EngineCore steps over: one step at a time (Executor), or a step sent before
the previous one is answered (PipelinedExecutor, asynchronous scheduling), and SerialPipeline,
which gives an in-process executor that pair. They run steps; they never schedule.
"""

from collections import deque
from typing import Protocol, runtime_checkable

import msgspec

from protocol.worker_messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    """Runs one step on every rank and returns the agreed sampled tokens; raises on failure."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@runtime_checkable
class PipelinedExecutor(Executor, Protocol):
    """An executor that can send a step before the previous one is answered (WorkerGroup)."""

    def submit(self, scheduler_output: SchedulerOutput) -> None: ...

    def send_grammar_bitmask(self, step_id: int, grammar_bitmask: GrammarBitmask) -> None:
        """The bitmask of step `step_id`, submitted with `grammar_bitmask_follows` and not yet
        collected; sent before any later step."""
        ...

    def collect(self, step_id: int) -> ModelRunnerOutput: ...


class SerialPipeline:
    """Gives an in-process executor (a ModelRunner in tests and benchmarks) the submit/collect
    pair: each step runs when submitted, and its output waits to be collected in order. A step
    whose grammar bitmask follows it waits, with every step behind it, until the bitmask comes;
    it then runs with the bitmask inlined, as a synchronous step would carry it."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._outputs: deque[ModelRunnerOutput] = deque()
        self._waiting: deque[SchedulerOutput] = deque()  # behind a step awaiting its bitmask

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.executor.execute_model(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self._waiting.append(scheduler_output)
        self._run_ready()

    def send_grammar_bitmask(self, step_id: int, grammar_bitmask: GrammarBitmask) -> None:
        waiting = self._waiting
        if not waiting or waiting[0].step_id != step_id or not waiting[0].grammar_bitmask_follows:
            raise RuntimeError(f"a grammar bitmask for step {step_id}, which awaits none")
        waiting[0] = msgspec.structs.replace(
            waiting[0], grammar_bitmask=grammar_bitmask, grammar_bitmask_follows=False
        )
        self._run_ready()

    def _run_ready(self) -> None:
        waiting = self._waiting
        while waiting and not waiting[0].grammar_bitmask_follows:
            self._outputs.append(self.executor.execute_model(waiting.popleft()))

    def forget(self) -> None:
        """Drop the outputs of steps that will never be collected (a lost generation)."""
        self._outputs.clear()
        self._waiting.clear()

    def collect(self, step_id: int) -> ModelRunnerOutput:
        if not self._outputs:
            raise RuntimeError(f"step {step_id} has not run: it awaits its grammar bitmask")
        output = self._outputs.popleft()
        if output.step_id != step_id:
            raise RuntimeError(f"collected step {output.step_id}, expected step {step_id}")
        return output
