"""A request from the client's side: make_request builds the EngineCoreRequest a client sends, and
RequestResult gathers what one request produced, with client-side timings. No sockets.
"""

import time
from dataclasses import dataclass, field

from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreOutput, EngineCoreRequest
from protocol.sampling import SamplingParams


@dataclass
class RequestResult:
    """Everything one request produced, with client-side timings in seconds (time.monotonic)."""

    req_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # the FinishReason's name, lowercase
    error: str | None = None
    num_cached_tokens: int = 0
    submit_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    # Per generated token, when the request asked for logprobs: the sampled id and its top-N
    # alternatives, and their logprobs (TokenLogprobs of every output, concatenated)
    logprob_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def absorb(self, output: EngineCoreOutput, now: float) -> None:
        if output.new_token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.token_ids.extend(output.new_token_ids)
        if output.new_logprobs is not None:
            self.logprob_token_ids.extend(output.new_logprobs.token_ids)
            self.logprobs.extend(output.new_logprobs.logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.finish_reason is not None:
            self.finish_reason = str(output.finish_reason)
            self.error = output.error
            self.finish_time = now


def make_request(
    req_id: str,
    prompt_token_ids: list[int],
    sampling_params: SamplingParams | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    encoder_token_ids: list[int] | None = None,  # an encoder-decoder model's encoder input
) -> EngineCoreRequest:
    return EngineCoreRequest(
        req_id=req_id,
        prompt_token_ids=pack_int32(prompt_token_ids),
        sampling_params=sampling_params or SamplingParams(),
        arrival_time=time.time(),
        priority=priority,
        cache_salt=cache_salt,
        encoder_token_ids=None if encoder_token_ids is None else pack_int32(encoder_token_ids),
    )
