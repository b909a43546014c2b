"""EnginePlan: the startup decisions made once from the config and the ranks' capacities, and
each refusal named once, before any rank allocates."""

import msgspec
import pytest

from engine_core.service import plan
from engine_core.service.plan import FlagValueError, plan_engine
from protocol.config import CacheConfig, CurveKeys, EngineConfig, SchedulerConfig
from protocol.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from protocol.worker_messages import ModelInfo

GROUPS = [KVCacheGroupSpec(["layers.0"], FullAttentionSpec(4, 2, 8, "float32"))]
MODEL = ModelInfo("tiny", 64, [], 32, GROUPS)  # a model of max_model_len 32


def _config(tp_size: int = 2, **scheduler: object) -> EngineConfig:
    return EngineConfig(
        tp_size=tp_size, cache=CacheConfig(block_size=4), scheduler=SchedulerConfig(**scheduler)
    ).checked()


def test_the_plan_takes_the_smallest_rank_and_the_models_max_model_len() -> None:
    plan = plan_engine(_config(), MODEL, [40, 25])
    assert plan.kv_cache_config.num_blocks == 25
    assert plan.num_blocks_per_rank == [40, 25]
    assert plan.limits.max_model_len == 32 and plan.limits.block_size == 4
    assert plan.summary == "KV cache holds 96 tokens; max concurrency 3.00 at max_model_len 32"


def test_a_configured_max_model_len_above_the_models_is_clipped_to_it() -> None:
    assert plan_engine(_config(max_model_len=1000), MODEL, [40, 40]).limits.max_model_len == 32
    assert plan_engine(_config(max_model_len=8), MODEL, [40, 40]).limits.max_model_len == 8


def test_a_pool_that_cannot_hold_one_request_is_refused_before_allocation() -> None:
    with pytest.raises(ValueError, match=r"max_model_len=32 tokens needs 8 blocks.*leaves 7"):
        plan_engine(_config(), MODEL, [8, 20])
    assert plan_engine(_config(max_model_len=28), MODEL, [8, 20]).kv_cache_config.num_blocks == 8


def test_an_engine_block_size_the_model_does_not_use_is_refused() -> None:
    config = EngineConfig(tp_size=1, cache=CacheConfig(block_size=16)).checked()
    with pytest.raises(ValueError, match="block_size=4: expected the cache config's 16"):
        plan_engine(config, MODEL, [100])


def test_one_capacity_per_rank_is_required() -> None:
    with pytest.raises(ValueError, match="expected one per rank of tp_size=2"):
        plan_engine(_config(), MODEL, [100])


def test_the_plan_tells_the_ranks_to_walk_invariants_when_the_engine_does() -> None:
    config = EngineConfig(tp_size=1, check_invariants=True, cache=CacheConfig(block_size=4))
    assert plan_engine(config.checked(), MODEL, [100]).kv_cache_config.check_invariants
    assert not plan_engine(_config(tp_size=1), MODEL, [100]).kv_cache_config.check_invariants


# A hybrid of one full-attention and one sliding-window layer (window 8), blocks of 4 tokens.
HYBRID_GROUPS = [
    KVCacheGroupSpec(["layers.0"], FullAttentionSpec(4, 2, 8, "float32")),
    KVCacheGroupSpec(["layers.1"], SlidingWindowSpec(4, 2, 8, "float32", sliding_window=8)),
]
HYBRID = ModelInfo("hybrid", 64, [], 64, HYBRID_GROUPS)  # max_model_len 64: 16 blocks of 4


def test_a_sliding_window_group_is_planned_for_its_window_when_prompts_come_in_chunks() -> None:
    """Up to 4 tokens a step: 16 full blocks and 4 window blocks, not 16 and 16."""
    config = _config(tp_size=1, reserve_full_prompt=False, long_prefill_token_threshold=4)
    plan = plan_engine(config, HYBRID, [61])
    assert plan.limits.num_blocks_per_request == 16 + 4
    assert plan.summary == "KV cache holds 192 tokens; max concurrency 3.00 at max_model_len 64"
    with pytest.raises(ValueError, match=r"max_model_len=64 tokens needs 20 blocks.*leaves 19"):
        plan_engine(config, HYBRID, [20])


def test_a_whole_prompt_reservation_plans_every_window_block() -> None:
    """Admission reserves the whole prompt in every group, so the window frees nothing before."""
    plan = plan_engine(_config(tp_size=1), HYBRID, [65])
    assert plan.limits.num_blocks_per_request == 16 + 16
    assert plan.summary == "KV cache holds 128 tokens; max concurrency 2.00 at max_model_len 64"
    with pytest.raises(ValueError, match=r"needs 32 blocks.*leaves 31"):
        plan_engine(_config(tp_size=1), HYBRID, [32])


def test_kv_roles_are_refused_where_the_kv_cannot_move_naming_the_flag() -> None:
    """P/D moves full and sliding-window groups of one block size (a Gemma-style hybrid); a
    decode engine pulls into its prefix cache; a prefill engine's ranks need an address to
    serve from."""
    sliding = KVCacheGroupSpec(["layers.1"], SlidingWindowSpec(4, 2, 8, "float32", 8))
    hybrid = ModelInfo("tiny-hybrid", 64, [], 32, [*GROUPS, sliding])
    prefill = msgspec.structs.replace(
        _config(), kv_role="prefill", kv_transfer_address="ipc:///tmp/x"
    )
    assert plan_engine(prefill, hybrid, [40, 40]).kv_cache_config.kv_transfer_address
    wide = KVCacheGroupSpec(["layers.1"], SlidingWindowSpec(8, 2, 8, "float32", 8))
    mixed = ModelInfo("tiny-mixed", 64, [], 32, [*GROUPS, wide])
    with pytest.raises(
        FlagValueError, match=r"--kv-role prefill: .*block sizes differ \(\[4, 8\]\)"
    ):
        plan_engine(prefill, mixed, [40, 40])
    local = KVCacheGroupSpec(["layers.1"], ChunkedLocalAttentionSpec(4, 2, 8, "float32", 8))
    chunked = ModelInfo("tiny-chunked", 64, [], 32, [*GROUPS, local])
    with pytest.raises(FlagValueError, match="a KV-cache group is ChunkedLocalAttentionSpec"):
        plan_engine(prefill, chunked, [40, 40])
    plan = plan_engine(prefill, MODEL, [40, 40])
    assert plan.kv_cache_config.kv_transfer_address == "ipc:///tmp/x"
    with pytest.raises(FlagValueError, match="--kv-transfer-address"):
        plan_engine(msgspec.structs.replace(prefill, kv_transfer_address=None), MODEL, [40, 40])
    decode = msgspec.structs.replace(
        _config(), kv_role="decode", cache=CacheConfig(block_size=4, enable_prefix_caching=False)
    )
    with pytest.raises(FlagValueError, match="--no-enable-prefix-caching"):
        plan_engine(decode, MODEL, [40, 40])
    assert plan_engine(_config(), MODEL, [40, 40]).kv_cache_config.kv_transfer_address is None


def test_the_kv_transport_reaches_the_ranks_of_a_pd_engine_and_nixl_must_be_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """auto and builtin serve anywhere; nixl is refused at start where NIXL is not installed;
    an engine of role both names no transport, so its ranks make no NIXL agent."""
    decode = msgspec.structs.replace(_config(), kv_role="decode", kv_transport="nixl")
    monkeypatch.setattr(plan, "nixl_available", lambda: False)
    with pytest.raises(FlagValueError, match="--kv-transport nixl: NIXL is not installed"):
        plan_engine(decode, MODEL, [40, 40])
    auto = msgspec.structs.replace(decode, kv_transport="auto")
    assert plan_engine(auto, MODEL, [40, 40]).kv_cache_config.kv_transport == "auto"
    monkeypatch.setattr(plan, "nixl_available", lambda: True)
    assert plan_engine(decode, MODEL, [40, 40]).kv_cache_config.kv_transport == "nixl"
    assert plan_engine(_config(), MODEL, [40, 40]).kv_cache_config.kv_transport is None


def test_a_prefill_engine_hands_out_nixl_descriptors_only_to_authenticated_peers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under NIXL a decode rank that got a prefill rank's agent metadata once can READ any page
    that rank registered, for the agent's life, pinned or not: the secret cannot bound it. So
    a prefill rank serves NIXL only where its control channel admits the deployment's peers
    alone (CURVE keys, or a private ipc folder): auto falls back to the built-in way on a tcp
    address without keys, and an explicit nixl there is refused, the flag and address named."""
    monkeypatch.setattr(plan, "nixl_available", lambda: True)
    keys = CurveKeys("p" * 40, "s" * 40, "p" * 40)
    prefill = msgspec.structs.replace(
        _config(), kv_role="prefill", kv_transfer_address="tcp://127.0.0.1"
    )
    assert plan_engine(prefill, MODEL, [40, 40]).kv_cache_config.kv_transport == "builtin"
    with_keys = msgspec.structs.replace(prefill, curve=keys)
    assert plan_engine(with_keys, MODEL, [40, 40]).kv_cache_config.kv_transport == "auto"
    on_ipc = msgspec.structs.replace(prefill, kv_transfer_address="ipc:///tmp/kvs-p")
    assert plan_engine(on_ipc, MODEL, [40, 40]).kv_cache_config.kv_transport == "auto"
    explicit = msgspec.structs.replace(prefill, kv_transport="nixl")
    with pytest.raises(FlagValueError, match="--kv-transport nixl with --kv-transfer-address "):
        plan_engine(explicit, MODEL, [40, 40])
    assert plan_engine(msgspec.structs.replace(explicit, curve=keys), MODEL, [40, 40])
    decode = msgspec.structs.replace(_config(), kv_role="decode")  # it READs, serving nothing
    assert plan_engine(decode, MODEL, [40, 40]).kv_cache_config.kv_transport == "auto"
