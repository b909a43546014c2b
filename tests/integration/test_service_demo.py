"""`kvserve demo`, the installed console script, runs to completion: TP=2 tiny-llama on the CPU,
every output checked against the reference model."""

import re

import pytest

from tests.integration.conftest import Processes

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_demo_serves_the_workload_and_matches_the_reference(processes: Processes) -> None:
    processes.start_script("demo", "kvserve", ["demo"])  # README's command, as installed
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
