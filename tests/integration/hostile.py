"""Helpers of the hostile-client tests: an engine and one worker as separate processes, a
well-behaved client that checks its tokens against the reference, raw sockets, engine memory.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import zmq

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.client_messages import EngineCoreOutputs
from protocol.codec import engine_to_client_decoder
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, start_core, start_worker
from worker.models.fake.reference import reference_generate

MODEL = "checksum"  # cheap and exact
MAX_MODEL_LEN = 512
GOOD_PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def serve(processes: Processes, addresses: dict, *extra: str) -> int:
    """An engine and one worker as separate processes; the engine's pid (to read its memory)."""
    start_core(processes, addresses, 1, "--max-model-len", str(MAX_MODEL_LEN), *extra)
    start_worker(processes, addresses, 0, 1, MODEL)
    with EngineClient(addresses["client"], 60.0) as client:
        assert client.check_health() is True
    return processes.procs["core"].pid


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def assert_served_exactly(address: str, tag: str, num_requests: int = 3) -> None:
    """A well-behaved client's requests finish with exactly the reference tokens."""
    prompts = {f"{tag}-{i}": [3 + i, 17, 29, 31 + i] * 3 for i in range(num_requests)}
    with EngineClient(address, 60.0) as client:
        for req_id, prompt in prompts.items():
            client.add_request(make_request(req_id, prompt, GOOD_PARAMS))
        results = client.run_until_finished(list(prompts), 60)
    for req_id, prompt in prompts.items():
        assert results[req_id].error is None, f"{req_id}: {results[req_id].error}"
        assert results[req_id].token_ids == reference_generate(MODEL, prompt, GOOD_PARAMS)


@contextmanager
def good_client_alongside(address: str, tag: str) -> Iterator[None]:
    """Run a well-behaved client in a thread while the body misbehaves; re-raise its failure."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for round_idx in range(3):
                assert_served_exactly(address, f"{tag}-{round_idx}")
        except BaseException as exc:  # reported in the test's own thread
            errors.append(exc)

    thread = threading.Thread(target=work, name=f"good-{tag}")
    thread.start()
    yield
    thread.join(120)
    assert not thread.is_alive(), "the well-behaved client did not finish"
    if errors:
        raise errors[0]


def raw_dealer(ctx: zmq.Context, address: str, **options: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock


def replies(sock: zmq.Socket, timeout_s: float) -> list[EngineCoreOutputs]:
    """What the engine sent `sock` until it stays quiet for `timeout_s`."""
    decoder, received = engine_to_client_decoder(), []
    while sock.poll(int(timeout_s * 1000)):
        message = decoder.decode(sock.recv())
        if isinstance(message, EngineCoreOutputs) and message.outputs:
            received.append(message)
    return received


def stop(processes: Processes) -> None:
    processes.procs["core"].terminate()
    assert processes.wait_exit("core", 30) == 0, processes.log("core")[-3000:]
    assert processes.wait_exit("worker-0", 30) == 0, processes.log("worker-0")[-3000:]
