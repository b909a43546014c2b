"""Fixtures shared by the unit tests: scheduler harnesses and the torch thread setting."""

import sys
from collections.abc import Iterator

import pytest
from fake_executor import Harness, MakeHarness

# triton has Linux wheels only, so the test extra installs it only there (pyproject.toml).
collect_ignore = (
    [] if sys.platform == "linux" else ["test_triton_attention.py", "test_fused_kernels.py"]
)


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


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """The models are tiny: intra-op threads would only contend for the shared cores."""
    import torch  # only the model tests need it

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
