"""MambaSpec: its wire form, its validation, its page size per TP rank, and its capacity count."""

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    num_blocks_per_request,
    num_group_blocks_per_request,
)
from protocol.kv_cache_spec import KVCacheConfig, bytes_per_block

STATE = MambaSpec(block_size=4, state_shapes=((4, 8), (4,)), dtype="float32")
ALIGN = MambaSpec(
    block_size=4, state_shapes=((4, 8), (4,)), dtype="float32", mamba_cache_mode="align"
)

mamba_specs = st.builds(
    MambaSpec,
    st.integers(1, 64),
    st.lists(st.lists(st.integers(1, 8), min_size=1, max_size=3).map(tuple), min_size=1).map(tuple),
    st.sampled_from(["float32", "bfloat16"]),
    st.sampled_from(["none", "align"]),
)


@given(mamba_specs)
def test_a_config_with_mamba_groups_round_trips(spec: MambaSpec) -> None:
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_groups=[
            KVCacheGroupSpec(["full.0"], FullAttentionSpec(4, 2, 8, "float32")),
            KVCacheGroupSpec(["mamba.0", "mamba.1"], spec),
        ],
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=KVCacheConfig)
    assert decoded == config
    assert hash(decoded.kv_cache_groups[1].spec) == hash(spec)  # coordinators key groups by spec


def test_an_unknown_cache_mode_is_refused_with_the_modes_allowed() -> None:
    with pytest.raises(
        ValueError, match=r"mamba_cache_mode='all': expected one of \('none', 'align'\)"
    ):
        MambaSpec(block_size=4, state_shapes=((4,),), dtype="float32", mamba_cache_mode="all")


def test_an_unknown_cache_mode_on_the_wire_fails_at_decode() -> None:
    frame = msgspec.msgpack.encode(KVCacheGroupSpec(["m"], ALIGN)).replace(b"align", b"alien")
    with pytest.raises(msgspec.ValidationError, match="mamba_cache_mode='alien'"):
        msgspec.msgpack.decode(frame, type=KVCacheGroupSpec)


def test_a_spec_without_state_is_refused() -> None:
    with pytest.raises(ValueError, match="expected at least one state tensor"):
        MambaSpec(block_size=4, state_shapes=(), dtype="float32")


def test_state_is_sharded_over_tp_ranks_by_its_first_dimension() -> None:
    assert STATE.page_size_bytes() == (4 * 8 + 4) * 4
    assert STATE.page_size_bytes(tp_size=2) == (2 * 8 + 2) * 4
    with pytest.raises(ValueError, match=r"shape \(4, 8\) is not divisible by tp_size=3"):
        STATE.page_size_bytes(tp_size=3)


def test_a_state_page_sizes_the_shared_tensors_like_any_page() -> None:
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_dim=2, dtype="float32")  # 64 B
    groups = [KVCacheGroupSpec(["full.0"], full), KVCacheGroupSpec(["mamba.0"], STATE)]
    assert bytes_per_block(groups, tp_size=1) == STATE.page_size_bytes()  # the larger page


def test_a_request_holds_one_state_block_or_two_in_align_mode() -> None:
    """Mode none: the one running state; align: the state a step starts from and the new one."""
    for max_num_scheduled_tokens in (None, 1, 64):
        assert num_group_blocks_per_request(STATE, 1000, max_num_scheduled_tokens) == 1
        assert num_group_blocks_per_request(ALIGN, 1000, max_num_scheduled_tokens) == 2
    assert num_group_blocks_per_request(ALIGN, 3, None) == 1  # one block spans the sequence
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_dim=2, dtype="float32")
    groups = [KVCacheGroupSpec(["full.0"], full), KVCacheGroupSpec(["mamba.0"], ALIGN)]
    assert num_blocks_per_request(groups, 40) == 10 + 2
