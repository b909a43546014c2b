"""Mixture-of-experts layers (moe.py): the grouped path equals a per-token loop over each token's
top-k experts, routing varies across tokens as transformers routes them, TP ranks' partial
outputs sum to the whole with one all-reduce per layer, every expert is counted in the weights'
bytes, and a config the worker cannot serve is refused naming the field.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.unit.hf_checkpoints import (
    MIXTRAL,
    QWEN3_MOE,
    hf_logits,
    our_logits,
    write_checkpoints,
)
from tests.unit.test_hf_checkpoint_checks import edited_copy, with_tensors
from tests.unit.thread_tp_group import run_ranks
from worker.distributed import TPGroup, single_rank_group
from worker.models.hf.checkpoint import check_checkpoint, tensor_entries
from worker.models.hf.config import CheckpointError, read_hf_config
from worker.models.hf.layer_ops import TorchLayerOps
from worker.models.hf.linear import pack
from worker.models.hf.moe import MoeWeights, grouped_moe, route
from worker.models.hf.weights import RankShard, load_rank_weights
from worker.models.registry import build_model, get_model_info

CPU = torch.device("cpu")
# float32: the grouped GEMMs (and a rank's half of each) sum in another order than one row at a
# time; outputs reach ~20, where a float32 step is 2e-6
ATOL, RTOL = 1e-5, 1e-5
CASES = {"qwen3-moe": ("qwen3-moe", QWEN3_MOE), "mixtral": ("mixtral", MIXTRAL)}
TOKENS = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(11)).tolist()

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    return write_checkpoints(tmp_path_factory, CASES)


def random_experts(
    num_experts: int, top_k: int, dim: int, inter: int, seed: int, **routing: bool
) -> MoeWeights:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.3

    return MoeWeights(
        router=rand(num_experts, dim),
        gate_up_proj=[pack(rand(2 * inter, dim)) for _ in range(num_experts)],
        down_proj=[pack(rand(dim, inter)) for _ in range(num_experts)],
        num_experts_per_tok=top_k,
        norm_topk_prob=routing.get("norm_topk_prob", True),
        is_weighted_in_float32=routing.get("is_weighted_in_float32", False),
    )


def per_token_moe(h: torch.Tensor, weights: MoeWeights) -> torch.Tensor:
    """The definition, one token at a time: softmax over the router's logits, the top-k,
    optionally renormalised, and the probability-weighted sum of those experts' MLPs."""
    rows = []
    for x in h:
        probs = torch.softmax(x @ weights.router.T, dim=-1, dtype=torch.float32)
        top, ids = probs.topk(weights.num_experts_per_tok)
        if weights.norm_topk_prob:
            top = top / top.sum()
        total = torch.zeros_like(x)
        for prob, expert in zip(top.tolist(), ids.tolist(), strict=True):
            gate, up = (weights.gate_up_proj[expert].to_dense() @ x).chunk(2)
            total += prob * (weights.down_proj[expert].to_dense() @ (F.silu(gate) * up))
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("is_weighted_in_float32", [True, False])
def test_grouped_experts_equal_a_per_token_loop(
    norm_topk_prob: bool, is_weighted_in_float32: bool
) -> None:
    weights = random_experts(
        8,
        3,
        32,
        16,
        seed=1,
        norm_topk_prob=norm_topk_prob,
        is_weighted_in_float32=is_weighted_in_float32,
    )
    h = torch.randn(37, 32, generator=torch.Generator().manual_seed(2))
    grouped = grouped_moe(h, weights, TorchLayerOps().silu_and_mul)
    torch.testing.assert_close(grouped, per_token_moe(h, weights), atol=ATOL, rtol=RTOL)
    # many tokens, many experts: each expert is one batch, not one token
    _, expert_ids = route(h, weights)
    assert len(set(expert_ids.flatten().tolist())) == 8
    # one token alone gives its row of the batch
    torch.testing.assert_close(
        grouped_moe(h[5:6], weights, TorchLayerOps().silu_and_mul),
        grouped[5:6],
        atol=ATOL,
        rtol=RTOL,
    )


def test_bfloat16_routing_weights_round_where_each_family_rounds() -> None:
    """Qwen3-MoE multiplies by the weight rounded to bfloat16, Mixtral by the float32 weight
    (then rounds the product): the two differ in bfloat16, as transformers' two models do."""
    h = torch.randn(16, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    outs = []
    for in_float32 in (False, True):
        weights = random_experts(4, 2, 32, 16, seed=4, is_weighted_in_float32=in_float32)
        weights.router = weights.router.to(torch.bfloat16)
        weights.gate_up_proj = [w.to_dense().to(torch.bfloat16) for w in weights.gate_up_proj]
        weights.down_proj = [w.to_dense().to(torch.bfloat16) for w in weights.down_proj]
        outs.append(grouped_moe(h, weights, TorchLayerOps().silu_and_mul))
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert not torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], outs[1], atol=0.1, rtol=0.05)


@pytest.mark.parametrize("case", list(CASES))
def test_routing_varies_across_tokens_and_logits_equal_transformers(
    checkpoints: dict, case: str
) -> None:
    """transformers' own routers pick most experts over the prompt, so the logits below test
    every expert's weights, not one expert's."""
    folder, hf_model = checkpoints[case]
    picked: set[int] = set()
    routers = [m for name, m in hf_model.named_modules() if type(m).__name__.endswith("Router")]
    hooks = [
        r.register_forward_hook(lambda _m, _i, out: picked.update(out[2].flatten().tolist()))
        for r in routers
    ]
    reference = hf_logits(hf_model, TOKENS)
    for hook in hooks:
        hook.remove()
    num_experts = read_hf_config(str(folder)).moe.num_experts
    assert len(routers) >= 1 and len(picked) == num_experts, (case, picked)
    model = build_model(str(folder), single_rank_group(), CPU)
    model.check_invariants()
    ours = our_logits(model, get_model_info(str(folder), 4, "float32"), TOKENS)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_partial_experts_sum_to_the_whole(checkpoints: dict, case: str) -> None:
    """Each rank loads only its columns of every expert; their partial outputs, summed as the
    all-reduce sums them, equal the whole layer's output."""
    folder, _ = checkpoints[case]
    config = read_hf_config(str(folder))
    layer_idx = config.moe.sparse_layers.index(True)

    def layer(rank: int, tp_size: int) -> MoeWeights:
        shard = RankShard.of(config, rank, tp_size)
        return load_rank_weights(config, shard, CPU, torch.float32).layers[layer_idx].moe

    whole, rank0, rank1 = layer(0, 1), layer(0, 2), layer(1, 2)
    assert rank0.gate_up_proj[0].shape[0] == whole.gate_up_proj[0].shape[0] // 2
    h = torch.randn(24, config.hidden_size, generator=torch.Generator().manual_seed(5))
    silu_and_mul = TorchLayerOps().silu_and_mul
    summed = grouped_moe(h, rank0, silu_and_mul) + grouped_moe(h, rank1, silu_and_mul)
    torch.testing.assert_close(summed, grouped_moe(h, whole, silu_and_mul), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_logits_equal_transformers_with_one_all_reduce_per_layer(
    checkpoints: dict, case: str
) -> None:
    folder, hf_model = checkpoints[case]
    info = get_model_info(str(folder), 4, "float32", 2)
    counts = [0, 0]

    def rank_logits(group: TPGroup) -> torch.Tensor:
        model = build_model(str(folder), group, CPU)
        model.check_invariants()
        all_reduce = group.all_reduce

        def counted(tensor: torch.Tensor) -> torch.Tensor:
            counts[group.rank] += 1
            return all_reduce(tensor)

        group.all_reduce = counted  # type: ignore[method-assign]
        return our_logits(model, info, TOKENS)

    rank0, rank1 = run_ranks(2, rank_logits)
    assert torch.equal(rank0, rank1)
    torch.testing.assert_close(rank0, hf_logits(hf_model, TOKENS), atol=1e-4, rtol=0)
    num_layers = read_hf_config(str(folder)).num_layers
    assert counts == [2 * num_layers] * 2  # attention's o_proj, then the MLP or the experts


@pytest.mark.parametrize("case", list(CASES))
def test_the_weights_bytes_count_every_expert(checkpoints: dict, case: str) -> None:
    """The KV budget subtracts weights_bytes: at TP 1 it is every tensor of the checkpoint
    (float32 in, float32 held), and two ranks hold every expert's bytes between them."""
    folder, _ = checkpoints[case]
    entries = tensor_entries(folder)
    file_bytes = {name: 4 * torch.Size(entry.shape).numel() for name, entry in entries.items()}
    whole = build_model(str(folder), single_rank_group(), CPU)
    assert whole.weights_bytes() == sum(file_bytes.values())
    expert_bytes = sum(size for name, size in file_bytes.items() if ".experts." in name)
    ranks = [
        load_rank_weights(whole.config, RankShard.of(whole.config, rank, 2), CPU, torch.float32)
        for rank in range(2)
    ]
    held = sum(
        t.numel() * t.element_size()
        for weights in ranks
        for layer in weights.layers
        if layer.moe is not None
        for t in [*layer.moe.gate_up_proj, *layer.moe.down_proj]
    )
    assert held == expert_bytes


def test_qwen3_moe_reads_sparse_layers_and_both_expert_spellings(
    checkpoints: dict, tmp_path: Path
) -> None:
    """mlp_only_layers and decoder_sparse_step pick the sparse layers; the hub's num_experts
    and transformers 5's num_local_experts read alike."""
    folder, _ = checkpoints["qwen3-moe"]
    moe = read_hf_config(str(folder)).moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size) == (8, 2, 32)
    assert moe.sparse_layers == (False, True) and moe.norm_topk_prob
    raw = json.loads((folder / "config.json").read_text())
    hub = edited_copy(
        folder, tmp_path / "hub", num_local_experts=None, num_experts=raw["num_local_experts"]
    )
    assert read_hf_config(str(hub)).moe == moe
    stepped = edited_copy(folder, tmp_path / "step", mlp_only_layers=[], decoder_sparse_step=2)
    assert read_hf_config(str(stepped)).moe.sparse_layers == (False, True)
    mixtral = read_hf_config(str(checkpoints["mixtral"][0])).moe
    assert mixtral.sparse_layers == (True, True) and mixtral.norm_topk_prob


@pytest.mark.parametrize(
    ("case", "changes", "reason"),
    [
        ("qwen3-moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9: expected at most"),
        ("qwen3-moe", {"moe_intermediate_size": 0}, "moe_intermediate_size=0"),
        ("qwen3-moe", {"mlp_only_layers": "0"}, "mlp_only_layers='0'"),
        ("qwen3-moe", {"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
        ("mixtral", {"num_local_experts": None}, "num_local_experts=None"),
        ("mixtral", {"num_experts_per_tok": 5}, "expected at most num_local_experts=4"),
    ],
)
def test_an_unsupported_moe_config_is_refused_naming_the_field(
    checkpoints: dict, tmp_path: Path, case: str, changes: dict, reason: str
) -> None:
    folder = edited_copy(checkpoints[case][0], tmp_path / "bad", **changes)
    with pytest.raises(CheckpointError, match=reason):
        check_checkpoint(str(folder), 1)


def test_experts_tp_cannot_split_or_missing_are_refused(checkpoints: dict, tmp_path: Path) -> None:
    folder = checkpoints["qwen3-moe"][0]
    odd = edited_copy(folder, tmp_path / "odd", moe_intermediate_size=33)
    with pytest.raises(CheckpointError, match="moe_intermediate_size=33 is not divisible"):
        check_checkpoint(str(odd), 2)
    missing = edited_copy(folder, tmp_path / "missing")
    with_tensors(missing, lambda t: t.pop("model.layers.1.mlp.experts.7.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"experts\.7\.down_proj\.weight is missing"):
        check_checkpoint(str(missing), 1)


def test_a_refused_moe_checkpoint_exits_2_before_any_rank(
    checkpoints: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from deploy import cli

    folder = edited_copy(checkpoints["mixtral"][0], tmp_path / "bad", num_experts_per_tok=5)
    with pytest.raises(SystemExit) as exited:
        cli.kvserve_main(["launch", "-tp", "2", "--model", str(folder)])
    assert exited.value.code == 2
    assert "num_experts_per_tok=5" in capsys.readouterr().err
