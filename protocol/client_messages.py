"""Messages between clients (EngineClient) and the engine's client ROUTER socket.

Token ids travel as little-endian int32 bytes (see protocol/buffers.py), never as lists of ints.
"""

import enum
from typing import Annotated

import msgspec

from protocol.sampling import SamplingParams

ReqId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class FinishReason(enum.IntEnum):
    """Why a request stopped; sent as an int, printed as its lowercase name."""

    STOP = 0  # EOS or a stop token id
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # the client aborted it
    ERROR = 3  # rejected at admission or failed by the engine; `error` says why

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """A new generation request, as a client submits it."""

    req_id: ReqId  # the client's own name for the request; unique among its live requests
    prompt_token_ids: bytes  # int32 little-endian
    sampling_params: SamplingParams
    arrival_time: float  # seconds since the epoch, as the client saw it
    priority: int = 0  # lower runs first under the priority policy
    cache_salt: str | None = None  # isolates this request's prefix-cache entries


class AbortRequests(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    req_ids: list[str]


class UtilityCall(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """A management call: `reset_prefix_cache`, `get_stats` or `check_health`."""

    call_id: int
    method: str
    args: list[str | int | float | bool | None] = []


ClientToEngine = EngineCoreRequest | AbortRequests | UtilityCall


class EngineCoreOutput(msgspec.Struct, frozen=True, array_like=True):
    """What one request produced in one step."""

    req_id: str
    new_token_ids: list[int]  # sampled this step, in order; usually one
    finish_reason: FinishReason | None = None  # set on the request's last output
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    error: str | None = None  # why, when finish_reason is ERROR


class EngineCoreOutputs(msgspec.Struct, frozen=True, tag=True):
    outputs: list[EngineCoreOutput]
    timestamp: float = 0.0  # seconds since the epoch, when the engine sent them


StatValue = int | float | str | bool | None


class UtilityResult(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    ok: bool
    value: StatValue | dict[str, StatValue] = None
    error: str | None = None  # why, when ok is False


EngineToClient = EngineCoreOutputs | UtilityResult
