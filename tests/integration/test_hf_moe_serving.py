"""`kvserve serve --model DIR` over random-weight mixture-of-experts checkpoints (Qwen3-MoE: 8
experts, top-2, a dense first layer; Mixtral: 4 experts), at TP=1 and TP=2, through the openai
client: concurrent chats and completions whose greedy text equals transformers' in float32,
with prefix caching, chunked prefill and a pool small enough to preempt, all on.
"""

import dataclasses
import re
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from bench.make_checkpoint import SHAPES, CheckpointSpec, make_checkpoint
from tests.integration.conftest import (
    Processes,
    checked_processes,
    free_tcp_ports,
    stop_process,
    wait_http_healthy,
)
from tests.integration.test_hf_serving import greedy_reply

pytestmark = pytest.mark.integration

STARTUP_TIMEOUT_S = 180.0
HTTP_TIMEOUT_S = 120.0
MAX_TOKENS = 16
SPECS = {
    "qwen3-moe": CheckpointSpec(arch="qwen3-moe", shape=SHAPES["tiny-moe"]),  # mlp_only [0]
    "mixtral": CheckpointSpec(  # seed 0's greedy replies pass a near tie
        arch="mixtral", shape=dataclasses.replace(SHAPES["tiny-moe"], num_experts=4), seed=1
    ),
}
SYSTEM = {"role": "system", "content": "You answer in one sentence."}
CHATS = [  # one system prompt, so the later chats hit the first one's cached blocks
    [SYSTEM, {"role": "user", "content": question}]
    for question in (
        "What is the capital of France?",
        "Which block does the scheduler evict?",
        "Who reads the cache again?",
    )
]
PROMPTS = ["The engine reads the block and", "Every rank shares a prefix"]
# blocks of 4 tokens: five ~50-token requests at once need about 70, so requests preempt
SERVE_FLAGS = ["--block-size", "4", "--num-gpu-blocks-override", "32", "--max-model-len", "96"]
SERVE_FLAGS += ["--max-num-batched-tokens", "16"]  # chunked prefill: prompts take 2 to 3 steps
MAX_BATCHES = 3  # the concurrent batch is sent at most this often until a request is preempted


@dataclasses.dataclass
class Reference:
    folder: Path
    chats: list[str]  # transformers' greedy reply to each of CHATS
    completions: list[str]  # and continuation of each of PROMPTS


def greedy_text(model, tokenizer, prompt_ids: list[int]) -> str:  # transformers' objects
    return greedy_reply(model, tokenizer, prompt_ids, MAX_TOKENS)


@pytest.fixture(scope="module", params=list(SPECS))
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    import transformers

    folder = make_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    chats = [
        greedy_text(
            model,
            tokenizer,
            tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=True, return_dict=False
            ),
        )
        for chat in CHATS
    ]
    completions = [greedy_text(model, tokenizer, tokenizer(p)["input_ids"]) for p in PROMPTS]
    return Reference(folder, chats, completions)


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def served(
    request: pytest.FixtureRequest, tmp_path: Path, reference: Reference
) -> Iterator[tuple[openai.OpenAI, str]]:
    with checked_processes(tmp_path) as processes:
        url = serve(processes, tmp_path, reference.folder, request.param)
        yield (
            openai.OpenAI(
                base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S
            ),
            url,
        )
        stop_process(processes, "serve", timeout_s=60)


def serve(processes: Processes, tmp_path: Path, checkpoint: Path, tp_size: int) -> str:
    port, master_port = free_tcp_ports(2)
    args = ["serve", "--model", str(checkpoint), "-tp", str(tp_size), "--device", "cpu"]
    args += ["--port", str(port), "--master-port", str(master_port), *SERVE_FLAGS]
    args += ["--client-address", f"ipc://{tmp_path}/client.sock"]
    args += ["--worker-address", f"ipc://{tmp_path}/worker.sock"]
    processes.start("serve", "kvserve_main", args)
    url = f"http://127.0.0.1:{port}"
    wait_http_healthy(processes, "serve", url, STARTUP_TIMEOUT_S)
    return url


def counter(url: str, name: str) -> float:
    """The sum over engines of the Prometheus counter `name` at /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=HTTP_TIMEOUT_S) as reply:
        text = reply.read().decode()
    values = re.findall(rf"^{re.escape(name)}_total\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert values, f"{name} is not in /metrics"
    return sum(float(value) for value in values)


@pytest.mark.timeout(600)
def test_moe_chat_and_completion_text_equal_transformers_greedy(
    served: tuple[openai.OpenAI, str], reference: Reference
) -> None:
    client, url = served
    (model,) = [card.id for card in client.models.list().data]
    greedy = dict(model=model, max_tokens=MAX_TOKENS, temperature=0)

    def chat(messages: list[dict]) -> str:
        reply = client.chat.completions.create(messages=messages, **greedy)
        return reply.choices[0].message.content

    def complete(prompt: str) -> str:
        return client.completions.create(prompt=prompt, **greedy).choices[0].text

    # All at once, so that they preempt; on a loaded host the requests can arrive spread out
    # enough to run without it, so the batch is sent again (exact every time) until one did.
    for _ in range(MAX_BATCHES):
        with ThreadPoolExecutor(len(CHATS) + len(PROMPTS)) as pool:
            chats = [pool.submit(chat, messages) for messages in CHATS]
            completions = [pool.submit(complete, prompt) for prompt in PROMPTS]
            assert [future.result() for future in chats] == reference.chats
            assert [future.result() for future in completions] == reference.completions
        if counter(url, "vllm:num_preemptions") > 0:
            break
    assert counter(url, "vllm:num_preemptions") > 0, "the small pool should force preemption"
    assert counter(url, "vllm:prefix_cache_hits") > 0, "the shared system prompt should hit"
