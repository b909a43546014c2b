"""check_checkpoint refuses what the worker cannot serve, naming the field or tensor, and reads
the rest (both rope spellings, layer types, windows, EOS ids, KV-head splits) as transformers does.
"""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deploy.commands import check_model_name
from deploy.flags import UsageError
from protocol.config import WorkerConfig
from protocol.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from tests.unit.hf_checkpoints import (
    GEMMA2_ALTERNATING,
    GEMMA3_FIVE_TO_ONE,
    PHI3_PARTIAL,
    write_checkpoint,
)
from worker.models.hf.checkpoint import check_checkpoint
from worker.models.hf.config import CheckpointError, RopeConfig, read_hf_config
from worker.models.hf.weights import RankShard
from worker.models.registry import get_model_info


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3")
    write_checkpoint(folder, "qwen3", tie_word_embeddings=True, head_dim=32)
    return folder


def edited_copy(source: Path, target: Path, **config_changes: object) -> Path:
    """A copy of `source` whose config.json has `config_changes` (a None value deletes)."""
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    config = json.loads((target / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (target / "config.json").write_text(json.dumps(config))
    return target


def with_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_a_good_checkpoint_passes(qwen3: Path) -> None:
    config = check_checkpoint(str(qwen3), tp_size=2)
    assert (config.architecture, config.head_dim, config.has_qk_norm) == (
        "Qwen3ForCausalLM",
        32,
        True,
    )
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures=['GPT2LMHeadModel']"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "longrope short_factor=None"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5: expected 1.0"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding window is off"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "rope yarn factor=None"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3: expected a divisor"),
    ],
)
def test_an_unsupported_config_is_refused_naming_the_field(
    qwen3: Path, tmp_path: Path, changes: dict, reason: str
) -> None:
    folder = edited_copy(qwen3, tmp_path / "bad", **changes)
    with pytest.raises(CheckpointError, match=reason.replace("[", r"\[").replace("(", r"\(")):
        check_checkpoint(str(folder), 1)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "up_proj.weight is missing"),
        (
            lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64)}),
            r"k_proj.weight has shape \[32, 64\], expected \[64, 64\]",
        ),
        (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(4)}), "is unexpected"),
        (
            lambda t: t.update(
                {"model.norm.weight": torch.zeros(64, dtype=torch.int8)},
            ),
            "model.norm.weight has dtype I8",
        ),
    ],
)
def test_a_wrong_tensor_is_refused_naming_it(
    qwen3: Path, tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], object], reason: str
) -> None:
    folder = edited_copy(qwen3, tmp_path / "bad")
    with_tensors(folder, change)
    with pytest.raises(CheckpointError, match=reason):
        check_checkpoint(str(folder), 1)


def test_head_counts_tp_cannot_split_are_refused(qwen3: Path, tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match="num_attention_heads=4 is not divisible by tp_size=3"
    ):
        check_checkpoint(str(qwen3), 3)
    folder = edited_copy(qwen3, tmp_path / "kv3", num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(CheckpointError, match="num_key_value_heads=3 with tp_size=2"):
        check_checkpoint(str(folder), 2)


def test_tp_beyond_the_kv_heads_replicates_them() -> None:
    """4 query heads, 2 KV heads, TP=4: ranks 0 and 1 read KV head 0, ranks 2 and 3 head 1."""

    class Heads:
        num_heads, num_kv_heads, intermediate_size, moe = 4, 2, 128, None

    shards = [RankShard.of(Heads, rank, 4) for rank in range(4)]  # type: ignore[arg-type]
    assert [s.first_kv_head for s in shards] == [0, 0, 1, 1]
    assert {s.num_kv_heads_per_rank for s in shards} == {1}


def test_deploy_turns_a_refusal_into_a_usage_error(qwen3: Path) -> None:
    with pytest.raises(UsageError, match="num_attention_heads=4 is not divisible by tp_size=3"):
        check_model_name(WorkerConfig(model=str(qwen3)), tp_size=3)
    assert check_model_name(WorkerConfig(model=str(qwen3)), tp_size=2).model == str(qwen3)


@pytest.mark.parametrize(
    ("entry", "argv"),
    [
        ("kvserve_main", ["serve", "-tp", "3", "--port", "1"]),
        ("kvserve_main", ["launch", "-tp", "3"]),
        ("worker_main", ["-tp", "3", "--rank", "0"]),
    ],
)
def test_every_command_exits_2_naming_what_the_checkpoint_lacks(
    qwen3: Path,
    families: dict,
    tmp_path: Path,
    entry: str,
    argv: list[str],
    capsys: pytest.CaptureFixture,
) -> None:
    """A user's `kvserve serve --model DIR` on a checkpoint it cannot serve stops before any
    process starts, with exit code 2 and the reason; the same for launch and kvserve-worker."""
    from deploy import cli

    bad_rope = edited_copy(qwen3, tmp_path / "dynamic", rope_scaling={"rope_type": "dynamic"})
    bidirectional = edited_copy(
        families["gemma3"], tmp_path / "bidirectional", use_bidirectional_attention=True
    )
    for folder, reason in [
        (qwen3, "num_attention_heads=4 is not divisible by tp_size=3"),
        (bad_rope, "dynamic"),
        (bidirectional, "use_bidirectional_attention=True"),
        (families["phi3"], "num_attention_heads=4 is not divisible by tp_size=3"),
    ]:
        with pytest.raises(SystemExit) as exited:
            getattr(cli, entry)([*argv, "--model", str(folder)])
        assert exited.value.code == 2
        assert reason in capsys.readouterr().err


def test_hub_and_transformers_5_rope_spellings_read_alike(qwen3: Path, tmp_path: Path) -> None:
    """The hub ships rope_theta and rope_scaling at the top level; transformers 5 writes
    rope_parameters. A llama3 original length absent defaults to max_position_embeddings."""
    hub = edited_copy(
        qwen3,
        tmp_path / "hub",
        rope_parameters=None,
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    )
    new = edited_copy(
        qwen3,
        tmp_path / "new",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    )
    expected = RopeConfig("llama3", 500000.0, factor=8.0, original_max_position_embeddings=512)
    assert read_hf_config(str(hub)).rope == read_hf_config(str(new)).rope == expected


def test_layer_types_and_windows_become_kv_cache_groups(qwen3: Path, tmp_path: Path) -> None:
    """Qwen's use_sliding_window with max_window_layers windows the layers from it on (as
    transformers derives layer_types); Mistral's window covers every layer."""
    derived = edited_copy(
        qwen3,
        tmp_path / "derived",
        layer_types=None,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    )
    groups = get_model_info(str(derived), 4, "float32").kv_cache_groups
    assert [g.layer_names for g in groups] == [
        ["model.layers.0.self_attn"],
        ["model.layers.1.self_attn"],
    ]
    assert isinstance(groups[0].spec, FullAttentionSpec)
    assert groups[1].spec == SlidingWindowSpec(4, 2, 32, "float32", sliding_window=6)
    mistral = tmp_path / "mistral"
    write_checkpoint(mistral, "mistral", sliding_window=8)
    (group,) = get_model_info(str(mistral), 4, "bfloat16").kv_cache_groups
    assert group.spec == SlidingWindowSpec(4, 2, 16, "bfloat16", sliding_window=8)
    assert len(group.layer_names) == 2


def test_eos_ids_come_from_generation_config_first(qwen3: Path, tmp_path: Path) -> None:
    folder = edited_copy(qwen3, tmp_path / "eos", eos_token_id=5)
    assert read_hf_config(str(folder)).eos_token_ids == (2,)  # generation_config.json says 2
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5, 7]}))
    assert read_hf_config(str(folder)).eos_token_ids == (7, 5)
    assert get_model_info(str(folder), 4).eos_token_ids == [7, 5]
    (folder / "generation_config.json").unlink()
    assert read_hf_config(str(folder)).eos_token_ids == (5,)


def test_tp_replicating_kv_heads_caches_one_head_per_rank(qwen3: Path) -> None:
    (group,) = get_model_info(str(qwen3), 4, "float32", tp_size=4).kv_cache_groups
    assert group.spec.num_kv_heads_per_rank(4) == 1


def test_weight_files_are_found_as_transformers_finds_them(qwen3: Path, tmp_path: Path) -> None:
    """model.safetensors wins over other exports beside it; a folder without weights is refused."""
    folder = edited_copy(qwen3, tmp_path / "extra")
    save_file({"layers.0.attention.wk.weight": torch.zeros(2)}, folder / "consolidated.safetensors")
    check_checkpoint(str(folder), 1)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight is missing"):
        check_checkpoint(str(folder), 1)
    (folder / "consolidated.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"holds no \*.safetensors file"):
        check_checkpoint(str(folder), 1)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Gemma 2, Gemma 3 and Phi-3 checkpoints as the generation tests serve them."""
    folders = {}
    for arch, fields in [
        ("gemma2", GEMMA2_ALTERNATING),
        ("gemma3", GEMMA3_FIVE_TO_ONE),
        ("phi3", PHI3_PARTIAL),
    ]:
        folders[arch] = tmp_path_factory.mktemp(arch)
        write_checkpoint(folders[arch], arch, **json.loads(json.dumps(fields)))
    return folders


def test_gemma_and_phi3_configs_read_as_transformers_runs_them(families: dict) -> None:
    gemma2 = check_checkpoint(str(families["gemma2"]), tp_size=2)
    assert gemma2.sliding_windows == (6, None, 6)
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.attention_scale) == (
        4.0,
        8.0,
        24**-0.5,
    )
    assert gemma2.gemma_norms and gemma2.tie_word_embeddings and not gemma2.has_qk_norm
    gemma3 = check_checkpoint(str(families["gemma3"]), tp_size=2)
    assert gemma3.sliding_windows == (6,) * 5 + (None,)
    assert gemma3.rope == RopeConfig("linear", 20000.0, factor=2.0)
    assert gemma3.sliding_rope == RopeConfig("default", 100.0)
    assert gemma3.has_qk_norm and gemma3.attn_softcap is None and gemma3.final_softcap == 8.0
    phi3 = check_checkpoint(str(families["phi3"]), tp_size=2)
    assert phi3.fused_qkv_gate_up and phi3.sliding_windows == (None, None)
    rope = phi3.rope
    assert (rope.rope_type, rope.partial_rotary_factor, rope.original_max_position_embeddings) == (
        "longrope",
        0.5,
        64,
    )
    assert rope.factor == 512 / 64 and rope.long_factor == (2.0, 3.0, 5.0, 8.0)


def test_gemma_layer_types_default_as_transformers_derives_them(
    families: dict, tmp_path: Path
) -> None:
    """Without layer_types Gemma 2 alternates from a sliding layer 0, and Gemma 3 makes every
    sliding_window_pattern-th layer (6th by default) global; the hub's rope spelling of Gemma 3
    (rope_theta, rope_local_base_freq, rope_scaling) reads as transformers 5's per-type one."""
    gemma2 = edited_copy(families["gemma2"], tmp_path / "g2", layer_types=None)
    assert read_hf_config(str(gemma2)).sliding_windows == (6, None, 6)
    hub = edited_copy(
        families["gemma3"],
        tmp_path / "g3",
        layer_types=None,
        rope_parameters=None,
        rope_theta=20000.0,
        rope_local_base_freq=100.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        sliding_window_pattern=3,
    )
    config = read_hf_config(str(hub))
    assert config.sliding_windows == (6, 6, None, 6, 6, None)
    expected = read_hf_config(str(families["gemma3"]))
    assert (config.rope, config.sliding_rope) == (expected.rope, expected.sliding_rope)
    groups = get_model_info(str(families["gemma3"]), 4, "float32").kv_cache_groups
    # groups of the fewest layers a kind has (1 full layer): the full group, then five windows
    assert [len(g.layer_names) for g in groups] == [1] * 6
    assert [type(g.spec).__name__ for g in groups] == ["FullAttentionSpec"] + [
        "SlidingWindowSpec"
    ] * 5
    assert groups[1].spec == SlidingWindowSpec(4, 2, 16, "float32", sliding_window=6)


@pytest.mark.parametrize(
    ("arch", "changes", "reason"),
    [
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ("gemma2", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar=0.0"),
        ("gemma2", {"final_logit_softcapping": -1}, "final_logit_softcapping=-1.0"),
        ("gemma2", {"sliding_window": 0}, "sliding_window=0: expected null or >= 1"),
        ("gemma3", {"rope_parameters": {"rope_type": "default"}}, "expected an entry per layer"),
        ("phi3", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear': expected"),
        (
            "phi3",
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
            "short_factor has 1 entries: expected rotary_dim / 2 = 4",
        ),
        ("phi3", {"partial_rotary_factor": 0.1, "rope_scaling": None}, "rotates 1 of head_dim=16"),
        ("phi3", {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
    ],
)
def test_gemma_and_phi3_refusals_name_the_field(
    families: dict, tmp_path: Path, arch: str, changes: dict, reason: str
) -> None:
    folder = edited_copy(families[arch], tmp_path / "bad", **changes)
    if changes.get("rope_scaling", "") is None:  # Phi-3's rope_parameters carry the factor too
        config = json.loads((folder / "config.json").read_text())
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=reason.replace("[", r"\[").replace("(", r"\(")):
        check_checkpoint(str(folder), 1)


def test_phi3_fused_tensors_are_checked_whole(families: dict, tmp_path: Path) -> None:
    folder = edited_copy(families["phi3"], tmp_path / "bad")
    with_tensors(
        folder, lambda t: t.update({"model.layers.0.mlp.gate_up_proj.weight": torch.zeros(128, 64)})
    )
    with pytest.raises(CheckpointError, match=r"gate_up_proj.weight has shape \[128, 64\]"):
        check_checkpoint(str(folder), 1)
