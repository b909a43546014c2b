"""InFlightStep: the step broadcast to the workers and not yet answered.

It checks that a worker's reply answers exactly that step, then applies its sampled tokens to
the step's requests (tokens, stop rules, client outputs); the queues stay the Scheduler's.
"""

from array import array
from collections import defaultdict
from dataclasses import dataclass

from engine_core.sched.request import Request, RequestStatus
from engine_core.sched.stop import check_stop
from protocol.buffers import unpack_int32
from protocol.client_messages import EngineCoreOutput, TokenLogprobs
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput

_RUNNING = RequestStatus.RUNNING


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
    has_logprobs: bool = False  # some request live when it was scheduled asked for logprobs

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

    def apply(
        self,
        sampled: array,
        max_model_len: int,
        logprobs: list[TokenLogprobs | None] | None = None,
    ) -> tuple[defaultdict[bytes, list[EngineCoreOutput]], list[tuple[Request, bool]]]:
        """Append each request's sampled token and apply the stop rules: the client outputs by
        client, and the requests that finished, each with whether it was running (else it was
        preempted while the step ran, and waits in the queue). `logprobs`, aligned with the
        requests (reply_logprobs.py), go out with their tokens; None: no request has any."""
        outputs: defaultdict[bytes, list[EngineCoreOutput]] = defaultdict(list)
        finished: list[tuple[Request, bool]] = []
        if logprobs is None:
            logprobs = [None] * len(self.requests)
        for request, token_id, samples, token_logprobs in zip(
            self.requests, sampled, self.is_sampling, logprobs, strict=True
        ):
            if not samples:
                continue  # a partial prefill chunk: its sample means nothing
            # Aborted, or stopped a step earlier: a token past its end, dropped with its logprobs.
            if request.status is not _RUNNING and request.status.is_finished:
                continue
            # Running, or preempted while this step ran: the token is valid either way, and
            # the workers appended it to their copy of the sequence as they sampled it.
            request.num_output_placeholders -= 1
            request.append_output_token_id(token_id)
            request.num_tokens_sent += 1
            finish_reason = None
            num_tokens = len(request.all_token_ids)
            if (  # the stop rules fire only on a finishing id or at a length cap: test those
                token_id in request.finishing_token_ids
                or num_tokens >= request.max_num_tokens
                or num_tokens >= max_model_len
            ) and (status := check_stop(request, max_model_len)) is not None:
                finish_reason = status.finish_reason
                finished.append((request, request.status is _RUNNING))
                request.status = status
            outputs[request.client_id].append(
                EngineCoreOutput(
                    request.client_req_id,
                    [token_id],
                    finish_reason,
                    request.num_cached_tokens,
                    None,
                    token_logprobs,
                )
            )
        return outputs, finished

    def check_invariants(self) -> None:
        assert len(self.is_sampling) == len(self.requests), (
            f"step {self.step_id}: {len(self.is_sampling)} sampling flags, "
            f"{len(self.requests)} requests"
        )
        handles = unpack_int32(self.handles).tolist()
        assert handles == [request.handle for request in self.requests], (
            f"step {self.step_id} has handles {handles} for {len(self.requests)} requests"
        )
