"""`kvserve serve` with a checkpoint's tokenizer (--tokenizer) in front of the fake tiny-llama it
launches, driven by the official openai client: a streamed chat whose prompt ids are those of
transformers' apply_chat_template, whose tokens are the reference model's, whose text is the
tokenizer's decode of them, and whose stop string ends it; /v1/models as vLLM lists it.
"""

from pathlib import Path

import openai
import pytest

from api_server.tokenizer.checkpoint_tokenizer import CheckpointTokenizer
from bench.make_checkpoint import CHATML_TEMPLATE, CheckpointSpec, build_tokenizer
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, free_tcp_ports, stop_process
from tests.integration.test_api_server import LAUNCH_FLAGS, MODEL, start_api
from worker.models.fake.reference import reference_generate

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

SERVED_NAMES = ("tiny-chat", "tiny-alias")
MESSAGES = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What is the capital of France? 🙂"},
]
MAX_TOKENS = 24


def _tokenizer_dir(folder: Path) -> Path:
    """The tokenizer files bench/make_checkpoint.py writes (its vocabulary fits tiny-llama's)."""
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(CheckpointSpec()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(folder)
    return folder


@pytest.mark.timeout(300)
def test_a_streamed_chat_through_a_checkpoint_tokenizer(
    processes: Processes, tmp_path: Path, addresses: dict
) -> None:
    folder = _tokenizer_dir(tmp_path / "tokenizer")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    rendered = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    prompt_ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    expected_ids = reference_generate(MODEL, prompt_ids, params)
    tokenizer = CheckpointTokenizer(folder)
    expected_text = tokenizer.decode(expected_ids)
    assert expected_text == hf.decode(expected_ids, skip_special_tokens=True)
    http_port, master_port = free_tcp_ports(2)
    url = start_api(
        processes,
        "api",
        [],
        http_port,
        "--tokenizer",
        str(folder),
        "--served-model-name",
        *SERVED_NAMES,
        "--client-address",
        addresses["client"],
        "--worker-address",
        addresses["worker"],
        "--master-port",
        str(master_port),
        "--device",
        "cpu",
        *LAUNCH_FLAGS,
    )
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    chunks = list(
        client.chat.completions.create(
            model=SERVED_NAMES[1],
            messages=MESSAGES,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
            **body,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected_text
    assert chunks[0].model == SERVED_NAMES[0]
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # A stop string from the middle of that text ends the chat just before it
    stop = expected_text[len(expected_text) // 2 :][:3]
    cut = expected_text.index(stop)
    stopped = client.chat.completions.create(
        model=SERVED_NAMES[0],
        messages=MESSAGES,
        stop=[stop],
        **body,  # type: ignore[arg-type]
    )
    assert stopped.choices[0].message.content == expected_text[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < MAX_TOKENS
    # Greedy logprobs: one entry per token, the sampled one the most likely of its alternatives
    scored = client.chat.completions.create(
        model=SERVED_NAMES[0],
        messages=MESSAGES,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
        **body,
    )
    entries = scored.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(entries) == MAX_TOKENS
    assert [entry.token for entry in entries] == tokenizer.token_texts(expected_ids)
    for entry in entries:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.logprob <= 0.0 and entry.top_logprobs[1].logprob <= entry.logprob
    models = client.models.list().data
    assert [m.id for m in models] == list(SERVED_NAMES)
    assert {(m.model_extra or {}).get("max_model_len") for m in models} == {2048}
    assert {(m.model_extra or {}).get("root") for m in models} == {MODEL}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, **body)  # type: ignore[arg-type]
    stop_process(processes, "api")
