"""n, logit_bias, allowed_token_ids, bad words and --generation-config defaults as the front end
turns them into engine requests, without a server."""

import json
import logging
from pathlib import Path

import pytest

from api_server.openai.engine_requests import chat_jobs, completion_jobs, engine_refusal
from api_server.openai.errors import ApiError
from api_server.openai.generation_config import (
    NO_DEFAULTS,
    GenerationDefaults,
    load_generation_defaults,
    log_generation_defaults,
)
from api_server.openai.logprobs import ChoiceLogprobs, prompt_logprobs_json
from api_server.openai.parallel_sampling import choice_seed
from api_server.openai.protocol import CHAT_DECODER, COMPLETION_DECODER, parse_body
from api_server.routing.engine_record import engine_records
from api_server.routing.router import Router, RoutingPolicy
from api_server.tokenizer.prompt_tokenizer import ByteTokenizer
from protocol.client_messages import TokenLogprobs
from protocol.sampling import SEED_LIMIT

TOKENIZER = ByteTokenizer()
MAX_MODEL_LEN = 64
VOCAB_SIZE = 300
MESSAGES = [{"role": "user", "content": "hi"}]


def _jobs(body: dict, defaults: GenerationDefaults = NO_DEFAULTS) -> list:
    raw = json.dumps(body).encode()
    if "messages" in body:
        parsed = parse_body(raw, CHAT_DECODER)
        return chat_jobs(
            parsed,  # type: ignore[arg-type]
            TOKENIZER,
            "c",
            MAX_MODEL_LEN,
            vocab_size=VOCAB_SIZE,
            defaults=defaults,
        )  # type: ignore[arg-type]
    parsed = parse_body(raw, COMPLETION_DECODER)
    return completion_jobs(parsed, TOKENIZER, "c", MAX_MODEL_LEN, VOCAB_SIZE, defaults)  # type: ignore[arg-type]


def _refusal(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        _jobs(body)
    return info.value


@pytest.mark.parametrize("base", [{"prompt": "ab"}, {"messages": MESSAGES}])
def test_n_gives_n_choices_of_one_prompt_with_distinct_repeatable_seeds(base: dict) -> None:
    jobs = _jobs({**base, "n": 4, "seed": 7})
    assert [job.index for job in jobs] == [0, 1, 2, 3]
    assert len({job.request.req_id for job in jobs}) == 4
    assert len({bytes(job.request.prompt_token_ids) for job in jobs}) == 1
    seeds = [job.request.sampling_params.seed for job in jobs]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert seeds == [job.request.sampling_params.seed for job in _jobs({**base, "n": 4, "seed": 7})]


def test_unseeded_choices_stay_unseeded() -> None:
    """Each engine request then draws from its own stream (seeded by its handle)."""
    jobs = _jobs({"prompt": "ab", "n": 3, "temperature": 1.0})
    assert [job.request.sampling_params.seed for job in jobs] == [None] * 3


def test_a_batch_of_prompts_numbers_choices_prompt_by_prompt() -> None:
    jobs = _jobs({"prompt": ["a", "b"], "n": 2})
    assert [job.index for job in jobs] == [0, 1, 2, 3]
    prompts = [TOKENIZER.decode(job.prompt_token_ids) for job in jobs]
    assert prompts == ["a", "a", "b", "b"]


def test_choice_seeds_stay_in_the_seed_range() -> None:
    for index in range(50):
        seed = choice_seed(SEED_LIMIT, index)
        assert seed is not None and 0 <= seed <= SEED_LIMIT
    assert choice_seed(None, 3) is None


def test_logit_bias_keys_become_ids_and_allowed_ids_pass_through() -> None:
    (job,) = _jobs({"prompt": "ab", "logit_bias": {"65": 5, "66": -100}, "allowed_token_ids": [65]})
    params = job.request.sampling_params
    assert params.logit_bias == {65: 5.0, 66: -100.0}
    assert params.allowed_token_ids == [65]


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias", [f"token id {VOCAB_SIZE}"]),
        ({"logit_bias": {"-1": 1}}, "logit_bias", ["token id -1"]),
        ({"logit_bias": {"1": -101}}, "logit_bias", ["-101"]),
        ({"allowed_token_ids": [1, VOCAB_SIZE + 5]}, "allowed_token_ids", ["305"]),
        ({"n": 10000}, "n", ["n=10000", "expected 1 to 128"]),
        ({"n": 2, "best_of": 3}, "best_of", ["best_of=3"]),
        ({"prompt_logprobs": 21}, "prompt_logprobs", ["21", "<= 20"]),
    ],
)
def test_ids_past_the_vocabulary_and_bad_bounds_are_a_400_naming_the_field(
    extra: dict, param: str, words: list[str]
) -> None:
    for base in ({"prompt": "x"}, {"messages": MESSAGES}):
        error = _refusal({**base, **extra})
        assert (error.status, error.param) == (400, param), error.message
        assert all(word in error.message for word in words), error.message


def test_bad_words_are_tokenized_as_given_and_after_a_space() -> None:
    (job,) = _jobs({"prompt": "ab", "bad_words": ["no", " no", "x"]})
    words = job.request.sampling_params.bad_words_token_ids
    assert words == [
        TOKENIZER.encode("no", False),
        TOKENIZER.encode(" no", False),
        TOKENIZER.encode("x", False),
        TOKENIZER.encode(" x", False),
    ]


def test_generation_defaults_fill_only_the_fields_a_request_leaves_unset() -> None:
    defaults = GenerationDefaults(
        temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=5
    )
    (plain,) = _jobs({"prompt": "ab"}, defaults)
    params = plain.request.sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.9, 20, 0.05)
    assert (params.repetition_penalty, params.max_tokens) == (1.1, 5)
    (chat,) = _jobs({"messages": MESSAGES}, defaults)
    assert chat.request.sampling_params.max_tokens == 5  # a chat's default is the room left
    own = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 9}
    (given,) = _jobs({"prompt": "ab", **own}, defaults)
    params = given.request.sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (
        0.0,
        1.0,
        None,
        9,
    )


def _checkpoint(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_generation_config_auto_reads_the_checkpoint_and_vllm_ignores_it(tmp_path: Path) -> None:
    folder = _checkpoint(
        tmp_path, {"temperature": 0.7, "top_k": 20, "max_new_tokens": 64, "do_sample": True}
    )
    defaults = load_generation_defaults("auto", str(folder))
    assert defaults.applied() == {"temperature": 0.7, "top_k": 20, "max_tokens": 64}
    assert load_generation_defaults("vllm", str(folder)) == NO_DEFAULTS
    assert load_generation_defaults("auto", "tiny-llama") == NO_DEFAULTS  # no file: none
    other = tmp_path / "other"
    other.mkdir()
    _checkpoint(other, {"top_p": 0.8})
    assert load_generation_defaults(str(other), "tiny-llama").applied() == {"top_p": 0.8}


def test_generation_config_refuses_a_missing_folder_or_a_bad_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected 'auto', 'vllm' or a folder"):
        load_generation_defaults(str(tmp_path / "missing"), "tiny-llama")
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        load_generation_defaults(str(tmp_path), "tiny-llama")
    _checkpoint(tmp_path, {"temperature": "hot"})
    with pytest.raises(ValueError, match="temperature='hot': expected a number"):
        load_generation_defaults("auto", str(tmp_path))


def test_generation_defaults_are_logged_once_with_their_values(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="api_server.openai.generation_config"):
        log_generation_defaults(GenerationDefaults(temperature=0.6), "auto")
        log_generation_defaults(NO_DEFAULTS, "vllm")
    assert len(caplog.records) == 1
    assert "'temperature': 0.6" in caplog.records[0].getMessage()


def test_prompt_logprobs_take_vllms_shape() -> None:
    """None for the first token; the prompt token keyed by its id with its rank, beside the top
    N ranked 1..N, once each when it is among them."""
    entries = TokenLogprobs(
        token_ids=[[66, 65, 67], [67, 67, 66]],
        logprobs=[[-3.0, -0.5, -1.0], [-0.25, -0.25, -2.0]],
        sampled_token_ranks=[3, 1],
    )
    shaped = prompt_logprobs_json(TOKENIZER, entries)
    assert shaped == [
        None,
        {
            "66": {"logprob": -3.0, "rank": 3, "decoded_token": "B"},
            "65": {"logprob": -0.5, "rank": 1, "decoded_token": "A"},
            "67": {"logprob": -1.0, "rank": 2, "decoded_token": "C"},
        },
        {
            "67": {"logprob": -0.25, "rank": 1, "decoded_token": "C"},
            "66": {"logprob": -2.0, "rank": 2, "decoded_token": "B"},
        },
    ]


def test_prompt_logprobs_reach_the_engine_and_refuse_streaming() -> None:
    (job,) = _jobs({"prompt": "ab", "prompt_logprobs": 2})
    assert job.request.sampling_params.prompt_logprobs == 2 and job.has_prompt_logprobs
    error = _refusal({"messages": MESSAGES, "prompt_logprobs": 1, "stream": True})
    assert (error.status, error.param) == (400, "prompt_logprobs")


def test_a_prompts_choices_share_one_group_and_follow_its_engine() -> None:
    """Under round-robin the choices would spread over the engines; following the first keeps
    them on its engine, where its prompt blocks are cached, with their load counted there."""
    jobs = _jobs({"prompt": ["a", "b"], "n": 2})
    groups = [job.group for job in jobs]
    assert groups[0] is groups[1] and groups[2] is groups[3] and groups[0] is not groups[2]
    assert _jobs({"prompt": "a"})[0].group is None
    router = Router(engine_records(["a", "b", "c"]), 16, RoutingPolicy.ROUND_ROBIN)
    prompt = list(range(20))
    first = router.choose(prompt, 30, None, [True] * 3, None, [False] * 3)
    followers = [router.follow(first.engine_idx, prompt, 30) for _ in range(3)]
    assert {decision.engine_idx for decision in followers} == {first.engine_idx}
    assert router.records[first.engine_idx].num_decisions == 4
    assert router.records[first.engine_idx].load.outstanding_tokens == 4 * 30
    for decision in [first, *followers]:
        router.release(decision, is_decoding=False)
    router.check_invariants()
    assert [record.load.outstanding_tokens for record in router.records] == [0, 0, 0]


def test_an_engines_refusal_of_a_token_id_names_the_field() -> None:
    """Before any engine reported its vocabulary the front end cannot check: the engine does."""
    error = engine_refusal(
        "logit_bias token id 9999 of 'c-0' is out of the vocabulary: expected 0 <= id < 512"
    )
    assert (error.status, error.param) == (400, "logit_bias")
    assert engine_refusal("token id 600 in the prompt of 'c-0' is out of the vocabulary").param == (
        "prompt"
    )


def test_echoed_prompt_logprobs_lead_the_outputs() -> None:
    """vLLM's echo with logprobs: the first prompt token has none, offsets run on through the
    output's tokens."""
    shaper = ChoiceLogprobs(TOKENIZER, is_chat=False, num_top=1)
    shaper.push(TokenLogprobs([[90, 91]], [[-0.5, -1.5]], [1]))
    prompt = TokenLogprobs([[66, 65], [67, 67]], [[-2.0, -0.25], [-0.1, -0.1]], [2, 1])
    assert shaper.whole_after_prompt([65, 66, 67], prompt) == {
        "tokens": ["A", "B", "C", "Z"],
        "token_logprobs": [None, -2.0, -0.1, -0.5],
        "top_logprobs": [None, {"B": -2.0, "A": -0.25}, {"C": -0.1}, {"Z": -0.5, "[": -1.5}],
        "text_offset": [0, 1, 2, 3],
    }
    with pytest.raises(ValueError, match="expected one fewer"):
        shaper.whole_after_prompt([65, 66], prompt)
