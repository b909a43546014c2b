"""Teacher-forced logits of our decoder equal transformers' for every supported architecture
and rope type, at TP=1 and TP=2 (ranks as threads), from one file or a sharded checkpoint.

Tolerances: float32 atol 1e-4 (observed about 1e-5 on logits of magnitude ~10). bfloat16: atol
1.0 against transformers in bfloat16 (observed up to 0.66: both round activations to 8 bits, not
always at the same points, e.g. its eager attention rounds the probabilities, SDPA does not), and
no farther from the float32 logits than transformers' own bfloat16 is, give or take 25%.
"""

import copy
import json
from pathlib import Path

import pytest
import torch

from protocol.kv_cache_spec import SlidingWindowSpec
from protocol.worker_messages import ModelInfo
from tests.unit.hf_checkpoints import (
    GEMMA2_ALTERNATING,
    GEMMA3_FIVE_TO_ONE,
    LLAMA3_ROPE,
    MIXTRAL,
    PHI3_ORIGINAL_LEN,
    PHI3_PARTIAL,
    QWEN3_MIXED_LAYERS,
    QWEN3_MOE,
    hf_logits,
    our_logits,
    write_checkpoint,
    write_checkpoints,
)
from tests.unit.thread_tp_group import run_ranks
from worker.distributed import TPGroup, single_rank_group
from worker.models.hf.config import read_hf_config
from worker.models.hf.rope import Rotary
from worker.models.registry import build_model, get_model_info

FLOAT32_ATOL = 1e-4
BFLOAT16_ATOL = 1.0
BFLOAT16_DRIFT_RATIO = 1.25  # our bf16 error against float32 over transformers' bf16 error
CONTEXT_EFFECT_MIN = 0.1  # a changed earlier token moves the last position's logits at least this
CPU = torch.device("cpu")
CASES = {
    "llama-llama3": ("llama", dict(rope_scaling=LLAMA3_ROPE)),
    "llama-yarn": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        ),
    ),
    "llama-linear-biases": (
        "llama",
        dict(
            rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True, mlp_bias=True
        ),
    ),
    "qwen2-biases": ("qwen2", {}),
    "qwen3-tied-qk-norm": ("qwen3", dict(tie_word_embeddings=True, head_dim=32)),
    "mistral-window-8": ("mistral", dict(sliding_window=8)),
    "qwen3-mixed-layers": ("qwen3", QWEN3_MIXED_LAYERS),
    "llama-one-kv-head": ("llama", dict(num_key_value_heads=1)),  # TP=2 replicates it
    "qwen3-moe": ("qwen3-moe", QWEN3_MOE),  # TP=2: test_hf_moe.py
    "mixtral": ("mixtral", MIXTRAL),
    "gemma2-alternating": ("gemma2", GEMMA2_ALTERNATING),
    "gemma3-five-to-one": ("gemma3", GEMMA3_FIVE_TO_ONE),
    "phi3-partial-longrope": ("phi3", PHI3_PARTIAL),
}
TOKENS = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(7)).tolist()

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """Each case's folder and its transformers model (float32)."""
    return write_checkpoints(tmp_path_factory, CASES)


def rank_logits(
    folder: Path, group: TPGroup, dtype: str = "float32", tokens: list[int] = TOKENS
) -> torch.Tensor:
    """Our logits of `tokens`, served with max_model_len their length (for longrope: the
    factor set transformers picks for one pass over them)."""
    model = build_model(str(folder), group, CPU, dtype=dtype, max_model_len=len(tokens))
    info = get_model_info(str(folder), 4, dtype, group.tp_size)
    return our_logits(model, info, tokens)


@pytest.mark.parametrize("case", list(CASES))
def test_float32_logits_equal_transformers(checkpoints: dict, case: str) -> None:
    folder, hf_model = checkpoints[case]
    ours = rank_logits(folder, single_rank_group())
    reference = hf_logits(hf_model, TOKENS)
    torch.testing.assert_close(ours, reference, atol=FLOAT32_ATOL, rtol=0)
    # the context matters: a token 4 before the last (inside every window) moves its logits
    changed = list(TOKENS)
    changed[-5] = (changed[-5] + 1) % 256
    shift = (hf_logits(hf_model, changed)[-1] - reference[-1]).abs().max()
    assert shift > CONTEXT_EFFECT_MIN, f"{case}: context barely matters ({shift:.3g})"


@pytest.mark.parametrize(
    "case",
    [
        "qwen3-mixed-layers",
        "llama-linear-biases",
        "llama-one-kv-head",
        "gemma2-alternating",
        "gemma3-five-to-one",
        "phi3-partial-longrope",
    ],
)
def test_tp2_ranks_agree_bytewise_and_equal_tp1(checkpoints: dict, case: str) -> None:
    """Two ranks as threads with an in-process all-reduce: the same bytes on both, close to TP=1
    (biases of o and down added once; a single KV head replicated on both ranks)."""
    folder, hf_model = checkpoints[case]
    rank0, rank1 = run_ranks(2, lambda group: rank_logits(folder, group))
    assert torch.equal(rank0, rank1)
    torch.testing.assert_close(rank0, hf_logits(hf_model, TOKENS), atol=FLOAT32_ATOL, rtol=0)


def test_the_sliding_window_reads_exactly_its_tokens(checkpoints: dict) -> None:
    """Mistral's window of 8 reads the current token and the 7 before it: a spec of 7 or 9
    tokens gives other logits, so the mapping onto SlidingWindowSpec is pinned."""
    folder, hf_model = checkpoints["mistral-window-8"]
    model = build_model(str(folder), single_rank_group(), CPU)
    info = get_model_info(str(folder), 4, "float32")
    reference = hf_logits(hf_model, TOKENS)
    for window in (7, 9):
        group = info.kv_cache_groups[0]
        spec = SlidingWindowSpec(4, 2, 16, "float32", sliding_window=window)
        shifted = ModelInfo(
            info.name,
            info.vocab_size,
            info.eos_token_ids,
            info.max_model_len,
            [type(group)(group.layer_names, spec)],
        )
        assert (our_logits(model, shifted, TOKENS) - reference).abs().max() > CONTEXT_EFFECT_MIN


def test_qwen_layer_types_derive_from_max_window_layers(tmp_path: Path) -> None:
    """A hub config without layer_types (older transformers wrote none): use_sliding_window with
    max_window_layers=1 windows layers 1 on, exactly as transformers runs that model."""
    folder = tmp_path / "qwen2"
    hf_model = write_checkpoint(
        folder, "qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1
    )
    config = json.loads((folder / "config.json").read_text())
    assert config.pop("layer_types") == ["full_attention", "sliding_attention"]
    (folder / "config.json").write_text(json.dumps(config))
    info = get_model_info(str(folder), 4, "float32")
    assert [type(group.spec) for group in info.kv_cache_groups][1] is SlidingWindowSpec
    ours = rank_logits(folder, single_rank_group())
    torch.testing.assert_close(ours, hf_logits(hf_model, TOKENS), atol=FLOAT32_ATOL, rtol=0)


def test_a_sharded_checkpoint_loads_the_same_weights(tmp_path: Path) -> None:
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    write_checkpoint(single, "qwen2", seed=3)
    write_checkpoint(sharded, "qwen2", seed=3, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert torch.equal(
        rank_logits(single, single_rank_group()), rank_logits(sharded, single_rank_group())
    )


# Not qwen3-moe: with TOKENS its router nearly ties the 2nd and 3rd expert at position 4 (float32
# probabilities 0.1689 and 0.1680), so bfloat16 noise picks either there, on either side
@pytest.mark.parametrize(
    "case",
    ["qwen3-tied-qk-norm", "llama-llama3", "mixtral", "gemma2-alternating", "gemma3-five-to-one"],
)
def test_bfloat16_logits_are_close_to_transformers_in_bfloat16(
    checkpoints: dict, case: str
) -> None:
    folder, hf_model = checkpoints[case]
    ours = rank_logits(folder, single_rank_group(), "bfloat16")
    reference = hf_logits(copy.deepcopy(hf_model).to(torch.bfloat16), TOKENS)
    torch.testing.assert_close(ours, reference, atol=BFLOAT16_ATOL, rtol=0)
    exact = hf_logits(hf_model, TOKENS)
    our_drift, their_drift = (ours - exact).abs().max(), (reference - exact).abs().max()
    assert our_drift <= BFLOAT16_DRIFT_RATIO * their_drift, (our_drift, their_drift)
    # TP=2 in bfloat16: the ranks still agree to the byte
    rank0, rank1 = run_ranks(2, lambda group: rank_logits(folder, group, "bfloat16"))
    assert torch.equal(rank0, rank1)


def test_longrope_picks_its_factor_set_by_max_model_len(checkpoints: dict) -> None:
    """Within the original context the short factors, past it the long ones, each scaled by
    longrope's attention factor: cos and sin equal transformers' rotary embedding on one pass
    over a sequence of max_model_len tokens."""
    folder, hf_model = checkpoints["phi3-partial-longrope"]
    config = read_hf_config(str(folder))
    theirs, dummy = hf_model.model.rotary_emb, torch.zeros(1, dtype=torch.float32)
    cos_sins = {}
    for length in (PHI3_ORIGINAL_LEN, PHI3_ORIGINAL_LEN + 1):
        rotary = Rotary(config.rope, config.head_dim, CPU, max_model_len=length)
        assert rotary.rotary_dim == config.head_dim // 2
        positions = torch.arange(length)
        cos, sin = rotary.cos_sin(positions, torch.float32)
        hf_cos, hf_sin = theirs(dummy, positions[None, :])
        torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=0)
        cos_sins[length] = cos[:PHI3_ORIGINAL_LEN]
    assert not torch.allclose(*cos_sins.values())  # the two sets rotate differently
    assert config.rope.attention_factor is None and theirs.attention_scaling > 1.0


@pytest.mark.parametrize("num_tokens", [PHI3_ORIGINAL_LEN - 8, PHI3_ORIGINAL_LEN + 24])
def test_longrope_logits_equal_transformers_within_and_past_the_original_context(
    checkpoints: dict, num_tokens: int
) -> None:
    """A sequence shorter than original_max_position_embeddings (served with max_model_len
    within it) and one longer (served with a longer max_model_len): every position's logits
    equal transformers' one pass over the sequence, which picks the set by its length."""
    folder, hf_model = checkpoints["phi3-partial-longrope"]
    generator = torch.Generator().manual_seed(num_tokens)
    tokens = torch.randint(3, 256, (num_tokens,), generator=generator).tolist()
    ours = rank_logits(folder, single_rank_group(), tokens=tokens)
    torch.testing.assert_close(ours, hf_logits(hf_model, tokens), atol=FLOAT32_ATOL, rtol=0)
    # the other set is not close: the choice is what makes them equal
    other_len = PHI3_ORIGINAL_LEN if num_tokens > PHI3_ORIGINAL_LEN else PHI3_ORIGINAL_LEN + 1
    model = build_model(str(folder), single_rank_group(), CPU, max_model_len=other_len)
    info = get_model_info(str(folder), 4, "float32", 1)
    other = our_logits(model, info, tokens)
    assert (other - ours).abs().max() > CONTEXT_EFFECT_MIN
