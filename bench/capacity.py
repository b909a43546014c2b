"""Tokens each hybrid model's KV cache holds in one `--kv-cache-memory-bytes`, against the summed
layout kvserve planned before it laid groups out as vLLM does.

The shared layout (worker/kv_cache.py, engine_core/kv_cache/spec.py): layer i of every group views
one tensor, so a block id costs one page per layer of one group, and a sliding-window or chunked
group counts the blocks its span needs. The baseline, computed in the same run from the same
specs: a block id cost a page in every layer of every group, and every group counted a block per
`block_size` tokens of max_model_len. Tokens = usable blocks x max_model_len / blocks per request,
the figure the engine logs ("KV cache holds N tokens"). No processes, no timing.

Checkpoint shapes (Gemma 2 2B, Gemma 3 1B: their config.json alone, no weights) are planned as
the engine plans them, sliding-window layers in a group of their own on the one pool, against
the same layers all full attention, each at its own max_position_embeddings (or
`--checkpoint-max-model-len`). A window group still holds a whole step's chunk of blocks, so the
gain grows with the context over window + step.
Run: python -m bench.capacity [--kv-cache-memory-bytes N] [--max-model-len L] [--tp N]
[--checkpoint-max-model-len L] [--json FILE]
"""

import json
import tempfile
from pathlib import Path

from bench.report import base_parser, report
from engine_core.kv_cache.spec import NUM_NULL_BLOCKS, cdiv, num_blocks_per_request
from protocol.config import SchedulerConfig
from protocol.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from worker.kv_cache import num_blocks_in_budget
from worker.models.registry import get_model_info

HYBRID_MODELS = (
    "tiny-llama-hybrid",
    "tiny-llama-hybrid-2x",
    "tiny-local",
    "tiny-mamba-hybrid",
)
TITLE = "KV-cache capacity per model (ratios: shared layout over the summed one, same budget)"
_GEMMA = dict(vocab_size=256_000, max_position_embeddings=131_072, torch_dtype="bfloat16")
# The published shapes (config.json fields that the KV cache depends on)
CHECKPOINT_SHAPES = {
    "gemma2-2b": dict(
        _GEMMA,
        architectures=["Gemma2ForCausalLM"],
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        max_position_embeddings=8192,
    ),
    "gemma3-1b": dict(
        _GEMMA,
        architectures=["Gemma3ForCausalLM"],
        vocab_size=262_144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
        max_position_embeddings=32_768,
    ),
}


def summed_layout_tokens(
    groups: list[KVCacheGroupSpec], tp_size: int, budget_bytes: int, max_model_len: int
) -> int:
    """Tokens under the old plan: every layer of every group paid per block id, and every
    group held a block per `block_size` tokens of the sequence (a state group one block)."""
    bytes_per_block = sum(
        len(group.layer_names) * group.spec.page_size_bytes(tp_size) for group in groups
    )
    num_usable = budget_bytes // bytes_per_block - NUM_NULL_BLOCKS
    per_request = sum(
        1 if isinstance(group.spec, MambaSpec) else cdiv(max_model_len, group.spec.block_size)
        for group in groups
    )
    return num_usable * max_model_len // per_request


def shared_layout_tokens(
    groups: list[KVCacheGroupSpec],
    tp_size: int,
    budget_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> tuple[int, int]:
    """(blocks, tokens) as a rank and the engine plan them today (the worker's budget
    arithmetic, the scheduler's blocks per request at its default step size)."""
    num_blocks = num_blocks_in_budget(groups, tp_size, budget_bytes)
    per_request = num_blocks_per_request(groups, max_model_len, max_num_batched_tokens)
    return num_blocks, (num_blocks - NUM_NULL_BLOCKS) * max_model_len // per_request


def all_full(groups: list[KVCacheGroupSpec]) -> list[KVCacheGroupSpec]:
    """The same layers with every sliding window read whole: one full-attention group."""
    names = [name for group in groups for name in group.layer_names]
    spec = groups[0].spec
    assert all(isinstance(g.spec, FullAttentionSpec | SlidingWindowSpec) for g in groups)
    full = FullAttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_dim, spec.dtype)
    return [KVCacheGroupSpec(names, full)]


def checkpoint_groups(shape: dict, block_size: int) -> list[KVCacheGroupSpec]:
    """The KV-cache groups a checkpoint of `shape` gets (its config.json is all that is read)."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(shape))
        return get_model_info(folder, block_size, "bfloat16").kv_cache_groups


def main() -> None:
    parser = base_parser(TITLE)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=16_000_000)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the ranks")
    parser.add_argument(
        "--checkpoint-max-model-len",
        type=int,
        default=None,
        help="sequence length the checkpoint shapes are planned at (default: each one's own)",
    )
    args = parser.parse_args()
    step_tokens = SchedulerConfig().max_num_batched_tokens
    figures: dict[str, float | int | str | list[float]] = {
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "max_model_len": args.max_model_len,
    }
    for model in HYBRID_MODELS:
        groups = get_model_info(model, args.block_size).kv_cache_groups
        key = model.replace("-", "_")
        budget, length = args.kv_cache_memory_bytes, args.max_model_len
        num_blocks, tokens = shared_layout_tokens(groups, args.tp, budget, length, step_tokens)
        summed = summed_layout_tokens(groups, args.tp, budget, length)
        figures[f"{key}_num_blocks"] = num_blocks
        figures[f"{key}_tokens"] = tokens
        figures[f"{key}_summed_layout_tokens"] = summed
        figures[f"ratio_{key}_tokens_vs_summed_layout"] = tokens / summed
    for model, shape in CHECKPOINT_SHAPES.items():
        groups = checkpoint_groups(shape, args.block_size)
        key = model.replace("-", "_")
        length = args.checkpoint_max_model_len or shape["max_position_embeddings"]
        figures[f"{key}_max_model_len"] = length
        budget = args.kv_cache_memory_bytes
        _, tokens = shared_layout_tokens(groups, args.tp, budget, length, step_tokens)
        _, full_tokens = shared_layout_tokens(
            all_full(groups), args.tp, budget, length, step_tokens
        )
        figures[f"{key}_tokens"] = tokens
        figures[f"{key}_all_full_tokens"] = full_tokens
        figures[f"ratio_{key}_tokens_vs_all_full"] = tokens / full_tokens
    report(TITLE, figures, args.json)


if __name__ == "__main__":
    main()
