"""Shared test settings: Hypothesis profiles (CI runs the default, bounded one) and `--device`,
the torch device of the worker unit tests (cpu by default; bench/gpu_check.py passes cuda)."""

import os

import pytest
from hypothesis import HealthCheck, settings

TEST_DEVICE_ENV = "KVSERVE_TEST_DEVICE"  # how --device reaches the test modules as they import
TEST_DEVICES = ("cpu", "cuda")
TRITON_INTERPRET_ENV = "TRITON_INTERPRET"  # 1: @triton.jit kernels run interpreted, on CPU tensors

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=100
)
settings.register_profile("thorough", deadline=None, max_examples=1000)
settings.load_profile("default")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        choices=TEST_DEVICES,
        default="cpu",
        help="torch device of the worker unit tests (models, runner, KV cache); default cpu",
    )


def pytest_configure(config: pytest.Config) -> None:
    device = config.getoption("--device")
    if device == "cuda":
        import torch  # only here: most tests never load it

        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda: no CUDA device is visible to torch")
    # set before any test module is imported, so a module-level DEVICE sees it
    os.environ[TEST_DEVICE_ENV] = device
    if device == "cpu":
        # The Triton kernels' CPU tests run them under triton's interpreter, which every
        # @triton.jit of the session must agree on, triton.language's own included: those are
        # decorated when triton is first imported, and transformers imports it while the
        # checkpoint tests are collected, before any kernel test could set this.
        os.environ.setdefault(TRITON_INTERPRET_ENV, "1")


def worker_test_device() -> str:
    """The device the worker unit tests run on: "cpu", or "cuda" under `pytest --device cuda`."""
    return os.environ.get(TEST_DEVICE_ENV, "cpu")
