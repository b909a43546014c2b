"""`kvserve demo` runs to completion: TP=2 tiny-llama on the CPU, every output checked."""

import re

import pytest

from tests.integration.conftest import Processes

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_demo_serves_the_workload_and_matches_the_reference(processes: Processes) -> None:
    processes.start("demo", "kvserve_main", ["demo"])
    code = processes.wait_exit("demo", 170)
    log = processes.log("demo")
    assert code == 0, log[-3000:]
    assert re.search(r"all \d+ outputs match the reference model", log), log[-3000:]
    for metric in (
        "requests",
        "output tokens / s",
        "TTFT p50",
        "TTFT p99",
        "prefix-cache hit rate",
        "preemptions",
        "peak KV usage",
    ):
        assert metric in log, f"the results table lacks {metric!r}"
