"""Admission of sampling parameters: min_tokens above max_tokens never gets past the Struct."""

import msgspec
import pytest

from engine_core.sched.validation import validate_request
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.sampling import SamplingParams

MIN_OVER_MAX = "min_tokens=9 must not exceed max_tokens=5"


def test_no_sampling_params_instance_has_min_tokens_above_max_tokens() -> None:
    """Guards the removed admission branch: every way to make the Struct refuses min > max."""
    params = SamplingParams(max_tokens=5, min_tokens=3)
    with pytest.raises(ValueError, match=MIN_OVER_MAX):
        SamplingParams(max_tokens=5, min_tokens=9)
    with pytest.raises(ValueError, match=MIN_OVER_MAX):
        msgspec.structs.replace(params, min_tokens=9)
    with pytest.raises(msgspec.ValidationError, match=MIN_OVER_MAX):
        msgspec.convert([5, 9], SamplingParams)
    with pytest.raises(msgspec.ValidationError, match=MIN_OVER_MAX):
        msgspec.msgpack.decode(msgspec.msgpack.encode([5, 9]), type=SamplingParams)


def test_an_out_of_bounds_sampling_field_is_rejected_by_name() -> None:
    params = SamplingParams(max_tokens=5, temperature=500.0)  # constructors skip field bounds
    request = EngineCoreRequest("r1", pack_int32([1, 2]), params, arrival_time=0.0)
    with pytest.raises(ValueError, match=r"bad sampling parameters: .*`temperature`"):
        validate_request(request, max_model_len=16, vocab_size=32, is_live_req_id=False)
