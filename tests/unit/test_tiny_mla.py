"""tiny-mla's TP shards tile the full weights and all-reduce to exactly the TP=1 logits.

Its paged tokens (block sizes 16 and 32, prefix caching on and off, chunked prefill, preemption,
float64, a corrupted table entry) are checked with the other models' in
test_models_paged_vs_reference.py.
"""

import pytest
import torch
from model_workloads import DEVICE, PROMPTS, run_ranks_as_threads

from worker.distributed import TPGroup, single_rank_group
from worker.latent_attention import DenseLatentKV
from worker.models.tiny_mla import TINY_MLA, TinyMLA

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("tp_size", [2, 4])
def test_rank_shards_partition_the_heads_and_replicate_the_latent(tp_size: int) -> None:
    """Each rank keeps its heads' query, up-projection and output slices; the projections that
    make the latent are whole on every rank, so every rank caches the same latent."""
    full = TinyMLA(TINY_MLA, single_rank_group(), 0, DEVICE)
    placeholder = object()  # a process group is never used: no forward runs here
    shards = [
        TinyMLA(TINY_MLA, TPGroup(r, tp_size, placeholder), 0, DEVICE) for r in range(tp_size)
    ]
    for shard in shards:
        shard.check_invariants()
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


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_all_reduce_to_exactly_the_tp1_logits(tp_size: int) -> None:
    """Every rank computes the same latent and its own heads; the all-reduced logits of every
    position are bit-identical to one rank's."""
    sequence = PROMPTS[1]
    tokens = torch.tensor(sequence, dtype=torch.int64)
    positions = torch.arange(len(sequence), dtype=torch.int64)
    every = torch.arange(len(sequence))
    full = TinyMLA(TINY_MLA, single_rank_group(), 0, DEVICE)
    expected = full.forward_latent(tokens, positions, every, DenseLatentKV(len(sequence)))

    def run_rank(group: TPGroup) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = TinyMLA(TINY_MLA, group, 0, DEVICE)
        kv = DenseLatentKV(len(sequence))
        return model.forward_latent(tokens, positions, every, kv), kv.store

    results = run_ranks_as_threads(tp_size, run_rank)
    for logits, latents in results:
        assert torch.equal(logits, expected)
        assert all(torch.equal(latents[name], results[0][1][name]) for name in latents)
