"""Messages between clients (EngineClient) and the engine's client ROUTER socket.

Token ids travel as little-endian int32 bytes (see protocol/buffers.py), never as lists of ints.
"""

import enum
from typing import Annotated

import msgspec

from protocol.kv_transfer import KVTransferHandle
from protocol.sampling import SamplingParams

ReqId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Priority = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]  # an int32
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
MAX_ABORT_REQ_IDS = 4096  # req_ids in one AbortRequests
MAX_UTILITY_ARGS = 16
# What a request frame may carry beyond its prompt's int32 ids: req_id, salt, sampling params and
# msgpack framing fit in far less; the client socket refuses larger frames before Python sees them.
REQUEST_FRAME_HEADROOM_BYTES = 64 * 1024


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
    priority: Priority = 0  # lower runs first under the priority policy
    cache_salt: CacheSalt | None = None  # isolates this request's prefix-cache entries
    # int32 little-endian: an encoder-decoder model's encoder input; None for decoder-only models
    encoder_token_ids: bytes | None = None
    # P/D (protocol/kv_transfer.py): on a prefill engine, hold the prompt's blocks for a decode
    # engine once the first token is sampled, and name them in the final output's handle
    do_remote_decode: bool = False
    # on a decode engine: pull the prompt's KV from this handle before computing the rest
    kv_transfer_handle: KVTransferHandle | None = None


class AbortRequests(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Abort the sender's own live requests; ids the sender does not hold are ignored."""

    req_ids: Annotated[list[ReqId], msgspec.Meta(max_length=MAX_ABORT_REQ_IDS)]


class UtilityCall(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """A management call: `reset_prefix_cache`, `get_stats`, `check_health` or `get_model_info`."""

    call_id: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    method: Annotated[str, msgspec.Meta(max_length=64)]
    args: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=1024)] | int | float | bool | None],
        msgspec.Meta(max_length=MAX_UTILITY_ARGS),
    ] = []


ClientToEngine = EngineCoreRequest | AbortRequests | UtilityCall


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Logprobs of a request's new tokens, one entry per token, in order."""

    token_ids: list[list[int]]  # the sampled id, then its top-N alternatives
    logprobs: list[list[float]]  # aligned with token_ids, natural log
    sampled_token_ranks: list[int]  # rank of the sampled id in the distribution, 1 the top


class EngineCoreOutput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What one request produced in one step.

    One is made per running request per step, so it stays out of the cyclic collector (no
    field can refer back to it): otherwise a thousand decodes start collections every step.
    """

    req_id: str
    new_token_ids: list[int]  # sampled this step, in order; usually one
    finish_reason: FinishReason | None = None  # set on the request's last output
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    error: str | None = None  # why, when finish_reason is ERROR
    new_logprobs: TokenLogprobs | None = None  # of new_token_ids; None unless it asked for them
    # Of prompt tokens 1.. (the first has none), each entry the prompt token then its top-N;
    # on the request's first output only, when it asked for prompt_logprobs
    prompt_logprobs: TokenLogprobs | None = None
    # A do_remote_decode request's last output, when the prefill engine holds its blocks
    kv_transfer_handle: KVTransferHandle | None = None


class EngineCoreOutputs(msgspec.Struct, frozen=True, tag=True, gc=False):
    outputs: list[EngineCoreOutput]
    timestamp: float = 0.0  # seconds since the epoch, when the engine sent them


StatValue = int | float | str | bool | None


class UtilityResult(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    ok: bool
    value: StatValue | dict[str, StatValue] = None
    error: str | None = None  # why, when ok is False


EngineToClient = EngineCoreOutputs | UtilityResult
