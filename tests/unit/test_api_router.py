"""FirstBlockAffinity, the first-block policy: least outstanding tokens (read from the engines'
records, where the Router counts them), prefix affinity, and its imbalance cap."""

import pytest

from api_server.routing.engine_record import EngineRecord, engine_records
from api_server.routing.first_block import FirstBlockAffinity, prefix_key

BLOCK_SIZE = 4


def _prompt(first_block: int, rest: int = 0) -> list[int]:
    return [first_block] * BLOCK_SIZE + [rest] * BLOCK_SIZE


def _policy(num_engines: int, **limits: int) -> tuple[FirstBlockAffinity, list[EngineRecord]]:
    records = engine_records([f"tcp://engine-{idx}:5555" for idx in range(num_engines)])
    return FirstBlockAffinity(records, BLOCK_SIZE, **limits), records


def _send(
    policy: FirstBlockAffinity, prompt: list[int], num_tokens: int, is_available: list[bool]
) -> int:
    """Choose as the Router does, then count the request where it went."""
    engine_idx = policy.choose(prompt, is_available)
    policy.records[engine_idx].load.add(len(prompt), len(prompt), num_tokens)
    return engine_idx


def test_new_prefixes_go_to_the_least_outstanding_engine() -> None:
    policy, records = _policy(3)
    assert _send(policy, _prompt(1), 100, [True] * 3) == 0
    assert _send(policy, _prompt(2), 10, [True] * 3) == 1
    assert _send(policy, _prompt(3), 50, [True] * 3) == 2
    assert _send(policy, _prompt(4), 1, [True] * 3) == 1  # 10 outstanding, the fewest
    assert [record.load.outstanding_tokens for record in records] == [100, 11, 50]
    policy.check_invariants()


def test_a_shared_first_block_follows_its_engine() -> None:
    policy, _ = _policy(2)
    assert _send(policy, _prompt(7, rest=1), 30, [True, True]) == 0
    assert _send(policy, _prompt(8), 5, [True, True]) == 1
    # engine 0 carries more, but the prompt's first block is cached there
    assert _send(policy, _prompt(7, rest=2), 30, [True, True]) == 0
    assert policy.engine_of_prefix(_prompt(7, rest=3)) == 0
    policy.check_invariants()


def test_affinity_yields_past_the_imbalance_cap() -> None:
    policy, _ = _policy(2, max_imbalance_tokens=50)
    assert _send(policy, _prompt(7), 40, [True, True]) == 0
    assert _send(policy, _prompt(7), 40, [True, True]) == 0  # 40 over engine 1: within the cap
    assert _send(policy, _prompt(7), 40, [True, True]) == 1  # 80 over: the least loaded takes it
    assert policy.engine_of_prefix(_prompt(7)) == 1  # and becomes the prefix's engine
    policy.check_invariants()


def test_prompts_shorter_than_a_block_have_no_affinity() -> None:
    policy, _ = _policy(2)
    assert prefix_key([1, 2, 3], BLOCK_SIZE) is None
    assert _send(policy, [1, 2, 3], 10, [True, True]) == 0
    assert _send(policy, [1, 2, 3], 10, [True, True]) == 1
    assert policy.engine_of_prefix([1, 2, 3]) is None


def test_unavailable_engines_are_skipped_and_none_left_is_an_error() -> None:
    policy, _ = _policy(2)
    assert _send(policy, _prompt(7), 10, [True, True]) == 0
    assert _send(policy, _prompt(7), 10, [False, True]) == 1  # its engine is down
    with pytest.raises(LookupError, match="no engine available among 2"):
        policy.choose(_prompt(7), [False, False])


def test_outstanding_tokens_are_the_records_count_of_every_request() -> None:
    """The policy keeps no count of its own: work sent to an engine by any path (a choice of
    `n` following its group, a decode engine chosen by load) weighs in its next choice."""
    policy, records = _policy(2)
    records[0].load.add(4, 4, 30)  # sent without the policy's choice
    assert _send(policy, _prompt(1), 10, [True, True]) == 1
    records[0].load.remove(4, 4, 30, is_decoding=False)
    assert _send(policy, _prompt(2), 10, [True, True]) == 0


def test_affinity_entries_are_bounded_least_recent_first() -> None:
    policy, _ = _policy(2, max_entries=2)
    for first_block in (1, 2, 3):
        policy.choose(_prompt(first_block), [True, True])
    assert policy.engine_of_prefix(_prompt(1)) is None
    assert policy.engine_of_prefix(_prompt(3)) is not None
    policy.check_invariants()


def test_a_policy_over_no_engines_is_refused() -> None:
    with pytest.raises(ValueError, match="first-block policy over 0 engines"):
        FirstBlockAffinity([], BLOCK_SIZE)
