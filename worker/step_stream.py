"""StepStream: a rank's steps run in order on a thread of their own, as a GPU runs the work its host
queues, while the worker's thread keeps the sockets: it takes the next step off the wire and sends
each reply when it is ready. It never touches a socket, and never runs two steps at once.
"""

import os
import queue
import threading
from collections import deque

import torch

from protocol.codec import make_encoder
from protocol.worker_messages import SchedulerOutput
from worker.model_runner import ModelRunner

STOP = None  # queued by close(): the thread ends after the steps before it


class StepStream:
    """Runs `runner.execute_model` for each submitted step, oldest first, and posts (ready time,
    encoded reply) or the exception that ended it; a byte on the wake pipe says a result is in.

    Invariants: results come out in the order their steps went in; after an exception no later
    step runs.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._steps: queue.SimpleQueue[SchedulerOutput | None] = queue.SimpleQueue()
        self._results: deque[tuple[float, bytes] | BaseException] = deque()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._encoder = make_encoder()  # its own: the worker's thread encodes with the other
        self.failed_step_id: int | None = None  # the step whose exception ended the thread
        self._num_submitted = self._num_taken = 0  # counted on the worker's thread only
        self._thread = threading.Thread(target=self._run, name="step-stream", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Readable once a result is in; `take_results` empties it."""
        return self._wake_read

    @property
    def is_busy(self) -> bool:
        """Whether a submitted step's result has not been taken yet."""
        return self._num_submitted > self._num_taken

    def submit(self, step: SchedulerOutput) -> None:
        self._num_submitted += 1
        self._steps.put(step)

    def take_results(self) -> list[tuple[float, bytes]]:
        """The replies finished since the last call, in step order; raises what ended a step."""
        while True:
            try:
                if not os.read(self._wake_read, 4096):
                    break
            except BlockingIOError:
                break
        results = []
        while self._results:
            result = self._results.popleft()
            if isinstance(result, BaseException):
                raise result
            results.append(result)
        self._num_taken += len(results)
        return results

    def _run(self) -> None:
        if self.runner.device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(self.runner.device)
        while (step := self._steps.get()) is not STOP:
            try:
                output = self.runner.execute_model(step)
                self._results.append((self.runner.ready_at_s, self._encoder.encode(output)))
            except BaseException as exc:  # handed to the worker's thread, which fails the rank
                self.failed_step_id = step.step_id
                self._results.append(exc)
                os.write(self._wake_write, b"\1")
                return
            os.write(self._wake_write, b"\1")

    def close(self, timeout_s: float) -> None:
        """Let the queued steps finish (within `timeout_s`), then release the pipe."""
        self._steps.put(STOP)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            os.close(self._wake_read)
            os.close(self._wake_write)
