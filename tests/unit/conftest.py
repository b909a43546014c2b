"""Fixtures shared by the unit tests of the scheduler and the engine core."""

from collections.abc import Iterator

import pytest
from fake_executor import Harness, MakeHarness


@pytest.fixture
def make_harness() -> Iterator[MakeHarness]:
    """Builds harnesses and checks each one for leaks once the test is done."""
    made: list[Harness] = []

    def make(**kwargs: object) -> Harness:
        harness = Harness(**kwargs)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.check_no_leaks()
