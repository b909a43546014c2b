"""bench/peer_rounds.py and the three peer benchmarks built on it: rounds alternate who goes first,
each ratio is the median of per-round ratios, fewer than five rounds are refused, and every round's
pair passes the benchmark's same-work check. The peer itself (vLLM) never runs here."""

import argparse

import pytest

from bench import block_pool, kv_cache_manager, scheduler
from bench.peer_rounds import (
    MIN_ROUNDS,
    PeerRatio,
    PeerRound,
    Side,
    add_rounds_argument,
    median_figures,
    round_order,
    round_ratio,
    run_rounds,
    summarize,
)
from bench.trace import TraceConfig, make_trace, trace_digest

TIME = PeerRatio("ratio_time_vs_peer", "us_per_step", is_ours_over_peer=False)
RATE = PeerRatio("ratio_rate_vs_peer", "requests_per_s", is_ours_over_peer=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_rounds_argument(parser)
    return parser


def _same_work(ours: dict, peer: dict) -> None:
    return None


def test_rounds_default_to_five_and_accept_more() -> None:
    assert _parser().parse_args([]).rounds == MIN_ROUNDS == 5
    assert _parser().parse_args(["--rounds", "9"]).rounds == 9


@pytest.mark.parametrize("value", ["4", "1", "0", "-3", "five"])
def test_fewer_than_five_rounds_is_a_usage_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--rounds", value])
    assert exit_info.value.code == 2
    assert "argument --rounds" in capsys.readouterr().err


def test_run_rounds_refuses_fewer_than_five_rounds() -> None:
    with pytest.raises(ValueError, match="at least 5"):
        run_rounds(4, dict, dict, _same_work)


def test_rounds_alternate_which_side_goes_first() -> None:
    assert [round_order(idx) for idx in range(4)] == [
        (Side.OURS, Side.PEER),
        (Side.PEER, Side.OURS),
        (Side.OURS, Side.PEER),
        (Side.PEER, Side.OURS),
    ]


def test_run_rounds_measures_in_alternating_order_and_keeps_each_sides_figures() -> None:
    calls: list[str] = []

    def measure(side: str) -> dict:
        calls.append(side)
        return {"round_idx": sum(1 for call in calls if call == side) - 1}

    rounds = run_rounds(6, lambda: measure("ours"), lambda: measure("peer"), _same_work)
    assert calls == ["ours", "peer", "peer", "ours"] * 3
    assert [r.ours["round_idx"] for r in rounds] == list(range(6))
    assert [r.peer["round_idx"] for r in rounds] == list(range(6))
    assert [r.order for r in rounds] == [round_order(idx) for idx in range(6)]


def test_run_rounds_checks_the_same_work_every_round() -> None:
    checked: list[tuple[int, int]] = []
    ours_calls, peer_calls = iter(range(5)), iter(range(10, 15))

    def check(ours: dict, peer: dict) -> None:
        checked.append((ours["idx"], peer["idx"]))
        if peer["idx"] == 13:
            raise SystemExit("different work")

    with pytest.raises(SystemExit, match="different work"):
        run_rounds(5, lambda: {"idx": next(ours_calls)}, lambda: {"idx": next(peer_calls)}, check)
    assert checked == [(0, 10), (1, 11), (2, 12), (3, 13)]


def test_round_ratio_divides_the_way_the_ratio_says() -> None:
    ours = {"us_per_step": 100.0, "requests_per_s": 300.0}
    peer = {"us_per_step": 250.0, "requests_per_s": 100.0}
    assert round_ratio(ours, peer, TIME) == 2.5
    assert round_ratio(ours, peer, RATE) == 3.0


def test_round_ratio_refuses_a_zero_divisor() -> None:
    with pytest.raises(ValueError, match=r"us_per_step is 0\.0"):
        round_ratio({"us_per_step": 0.0}, {"us_per_step": 5.0}, TIME)


def test_the_ratio_is_the_median_of_per_round_ratios_not_a_ratio_of_medians() -> None:
    ours_us = [100.0, 100.0, 100.0, 400.0, 400.0]
    peer_us = [200.0, 300.0, 800.0, 400.0, 1200.0]  # per-round ratios 2, 3, 8, 1, 3
    rounds = [
        PeerRound({"us_per_step": o, "num_reqs": 64}, {"us_per_step": p, "num_reqs": 64}, order)
        for o, p, order in zip(ours_us, peer_us, map(round_order, range(5)), strict=True)
    ]
    summary = summarize(rounds, [TIME], ["us_per_step"])
    assert summary["rounds_ratio_time_vs_peer"] == [2.0, 3.0, 8.0, 1.0, 3.0]
    assert summary["ratio_time_vs_peer"] == 3.0  # the ratio of the medians would be 4.0
    assert summary["us_per_step"] == 100.0
    assert summary["vllm_us_per_step"] == 400.0
    assert summary["num_reqs"] == 64
    assert "vllm_num_reqs" not in summary  # only the peer keys asked for
    assert summary["num_rounds"] == 5


def test_median_figures_keeps_equal_counts_and_refuses_differing_labels() -> None:
    rounds = [{"num_hits": 7, "us": 1.0}, {"num_hits": 7, "us": 3.0}, {"num_hits": 7, "us": 2.0}]
    assert median_figures(rounds) == {"num_hits": 7, "us": 2.0}
    with pytest.raises(ValueError, match="digest differs between rounds"):
        median_figures([{"digest": "a"}, {"digest": "b"}])


def test_block_pool_ratios_keep_their_readme_names_and_directions() -> None:
    ours = {
        "us_per_request": 200.0,
        "pool_only_us_per_request": 100.0,
        "construct_1m_blocks_ms": 300.0,
        "memory_1m_blocks_bytes_per_block": 120.0,
    }
    peer = {
        "us_per_request": 500.0,
        "pool_only_us_per_request": 150.0,
        "construct_1m_blocks_ms": 2000.0,
        "memory_1m_blocks_bytes_per_block": 150.0,
    }
    ratios = {ratio.key: round_ratio(ours, peer, ratio) for ratio in block_pool.RATIOS}
    assert ratios == {
        "ratio_throughput_vs_vllm": 2.5,
        "ratio_pool_only_throughput_vs_vllm": 1.5,
        "ratio_construct_time_vs_vllm": 0.15,
        "ratio_memory_per_block_vs_vllm": 0.8,
    }


def test_block_pool_stops_on_a_peer_that_hit_or_evicted_differently() -> None:
    trace = make_trace(TraceConfig(seed=3, num_requests=10))
    ours = {"num_hit_blocks": 5, "num_evicted_blocks": 2}
    block_pool.check_same_work(trace, ours, {**ours, "trace_digest": trace_digest(trace)})
    with pytest.raises(SystemExit, match=r"kvserve \(5, 2\), vLLM \(5, 3\)"):
        peer = {"num_hit_blocks": 5, "num_evicted_blocks": 3, "trace_digest": trace_digest(trace)}
        block_pool.check_same_work(trace, ours, peer)
    with pytest.raises(SystemExit, match="different trace"):
        block_pool.check_same_work(trace, ours, {**ours, "trace_digest": "0"})


def test_kv_cache_manager_ratios_are_ours_over_the_peers_rates() -> None:
    assert [(r.key, r.figure, r.is_ours_over_peer) for r in kv_cache_manager.RATIOS] == [
        ("ratio_manager_vs_vllm", "manager_requests_per_s", True),
        ("ratio_replay_vs_vllm", "replay_requests_per_s", True),
    ]


def test_kv_cache_manager_stops_on_a_peer_that_decided_differently() -> None:
    trace = make_trace(TraceConfig(seed=3, num_requests=10))
    ours = {name: 4 for name in kv_cache_manager.WORK_COUNTS}
    peer = {**ours, "trace_digest": trace_digest(trace)}
    kv_cache_manager._check_same_work(trace, ours, peer)
    with pytest.raises(SystemExit, match="num_preemptions: kvserve 4, vllm 5"):
        kv_cache_manager._check_same_work(trace, ours, {**peer, "num_preemptions": 5})


def test_kv_cache_manager_turns_the_peers_seconds_into_our_figure_names() -> None:
    trace = make_trace(TraceConfig(seed=3, num_requests=10))
    peer = {name: 1 for name in kv_cache_manager.WORK_COUNTS}
    peer.update({"trace_digest": "d", "manager_s": 0.5, "replay_s": 2.0})
    figures = kv_cache_manager._peer_figures(trace, peer)
    assert figures["manager_requests_per_s"] == 20.0
    assert figures["manager_us_per_request"] == 50_000.0
    assert figures["replay_requests_per_s"] == 5.0
    assert figures["trace_digest"] == "d"


def test_scheduler_stops_when_the_prefill_mix_ends_out_of_step() -> None:
    ours = {"decode_64_us_per_step": 10.0, "prefill_mix_num_running_reqs": 90}
    scheduler.check_same_work(ours, {**ours, "decode_64_us_per_step": 50.0})
    with pytest.raises(SystemExit, match="prefill_mix_num_running_reqs: kvserve 90, vLLM 80"):
        scheduler.check_same_work(ours, {**ours, "prefill_mix_num_running_reqs": 80})
    with pytest.raises(SystemExit, match="reported"):
        scheduler.check_same_work(ours, {"decode_64_us_per_step": 50.0})
