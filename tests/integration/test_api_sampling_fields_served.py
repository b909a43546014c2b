"""n, logit_bias, allowed_token_ids, bad_words and --generation-config through the official openai
client against `kvserve serve` in front of a launched tiny-llama: n seeded choices repeat and
share the prompt's computed blocks, and each logit rule gives the reference model's tokens under
that rule, streamed and not.
"""

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from api_server.tokenizer.prompt_tokenizer import ByteTokenizer
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, free_tcp_ports, launch, stop_launch, stop_process
from tests.integration.test_api_server import LAUNCH_FLAGS, MODEL, start_api
from tests.integration.test_kv_routing import launch_engine
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

BLOCK_SIZE = 16  # the launch's default
PROMPT = "Sampling fields through the OpenAI client, one prefill for all."  # 64 bytes
TOKENIZER = ByteTokenizer()
GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": 7}


@pytest.fixture(scope="module")
def served(
    module_processes: Processes, module_addresses: dict, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One engine and a front end whose --generation-config folder sets greedy, 7 tokens."""
    folder = tmp_path_factory.mktemp("generation")
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    processes, addresses = module_processes, module_addresses
    launch(processes, addresses, 1, MODEL, *LAUNCH_FLAGS)
    (port,) = free_tcp_ports(1)
    url = start_api(
        processes, "api", [addresses["client"]], port, "--generation-config", str(folder)
    )
    yield url
    stop_process(processes, "api")
    stop_launch(processes)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _reference(prompt: str, **params: object) -> str:
    token_ids = reference_generate(MODEL, TOKENIZER.encode(prompt), SamplingParams(**params))  # type: ignore[arg-type]
    return TOKENIZER.decode(token_ids)


@pytest.mark.timeout(240)
def test_n_seeded_choices_repeat_and_compute_the_prompt_once(served: str) -> None:
    client = _client(served)
    body = {"n": 4, "seed": 1234, "temperature": 1.0, "max_tokens": 12}
    body["extra_body"] = {"ignore_eos": True}
    first = client.completions.create(model=MODEL, prompt=PROMPT, **body)  # type: ignore[arg-type]
    assert [choice.index for choice in first.choices] == [0, 1, 2, 3]
    texts = [choice.text for choice in first.choices]
    assert len(set(texts)) > 1  # distinct seeds: the choices differ
    # the prompt's full blocks (3 of 16; the last holds the token each choice computes itself)
    # were computed once: the other 3 choices read them from the cache
    num_shared = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert first.usage.prompt_tokens == len(PROMPT)  # the prompt counts once
    assert first.usage.completion_tokens == 4 * 12
    assert first.usage.prompt_tokens_details.cached_tokens == 3 * num_shared
    again = client.completions.create(model=MODEL, prompt=PROMPT, **body)  # type: ignore[arg-type]
    assert [choice.text for choice in again.choices] == texts
    # choice 0 keeps the request's seed: it is the n=1 answer
    one = client.completions.create(model=MODEL, prompt=PROMPT, **{**body, "n": 1})  # type: ignore[arg-type]
    assert one.choices[0].text == texts[0]
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **body):  # type: ignore[arg-type]
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        **body,  # type: ignore[arg-type]
    )
    assert [choice.index for choice in chat.choices] == [0, 1, 2, 3]
    chat_streamed = ["", "", "", ""]
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        stream=True,
        **body,  # type: ignore[arg-type]
    ):
        for choice in chunk.choices:
            chat_streamed[choice.index] += choice.delta.content or ""
    assert chat_streamed == [choice.message.content for choice in chat.choices]


@pytest.mark.timeout(240)
def test_logit_rules_give_the_reference_tokens_under_them(served: str) -> None:
    client = _client(served)
    prompt = "Rules on the logits: "
    greedy = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    plain = _reference(prompt, **greedy)
    forced = TOKENIZER.encode("Z")[0]
    allowed = TOKENIZER.encode("ab")
    plain_ids = reference_generate(MODEL, TOKENIZER.encode(prompt), SamplingParams(**greedy))  # type: ignore[arg-type]
    banned = next(chr(i) for i in plain_ids if chr(i).isascii() and chr(i).isprintable())
    cases = [
        ({"logit_bias": {str(forced): 100}}, {"logit_bias": {forced: 100.0}}),
        ({"allowed_token_ids": allowed}, {"allowed_token_ids": allowed}),
        (
            {"bad_words": [banned]},
            {"bad_words_token_ids": [TOKENIZER.encode(banned), TOKENIZER.encode(" " + banned)]},
        ),
    ]
    for extra, params in cases:
        expected = _reference(prompt, **greedy, **params)
        assert expected != plain, extra  # the rule changes the output
        body = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True, **extra}}
        if "logit_bias" in extra:  # the openai client's own field
            body = {**body, "logit_bias": extra["logit_bias"]}
            body["extra_body"] = {"ignore_eos": True}
        whole = client.completions.create(model=MODEL, prompt=prompt, **body)  # type: ignore[arg-type]
        assert whole.choices[0].text == expected, extra
        chunks = client.completions.create(model=MODEL, prompt=prompt, stream=True, **body)  # type: ignore[arg-type]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected, extra
    assert _reference(prompt, **greedy, logit_bias={forced: 100.0}) == "Z" * 8
    assert set(_reference(prompt, **greedy, allowed_token_ids=allowed)) <= {"a", "b"}
    assert banned not in _reference(
        prompt, **greedy, bad_words_token_ids=[TOKENIZER.encode(banned)]
    )


@pytest.mark.timeout(240)
def test_generation_config_defaults_apply_where_the_request_is_silent(served: str) -> None:
    client = _client(served)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == GENERATION_CONFIG["max_new_tokens"]
    assert whole.choices[0].text == _reference(PROMPT, max_tokens=7, ignore_eos=True)


@pytest.mark.timeout(240)
def test_out_of_range_ids_and_n_are_a_400_naming_the_field(served: str) -> None:
    client = _client(served)
    for body, param in (
        ({"logit_bias": {"1000000": 5}}, "logit_bias"),
        ({"n": 10000}, "n"),
        ({"extra_body": {"allowed_token_ids": [512]}}, "allowed_token_ids"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, **body)  # type: ignore[arg-type]
        error = info.value.body
        assert isinstance(error, dict) and error.get("param") == param, error
    # the server keeps serving exact tokens beside them
    whole = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == _reference(PROMPT, max_tokens=7, ignore_eos=True)


@pytest.mark.timeout(240)
def test_prompt_logprobs_in_vllms_shape_on_completions_and_chat(served: str) -> None:
    """Every prompt token but the first has an entry holding itself and the top 2; greedy, the
    tokens the model itself would pick are those of rank 1; the prompt's blocks are computed
    rather than read from the cache, which the earlier requests filled."""
    client = _client(served)
    body = {"max_tokens": 3, "temperature": 0.0, "extra_body": {"prompt_logprobs": 2}}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, n=2, **body)  # type: ignore[arg-type]
    prompt_ids = TOKENIZER.encode(PROMPT)
    for choice in whole.choices:
        entries = (choice.model_extra or {})["prompt_logprobs"]
        assert len(entries) == len(prompt_ids) and entries[0] is None
        for token_id, entry in zip(prompt_ids[1:], entries[1:], strict=True):
            own = entry[str(token_id)]
            assert own["logprob"] <= 0.0 and own["rank"] >= 1
            assert own["decoded_token"] == TOKENIZER.decode([token_id])
            assert sorted(item["rank"] for item in entry.values())[:2] == [1, 2]
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    # the greedy continuation of the prompt's first k tokens is ranked first at token k
    entries = (whole.choices[0].model_extra or {})["prompt_logprobs"]
    for k in (5, 20, 40):
        (next_id,) = reference_generate(MODEL, prompt_ids[:k], SamplingParams(max_tokens=1))
        best = min(entries[k].items(), key=lambda item: item[1]["rank"])
        assert best == (str(next_id), {**best[1], "rank": 1})
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        **body,  # type: ignore[arg-type]
    )
    chat_entries = (chat.model_extra or {})["prompt_logprobs"]
    assert chat_entries[0] is None and len(chat_entries) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **body)  # type: ignore[arg-type]
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "prompt_logprobs"
    # echo with logprobs: the prompt's tokens lead, the first without a logprob
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3, temperature=0.0
    )
    scored = echoed.choices[0].logprobs
    assert scored is not None and echoed.choices[0].text.startswith(PROMPT)
    assert len(scored.tokens) == len(prompt_ids) + 3  # type: ignore[arg-type]
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None  # type: ignore[index]
    assert "".join(scored.tokens[: len(prompt_ids)]) == PROMPT  # type: ignore[index]
    own = entries[1][str(prompt_ids[1])]["logprob"]
    assert scored.token_logprobs[1] == pytest.approx(own)  # type: ignore[index]


@pytest.mark.timeout(300)
def test_n_choices_stay_on_one_engine_under_round_robin(
    processes: Processes, ipc_folder: Path
) -> None:
    """Round-robin would spread the choices over both engines; they follow the first choice to
    its engine instead, so the prompt's full blocks are still computed once."""
    engines = [launch_engine(processes, ipc_folder, name, model=MODEL) for name in ("a", "b")]
    (port,) = free_tcp_ports(1)
    url = start_api(processes, "api", engines, port, "--router-policy", "round-robin")
    client = _client(url)
    body = {
        "n": 4,
        "seed": 3,
        "temperature": 1.0,
        "max_tokens": 4,
        "extra_body": {"ignore_eos": True},
    }
    reply = client.completions.create(model=MODEL, prompt=PROMPT, **body)  # type: ignore[arg-type]
    num_shared = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert reply.usage.prompt_tokens_details.cached_tokens == 3 * num_shared
    decisions = httpx.get(f"{url}/router", timeout=10).json()["engines"]
    assert sorted(engine["decisions"] for engine in decisions) == [0, 4]
    stop_process(processes, "api")
    for name in ("a", "b"):
        stop_process(processes, f"launch-{name}", timeout_s=60)
