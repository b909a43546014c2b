"""Tensor parallelism without processes: each model's rank shards tile its full weights, and ranks
run as threads (thread_tp_group.run_ranks) all-reduce to exactly the TP=1 logits.

tiny-mla caches the same latent on every rank, tiny-mamba-hybrid each rank's own channels'
states, tiny-encdec runs the whole encoder on every rank and keeps its own cross-attention heads.
"""

import pytest
import torch
from model_workloads import DEVICE, ENCDEC, PROMPTS

from tests.unit.thread_tp_group import run_ranks
from worker.distributed import TPGroup, single_rank_group
from worker.latent_attention import DenseLatentKV
from worker.mamba_state import DenseMambaState
from worker.models.fake.checksum import CHECKSUM, ChecksumModel
from worker.models.fake.tiny_encdec import TINY_ENCDEC, TinyEncDec
from worker.models.fake.tiny_encdec_reference import DenseCrossKV
from worker.models.fake.tiny_llama import TINY_LLAMA, TinyLlama
from worker.models.fake.tiny_mamba import TINY_MAMBA_HYBRID, TinyMambaHybrid
from worker.models.fake.tiny_mamba_reference import DenseCausalKV
from worker.models.fake.tiny_mla import TINY_MLA, TinyMLA

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PLACEHOLDER_GROUP = object()  # a process group is never used: no forward runs in these shards


def full_and_shards(model_class: type, config: object, tp_size: int) -> tuple:
    """The TP=1 model and its `tp_size` rank shards, each checked, all drawn from seed 0."""
    full = model_class(config, single_rank_group(), 0, DEVICE)
    shards = [
        model_class(config, TPGroup(rank, tp_size, PLACEHOLDER_GROUP), 0, DEVICE)
        for rank in range(tp_size)
    ]
    for shard in shards:
        shard.check_invariants()
    return full, shards


@pytest.mark.parametrize("tp_size", [2, 4])
def test_rank_shards_partition_the_full_weights(tp_size: int) -> None:
    """Each rank draws the full weights from the seed and keeps its slice; the slices tile them."""
    full, shards = full_and_shards(TinyLlama, TINY_LLAMA, tp_size)
    for layer_idx, layer in enumerate(full.layers):
        parts = [shard.layers[layer_idx] for shard in shards]
        assert torch.equal(torch.cat([p.wq for p in parts], dim=1), layer.wq)
        assert torch.equal(torch.cat([p.wk for p in parts], dim=1), layer.wk)
        assert torch.equal(torch.cat([p.wo for p in parts], dim=0), layer.wo)
        assert torch.equal(torch.cat([p.w_gate for p in parts], dim=1), layer.w_gate)
        assert torch.equal(torch.cat([p.w_down for p in parts], dim=0), layer.w_down)
    heads = [
        ChecksumModel(CHECKSUM, TPGroup(rank, tp_size, PLACEHOLDER_GROUP), DEVICE)
        for rank in range(tp_size)
    ]
    for model in heads:
        model.check_invariants()
    assert torch.cat([m.heads for m in heads]).tolist() == list(range(CHECKSUM.num_kv_heads))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_rank_shards_partition_the_heads_and_replicate_the_latent(tp_size: int) -> None:
    """Each rank keeps its heads' query, up-projection and output slices; the projections that
    make the latent are whole on every rank, so every rank caches the same latent."""
    full, shards = full_and_shards(TinyMLA, TINY_MLA, tp_size)
    for layer_idx, layer in enumerate(full.layers):
        parts = [shard.layers[layer_idx] for shard in shards]
        for name in ("wq", "w_k_up", "w_v_up", "w_gate", "w_up"):
            joined = torch.cat([getattr(p, name) for p in parts], dim=1)
            assert torch.equal(joined, getattr(layer, name)), f"layer {layer_idx} {name}"
        for name in ("wo", "w_down"):
            joined = torch.cat([getattr(p, name) for p in parts], dim=0)
            assert torch.equal(joined, getattr(layer, name)), f"layer {layer_idx} {name}"
        for part in parts:
            for name in ("attn_norm", "w_kv_down", "kv_norm", "w_k_rotary", "mlp_norm"):
                assert torch.equal(getattr(part, name), getattr(layer, name)), name


def _dense_forward(model: str, group: TPGroup) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The logits of every position of the model's sequence over dense caches on this rank, and
    what the rank cached: tiny-mla's latents, tiny-mamba-hybrid's states of the rank's channels,
    nothing for tiny-encdec (its test sequence is its family's third request with its encoder
    input; the others' is PROMPTS[1])."""
    sequence = ENCDEC.prompts[2] if model == TINY_ENCDEC.name else PROMPTS[1]
    num_tokens = len(sequence)
    tokens = torch.tensor(sequence, dtype=torch.int64)
    positions = torch.arange(num_tokens, dtype=torch.int64)
    every = torch.arange(num_tokens)
    if model == TINY_MLA.name:
        latents = DenseLatentKV(num_tokens)
        mla = TinyMLA(TINY_MLA, group, 0, DEVICE)
        return mla.forward_latent(tokens, positions, every, latents), latents.store
    if model == TINY_MAMBA_HYBRID.name:
        config = TINY_MAMBA_HYBRID
        shape = (config.num_channels // group.tp_size, config.state_dim)
        states = DenseMambaState(num_tokens, shape, DEVICE)
        mamba = TinyMambaHybrid(config, group, 0, DEVICE)
        kv = DenseCausalKV(num_tokens)
        return mamba.forward_with_states(tokens, positions, every, kv, states), states.store
    assert ENCDEC.encoders is not None
    cross_kv = DenseCrossKV(num_tokens, ENCDEC.encoders[2])
    encdec = TinyEncDec(TINY_ENCDEC, group, 0, DEVICE)
    return encdec.forward(tokens, positions, every, cross_kv), {}


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("model", [TINY_MLA.name, TINY_MAMBA_HYBRID.name, TINY_ENCDEC.name])
def test_tp_shards_all_reduce_to_exactly_the_tp1_logits(model: str, tp_size: int) -> None:
    """The all-reduced logits of every position are bit-identical to one rank's; every rank
    caches tiny-mla's whole latent, and the ranks' final Mamba states tile the whole model's."""
    expected, whole_cache = _dense_forward(model, single_rank_group())
    results = run_ranks(tp_size, lambda group: _dense_forward(model, group))
    for logits, _ in results:
        assert torch.equal(logits, expected)
    assert whole_cache or model == TINY_ENCDEC.name
    for name, whole in whole_cache.items():
        parts = [cache[name] for _, cache in results]
        if model == TINY_MAMBA_HYBRID.name:
            assert torch.equal(torch.cat(parts, dim=1), whole), name
        else:
            assert all(torch.equal(part, whole) for part in parts), name
