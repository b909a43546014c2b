"""Tokens each hybrid model's KV cache holds in one `--kv-cache-memory-bytes`, against the summed
layout kvserve planned before it laid groups out as vLLM does.

The shared layout (worker/kv_cache.py, engine_core/kv_cache/spec.py): layer i of every group views
one tensor, so a block id costs one page per layer of one group, and a sliding-window or chunked
group counts the blocks its span needs. The baseline, computed in the same run from the same
specs: a block id cost a page in every layer of every group, and every group counted a block per
`block_size` tokens of max_model_len. Tokens = usable blocks x max_model_len / blocks per request,
the figure the engine logs ("KV cache holds N tokens"). No processes, no timing.
Run: python -m bench.capacity [--kv-cache-memory-bytes N] [--max-model-len L] [--tp N]
[--json FILE]
"""

from bench.report import base_parser, report
from engine_core.kv_cache.spec import NUM_NULL_BLOCKS, cdiv, num_blocks_per_request
from protocol.config import SchedulerConfig
from protocol.kv_cache_spec import KVCacheGroupSpec, MambaSpec
from worker.kv_cache import num_blocks_in_budget
from worker.models.registry import get_model_info

HYBRID_MODELS = (
    "tiny-llama-hybrid",
    "tiny-llama-hybrid-2x",
    "tiny-local",
    "tiny-mamba-hybrid",
)
TITLE = "KV-cache capacity per model (ratios: shared layout over the summed one, same budget)"


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


def main() -> None:
    parser = base_parser(TITLE)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=16_000_000)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the ranks")
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
    report(TITLE, figures, args.json)


if __name__ == "__main__":
    main()
