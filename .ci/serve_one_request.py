"""CI's proof of the run-time install: `kvserve serve --model DIR` from a venv that holds only
`pip install .` starts, answers one chat completion, and stops with exit code 0 on SIGTERM.

Standard library only, since the venv it runs in has no test extra. Every wait has a deadline;
the server's process group is killed if anything fails.
Run: `python .ci/serve_one_request.py KVSERVE_SCRIPT MODEL_DIR`.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

STARTUP_TIMEOUT_S = 300.0  # the engine, its rank, the checkpoint and the KV budget
REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
POLL_S = 0.5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with {server.returncode} during startup")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"kvserve serve not healthy at {url} in {STARTUP_TIMEOUT_S} s")


def chat(url: str) -> dict:
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


def main() -> int:
    kvserve, model = sys.argv[1], sys.argv[2]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    folder = tempfile.mkdtemp(prefix="kvserve-ci-")
    command = [kvserve, "serve", "--model", model, "--port", str(port)]
    command += ["--client-address", f"ipc://{folder}/client.sock"]
    command += ["--worker-address", f"ipc://{folder}/worker.sock"]
    # its own folder as cwd: the packages must come from the install, not from a checkout
    server = subprocess.Popen(command, cwd=folder, start_new_session=True)
    try:
        wait_healthy(url, server)
        answer = chat(url)
        choice = answer["choices"][0]
        usage = answer["usage"]
        if usage["completion_tokens"] < 1 or choice["finish_reason"] not in ("stop", "length"):
            raise RuntimeError(f"unexpected answer: {answer}")
        print(f"served one chat: {usage} -> {choice['message']['content']!r}")
        server.send_signal(signal.SIGTERM)
        code = server.wait(STOP_TIMEOUT_S)
        if code != 0:
            raise RuntimeError(f"kvserve serve exited with {code} after SIGTERM, expected 0")
        return 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(STOP_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(main())
