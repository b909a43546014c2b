"""bench/kv_tiers.py: the workload's sizes, each side's flags, and the goals' arithmetic."""

from pathlib import Path

import pytest

from bench import engine_loop
from bench import engine_loop_tiers as loop_tiers
from bench.engine_loop_tiers import DOCUMENT_TOKENS, NUM_DOCUMENTS, SPARE_BLOCKS, turn_blocks
from bench.kv_tiers import Chat, TurnResult, side_figures, side_flags, summarize

CHAT = Chat(8, 3, 512, 32, 16, 2)
BLOCK_BYTES = 1 << 18


def test_the_pool_is_a_quarter_of_every_conversation_s_last_context() -> None:
    assert CHAT.last_context_tokens == 512 + 3 * 48
    assert CHAT.pool_blocks == -(-8 * 41 // 4) == 82  # 656 tokens: 41 blocks each


def test_the_lowest_tier_holds_four_pools(tmp_path: Path) -> None:
    def flag(side: str, name: str) -> int | None:
        flags = side_flags(side, 82, BLOCK_BYTES, tmp_path)
        return int(flags[flags.index(name) + 1]) if name in flags else None

    assert flag("no_tier", "--num-gpu-blocks-override") == 83  # with the null block
    assert flag("pool_4x", "--num-gpu-blocks-override") == 4 * 82 + 1
    assert flag("no_tier", "--kv-offload-host-bytes") is None
    assert flag("host", "--kv-offload-host-bytes") == 4 * 82 * BLOCK_BYTES
    assert flag("host_disk", "--kv-offload-host-bytes") == 82 * BLOCK_BYTES
    assert flag("host_disk", "--kv-offload-disk-bytes") == 4 * 82 * BLOCK_BYTES


def test_hit_rate_counts_cached_tokens_of_every_prompt_token() -> None:
    results = [TurnResult(0, 0, 100, 0, 0.2, [1, 2]), TurnResult(0, 1, 120, 90, 0.1, [3, 4])]
    figures = side_figures("host", results, wall_s=2.0)
    assert figures["host_prefix_hit_rate"] == pytest.approx(90 / 220)
    assert figures["host_output_tokens_per_s"] == 2.0
    assert figures["host_ttft_p50_ms"] == pytest.approx(150.0)


def test_the_goals_are_medians_of_per_round_ratios() -> None:
    def round_figures(no_tier_ttft_ms: float, host_ttft_ms: float) -> dict[str, float]:
        figures = {}
        for side, hit, ttft in (
            ("no_tier", 0.0, no_tier_ttft_ms),
            ("host", 0.6, host_ttft_ms),
            ("host_disk", 0.55, host_ttft_ms),
            ("pool_4x", 0.62, 100.0),
        ):
            figures[f"{side}_prefix_hit_rate"] = hit
            figures[f"{side}_ttft_p50_ms"] = ttft
            figures[f"{side}_output_tokens_per_s"] = 10.0
        return figures

    summary = summarize(
        [round_figures(1000, 100), round_figures(900, 300), round_figures(800, 200)]
    )
    assert summary["ratio_ttft_p50_no_tier_over_host"] == pytest.approx(4.0)  # of 10, 3, 4
    assert summary["host_hit_rate_points_below_pool_4x"] == pytest.approx(2.0)
    assert summary["host_disk_hit_rate_points_below_pool_4x"] == pytest.approx(7.0)


def test_the_engine_loop_turnover_moves_documents_through_the_host_tier() -> None:
    """bench.engine_loop --kv-offload-host-bytes: the documents do not fit in the pool's spare
    blocks, the turns do, and the host tier's bytes cover every rank."""
    assert turn_blocks(16) == 6  # 64 + 8 + 24 tokens
    assert NUM_DOCUMENTS * DOCUMENT_TOKENS // 16 == 16 * SPARE_BLOCKS
    # 256 turns drawn at random hold about 162 documents: the ~94 others' blocks exceed the spare
    held = NUM_DOCUMENTS * (1 - (1 - 1 / NUM_DOCUMENTS) ** 256)
    assert round(held) == 162
    assert (NUM_DOCUMENTS - held) * DOCUMENT_TOKENS // 16 > SPARE_BLOCKS
    one_block = loop_tiers.kv_cache_memory_bytes("fixed-time", 16, 1, 2) // (6 + SPARE_BLOCKS)
    assert loop_tiers.kv_cache_memory_bytes("fixed-time", 16, 256, 2) == one_block * (
        256 * 6 + SPARE_BLOCKS
    )
    assert loop_tiers.host_tier_bytes("fixed-time", 16, 8192, 2) == 8192 * one_block * 2


@pytest.mark.parametrize("flag", [["--kv-offload-host-bytes", "-1"], ["--rounds", "0"]])
def test_the_engine_loop_refuses_bad_tier_flags(flag: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        engine_loop.parse_args(flag, ["sync", "async"])
    assert exit_info.value.code == 2
