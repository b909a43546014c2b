"""Round trip of every wire message: decode(encode(m)) == m through each socket's own decoder."""

import gc
import struct

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from protocol import codec
from protocol.client_messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    TokenLogprobs,
    UtilityCall,
    UtilityResult,
)
from protocol.kv_cache_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from protocol.kv_events import AllBlocksCleared, KVEventBatch, block_removed, block_stored
from protocol.sampling import MAX_LOGPROBS, MAX_TOKENS_LIMIT, SEED_LIMIT, SamplingParams
from protocol.worker_messages import (
    CachedRequestData,
    ModelInfo,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    Shutdown,
    WorkerFailed,
    WorkerHello,
    WorkerReady,
)

ints = st.integers(-(2**63), 2**63 - 1)
naturals = st.integers(0, 2**31 - 1)
positives = st.integers(1, 2**31 - 1)
floats = st.floats(allow_nan=False)
texts = st.text(max_size=20)
req_ids = st.text(min_size=1, max_size=40)
int32_bytes = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=16).map(
    lambda values: b"".join(value.to_bytes(4, "little", signed=True) for value in values)
)
block_tables = st.lists(st.lists(naturals, max_size=6), min_size=1, max_size=3).map(tuple)
stat_values = st.one_of(st.none(), st.booleans(), ints, floats, texts)


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.integers(1, MAX_TOKENS_LIMIT))
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        temperature=draw(st.floats(0.0, 100.0)),
        seed=draw(st.none() | st.integers(0, SEED_LIMIT)),
        stop_token_ids=draw(st.lists(naturals, max_size=8)),
        ignore_eos=draw(st.booleans()),
        top_p=draw(st.floats(0.0, 1.0, exclude_min=True)),
        top_k=draw(st.none() | st.integers(1, 1 << 20)),
        min_p=draw(st.floats(0.0, 1.0)),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        repetition_penalty=draw(st.floats(0.0, 10.0, exclude_min=True)),
        logprobs=draw(st.none() | st.integers(0, MAX_LOGPROBS)),
    )


specs = st.one_of(
    st.builds(FullAttentionSpec, positives, positives, positives, st.sampled_from(["float32"])),
    st.builds(SlidingWindowSpec, positives, positives, positives, st.just("bfloat16"), positives),
    st.builds(CrossAttentionSpec, positives, positives, positives, st.just("float32"), positives),
)
group_specs = st.builds(KVCacheGroupSpec, st.lists(texts, max_size=3), specs)
kv_cache_configs = st.builds(
    KVCacheConfig, positives, st.lists(group_specs, max_size=3), st.booleans()
)
model_infos = st.builds(
    ModelInfo,
    texts,
    positives,
    st.lists(naturals, max_size=3),
    positives,
    st.lists(group_specs, max_size=2),
)
float32_bytes = st.lists(st.floats(width=32, allow_nan=False), max_size=8).map(
    lambda values: struct.pack(f"<{len(values)}f", *values)
)
token_logprobs = st.builds(
    TokenLogprobs,
    st.lists(st.lists(naturals, max_size=3), max_size=3),
    st.lists(st.lists(st.floats(allow_nan=False), max_size=3), max_size=3),
    st.lists(positives, max_size=3),
)

client_to_engine = st.one_of(
    st.builds(
        EngineCoreRequest,
        req_ids,
        int32_bytes,
        sampling_params(),
        floats,
        st.integers(-(2**31), 2**31 - 1),  # priority: an int32 on the wire
        st.none() | st.text(min_size=1, max_size=20),
        st.none() | int32_bytes,  # encoder_token_ids
    ),
    st.builds(AbortRequests, st.lists(req_ids, max_size=4)),
    st.builds(UtilityCall, st.integers(0, 2**63 - 1), texts, st.lists(stat_values, max_size=4)),
)

engine_outputs = st.builds(
    EngineCoreOutput,
    texts,
    st.lists(naturals, max_size=4),
    st.none() | st.sampled_from(list(FinishReason)),
    naturals,
    st.none() | texts,
    st.none() | token_logprobs,
)
engine_to_client = st.one_of(
    st.builds(EngineCoreOutputs, st.lists(engine_outputs, max_size=4), floats),
    st.builds(
        UtilityResult,
        ints,
        st.booleans(),
        stat_values | st.dictionaries(texts, stat_values, max_size=3),
        st.none() | texts,
    ),
)

new_requests = st.builds(
    NewRequestData,
    naturals,
    int32_bytes,
    sampling_params(),
    block_tables,
    naturals,
    st.none() | int32_bytes,  # encoder_token_ids
)
cached_requests = st.builds(
    CachedRequestData,
    int32_bytes,
    st.lists(naturals, max_size=4),
    int32_bytes,
    int32_bytes,
    st.lists(st.none() | block_tables, max_size=4),
    int32_bytes,
)
engine_to_worker = st.one_of(
    kv_cache_configs,
    st.builds(
        SchedulerOutput,
        positives,
        st.lists(new_requests, max_size=3),
        cached_requests,
        int32_bytes,
        naturals,
        st.lists(naturals, max_size=4),
        st.lists(naturals, max_size=4),
    ),
    st.builds(Shutdown, texts, st.booleans()),
)
worker_to_engine = st.one_of(
    st.builds(WorkerHello, ints, naturals, positives, ints, texts, texts, model_infos, ints),
    st.builds(WorkerReady, naturals, ints),
    st.builds(ModelRunnerOutput, ints, ints, int32_bytes, int32_bytes),
    st.builds(
        ModelRunnerOutput,
        ints,
        ints,
        int32_bytes,
        int32_bytes,
        ints,
        float32_bytes,
        int32_bytes,
        int32_bytes,
    ),
    st.builds(WorkerFailed, ints, st.none() | ints, texts),
)
kv_events = st.one_of(
    st.builds(
        block_stored,
        st.lists(st.binary(max_size=32), max_size=3),
        st.none() | st.binary(max_size=32),
        st.lists(naturals, max_size=8),
        positives,
        naturals,
    ),
    st.builds(block_removed, st.lists(st.binary(max_size=32), max_size=3), naturals),
    st.just(AllBlocksCleared()),
)
kv_event_batches = st.builds(KVEventBatch, floats, st.lists(kv_events, max_size=4))

ENCODER = codec.make_encoder()


@given(client_to_engine)
def test_client_to_engine_round_trip(message: object) -> None:
    assert codec.client_to_engine_decoder().decode(ENCODER.encode(message)) == message


@given(engine_to_client)
def test_engine_to_client_round_trip(message: object) -> None:
    assert codec.engine_to_client_decoder().decode(ENCODER.encode(message)) == message


@given(engine_to_worker)
def test_engine_to_worker_round_trip(message: object) -> None:
    assert codec.engine_to_worker_decoder().decode(ENCODER.encode(message)) == message


@given(worker_to_engine)
def test_worker_to_engine_round_trip(message: object) -> None:
    assert codec.worker_to_engine_decoder().decode(ENCODER.encode(message)) == message


@given(kv_event_batches)
def test_kv_event_batch_round_trip(message: KVEventBatch) -> None:
    assert codec.kv_event_decoder().decode(ENCODER.encode(message)) == message


def test_kv_cache_config_without_check_invariants_decodes_with_checks_off() -> None:
    """A KVCacheConfig from an engine that predates the flag leaves the workers' checks off."""
    groups = [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(4, 2, 8, "float32"))]
    old_wire = ENCODER.encode(["KVCacheConfig", 7, msgspec.to_builtins(groups)])
    decoded = codec.engine_to_worker_decoder().decode(old_wire)
    assert decoded == KVCacheConfig(7, groups) and decoded.check_invariants is False


def test_per_step_outputs_stay_out_of_the_cyclic_collector() -> None:
    """Made by the engine and decoded by clients once per request per step: neither copy may
    count toward a collection."""
    output = EngineCoreOutput("a", [1, 2], FinishReason.LENGTH, 3)
    message = EngineCoreOutputs([output], 1.5)
    decoded = codec.engine_to_client_decoder().decode(ENCODER.encode(message))
    assert isinstance(decoded, EngineCoreOutputs) and decoded == message
    for value in (output, message, decoded, decoded.outputs[0]):
        assert not gc.is_tracked(value), f"{value!r} is tracked by the cyclic collector"
