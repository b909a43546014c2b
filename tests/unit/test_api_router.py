"""PrefixAffinityRouter: least outstanding tokens, prefix affinity, and its imbalance cap."""

import pytest

from api_server.routing.first_block import PrefixAffinityRouter, prefix_key

BLOCK_SIZE = 4


def _prompt(first_block: int, rest: int = 0) -> list[int]:
    return [first_block] * BLOCK_SIZE + [rest] * BLOCK_SIZE


def test_new_prefixes_go_to_the_least_outstanding_engine() -> None:
    router = PrefixAffinityRouter(3, BLOCK_SIZE)
    assert router.choose(_prompt(1), 100, [True] * 3) == 0
    assert router.choose(_prompt(2), 10, [True] * 3) == 1
    assert router.choose(_prompt(3), 50, [True] * 3) == 2
    assert router.choose(_prompt(4), 1, [True] * 3) == 1  # 10 outstanding, the fewest
    assert router.outstanding_tokens == [100, 11, 50]
    router.check_invariants()


def test_a_shared_first_block_follows_its_engine() -> None:
    router = PrefixAffinityRouter(2, BLOCK_SIZE)
    assert router.choose(_prompt(7, rest=1), 30, [True, True]) == 0
    assert router.choose(_prompt(8), 5, [True, True]) == 1
    # engine 0 carries more, but the prompt's first block is cached there
    assert router.choose(_prompt(7, rest=2), 30, [True, True]) == 0
    assert router.engine_of_prefix(_prompt(7, rest=3)) == 0
    router.check_invariants()


def test_affinity_yields_past_the_imbalance_cap() -> None:
    router = PrefixAffinityRouter(2, BLOCK_SIZE, max_imbalance_tokens=50)
    assert router.choose(_prompt(7), 40, [True, True]) == 0
    assert router.choose(_prompt(7), 40, [True, True]) == 0  # 40 over engine 1: within the cap
    assert router.choose(_prompt(7), 40, [True, True]) == 1  # 80 over: the least loaded takes it
    assert router.engine_of_prefix(_prompt(7)) == 1  # and becomes the prefix's engine
    router.check_invariants()


def test_prompts_shorter_than_a_block_have_no_affinity() -> None:
    router = PrefixAffinityRouter(2, BLOCK_SIZE)
    assert prefix_key([1, 2, 3], BLOCK_SIZE) is None
    assert router.choose([1, 2, 3], 10, [True, True]) == 0
    assert router.choose([1, 2, 3], 10, [True, True]) == 1
    assert router.engine_of_prefix([1, 2, 3]) is None


def test_unavailable_engines_are_skipped_and_none_left_is_an_error() -> None:
    router = PrefixAffinityRouter(2, BLOCK_SIZE)
    assert router.choose(_prompt(7), 10, [True, True]) == 0
    assert router.choose(_prompt(7), 10, [False, True]) == 1  # its engine is down
    with pytest.raises(LookupError, match="no engine available among 2"):
        router.choose(_prompt(7), 10, [False, False])


def test_release_returns_the_tokens_and_refuses_more_than_outstanding() -> None:
    router = PrefixAffinityRouter(2, BLOCK_SIZE)
    engine_idx = router.choose(_prompt(1), 10, [True, True])
    router.release(engine_idx, 10)
    assert router.outstanding_tokens == [0, 0]
    with pytest.raises(ValueError, match="release of 1 tokens on engine 0: only 0 outstanding"):
        router.release(0, 1)


def test_affinity_entries_are_bounded_least_recent_first() -> None:
    router = PrefixAffinityRouter(2, BLOCK_SIZE, max_entries=2)
    for first_block in (1, 2, 3):
        engine_idx = router.choose(_prompt(first_block), 1, [True, True])
        router.release(engine_idx, 1)
    assert router.engine_of_prefix(_prompt(1)) is None
    assert router.engine_of_prefix(_prompt(3)) is not None
    router.check_invariants()
