"""bench/cpu_serving.py's arithmetic: the figures read from `vllm bench serve`'s saved results,
kvserve's per-step figures, the same-work check, each dtype's summary and ratio keys, and the
flags it refuses. Neither server nor the client runs here."""

import pytest

from bench.cpu_serving import (
    Workload,
    check_same_work,
    client_figures,
    dtype_summary,
    parse_args,
    step_figures,
)
from bench.peer_rounds import PeerRound, Side, round_order

WORKLOAD = Workload(input_len=256, output_len=128, num_prompts=48, max_concurrency=16)


def _saved_result(**changes: float) -> dict:
    """The keys of a `vllm bench serve --save-result` file the bench reads."""
    return {
        "completed": 48,
        "failed": 0,
        "duration": 60.0,
        "output_throughput": 102.4,
        "median_tpot_ms": 90.0,
        "mean_tpot_ms": 95.0,
        "median_ttft_ms": 1200.0,
        "mean_ttft_ms": 1500.0,
        "total_input_tokens": 12290,
        "total_output_tokens": 6144,
    } | changes


def _figures(output_tok_s: float, tpot_ms: float) -> dict:
    return client_figures(
        _saved_result(output_throughput=output_tok_s, median_tpot_ms=tpot_ms), WORKLOAD
    )


def test_client_figures_name_each_saved_metric() -> None:
    assert client_figures(_saved_result(), WORKLOAD) == {
        "output_tok_s": 102.4,
        "tpot_p50_ms": 90.0,
        "tpot_mean_ms": 95.0,
        "ttft_p50_ms": 1200.0,
        "ttft_mean_ms": 1500.0,
        "num_input_tokens": 12290,
        "num_output_tokens": 6144,
    }


@pytest.mark.parametrize("changes", [{"failed": 1, "completed": 47}, {"completed": 40}])
def test_a_run_with_failed_or_missing_requests_is_refused(changes: dict) -> None:
    with pytest.raises(RuntimeError, match="of 48 completed"):
        client_figures(_saved_result(**changes), WORKLOAD)


def test_step_figures_divide_the_forward_time_by_the_steps_of_the_run() -> None:
    before = {"num_engine_steps": 100.0, "rank_forward_s": 10.0}
    after = {"num_engine_steps": 300.0, "rank_forward_s": 30.0}
    assert step_figures(before, after, duration_s=25.0) == {
        "num_steps": 200,
        "forward_ms_per_step": 100.0,
        "forward_share": 0.8,
    }


def test_sides_that_tokenized_the_prompts_differently_are_refused() -> None:
    ours = client_figures(_saved_result(), WORKLOAD)
    check_same_work(ours, dict(ours))
    with pytest.raises(RuntimeError, match="num_input_tokens: kvserve 12290, vLLM 12338"):
        check_same_work(ours, ours | {"num_input_tokens": 12338})


def test_dtype_summary_keys_each_side_and_ratio_by_dtype() -> None:
    rounds = [
        PeerRound(_figures(50.0, 200.0), _figures(100.0, 100.0), round_order(0)),
        PeerRound(_figures(60.0, 150.0), _figures(100.0, 100.0), round_order(1)),
        PeerRound(_figures(90.0, 120.0), _figures(100.0, 100.0), round_order(2)),
    ]
    summary = dtype_summary("bfloat16", rounds)
    assert summary["kvserve_output_tok_s_bfloat16"] == 60.0
    assert summary["vllm_output_tok_s_bfloat16"] == 100.0
    assert summary["kvserve_num_output_tokens_bfloat16"] == 6144
    # kvserve / vLLM for every figure, rates and latencies alike; the median of the rounds'
    assert summary["rounds_ratio_output_tok_s_bfloat16"] == [0.5, 0.6, 0.9]
    assert summary["ratio_output_tok_s_bfloat16"] == 0.6
    assert summary["rounds_ratio_tpot_p50_ms_bfloat16"] == [2.0, 1.5, 1.2]
    assert summary["ratio_tpot_p50_ms_bfloat16"] == 1.5
    assert summary["ratio_ttft_p50_ms_bfloat16"] == 1.0
    assert {key for key in summary if key.startswith("ratio_")} == {
        "ratio_output_tok_s_bfloat16",
        "ratio_tpot_p50_ms_bfloat16",
        "ratio_tpot_mean_ms_bfloat16",
        "ratio_ttft_p50_ms_bfloat16",
    }
    assert rounds[1].order == (Side.PEER, Side.OURS)


def test_defaults_are_the_issue_workload_on_both_dtypes() -> None:
    args = parse_args([])
    assert args.rounds == 3
    assert args.dtypes == ["float32", "bfloat16"]
    assert args.workload == WORKLOAD
    assert args.vllm_bin == args.peer_python.parent / "vllm"


def test_passed_through_flags_are_split_as_a_shell_would() -> None:
    args = parse_args(["--kvserve-args", "--max-num-seqs 8 --log-level 'WARNING'"])
    assert args.kvserve_args == ["--max-num-seqs", "8", "--log-level", "WARNING"]
    assert args.vllm_args == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtypes", "float16"],
        ["--dtypes", ","],
        ["--rounds", "0"],
        ["--num-prompts", "0"],
        ["--input-len", "1000", "--output-len", "100"],  # past --max-model-len 1024
    ],
)
def test_bad_flags_are_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
