"""bench/http_engines.py's workload (bench/conversations.py) and figures: each turn of a
conversation extends the one before it (so an engine that kept the conversation serves its
history from cache), conversations share skewed system prompts, and the figures compare every
policy with kv."""

from bench.conversations import NUM_TURNS, REPLY_LEN, SYSTEM_PROMPT_LEN, USER_TURN_LEN, workload
from bench.http_engines import POLICIES, REFERENCE, Pass, Sizing, figures


def test_each_turn_extends_the_last_with_its_reply_and_a_new_message() -> None:
    systems, conversations = workload(seed=3, num_conversations=20)
    assert workload(seed=3, num_conversations=20) == (systems, conversations)
    assert all(len(system) == SYSTEM_PROMPT_LEN for system in systems)
    for conversation in conversations:
        prompts = [conversation.prompt(systems, turn) for turn in range(NUM_TURNS)]
        assert prompts[0][:SYSTEM_PROMPT_LEN] == systems[conversation.system_idx]
        for turn in range(1, NUM_TURNS):
            earlier = prompts[turn - 1] + conversation.replies[turn - 1]
            assert prompts[turn][: len(earlier)] == earlier
            assert len(prompts[turn]) == len(earlier) + USER_TURN_LEN
        assert len(prompts[-1]) == SYSTEM_PROMPT_LEN + NUM_TURNS * USER_TURN_LEN + (
            (NUM_TURNS - 1) * REPLY_LEN
        )
    uses = [sum(c.system_idx == idx for c in conversations) for idx in range(len(systems))]
    assert uses[0] == max(uses), uses  # the popular system prompt


def test_figures_report_every_side_and_the_goals_against_kv() -> None:
    sizing = Sizing(4, 96, 4.0, 60.0, 8, 4)

    def one(hit_rate: float, ttft_s: float) -> Pass:
        return Pass(2.0, 100, [ttft_s] * 10, 1000, int(1000 * hit_rate))

    passes = {side: [one(0.5, 0.05)] for side in POLICIES} | {REFERENCE: [one(0.8, 0.06)]}
    passes["kv"] = [one(0.75, 0.04)]
    measured = figures(passes, sizing)
    assert measured["kv_hit_rate"] == 0.75 and measured["one_engine_4x_hit_rate"] == 0.8
    assert measured["kv_minus_first_block_hit_rate_points"] == 25.0
    assert round(float(measured["reference_minus_kv_hit_rate_points"]), 6) == 5.0
    assert round(float(measured["ratio_kv_ttft_p50_to_round_robin"]), 6) == 0.8
    assert measured["kv_ttft_p50_ms"] == 40.0 and measured["round_robin_output_tokens_per_s"] == 50
