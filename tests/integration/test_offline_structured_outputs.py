"""Structured outputs through the offline API, as vLLM spells them
(`SamplingParams(structured_outputs=StructuredOutputsParams(...))`), on the built-in tiny-llama:
its grammars compile against the shipped byte-level tokenizer, which the LLM hands the engine.
A bad constraint is a ValueError before anything is submitted, and the engine serves on.
"""

import json
import multiprocessing.resource_tracker
import re

import pytest

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from tests.integration.conftest import live_children

pytestmark = pytest.mark.integration

STARTUP_TIMEOUT_S = 180.0
SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 5}, "n": {"enum": [1, 2, 3]}},
    "required": ["word", "n"],
    "additionalProperties": False,
}


@pytest.mark.timeout(300)
def test_generate_follows_json_regex_and_choice_and_refuses_a_bad_one() -> None:
    multiprocessing.resource_tracker.ensure_running()  # it outlives the test: not a leftover
    earlier = set(live_children())
    with LLM(
        "tiny-llama",
        device="cpu",
        kv_cache_memory_bytes=16_000_000,
        max_model_len=512,
        start_timeout_s=STARTUP_TIMEOUT_S,
    ) as llm:
        params = [
            SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
            SamplingParams(
                max_tokens=20,
                temperature=0.9,
                seed=3,
                structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2}[0-9]"),
            ),
            SamplingParams(
                max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
            ),
        ]
        outputs = llm.generate(["Tell me", "Code:", "Well?"], params, use_tqdm=False)
        with pytest.raises(ValueError, match="structured_outputs: does not compile"):
            llm.generate(
                "x",
                SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= x")),
                use_tqdm=False,
            )
        (after,) = llm.generate("x", SamplingParams(max_tokens=4), use_tqdm=False)
    texts = [output.outputs[0].text for output in outputs]
    assert [output.outputs[0].finish_reason for output in outputs] == ["stop"] * 3, texts
    value = json.loads(texts[0])
    assert set(value) == {"word", "n"} and len(value["word"]) <= 5 and value["n"] in (1, 2, 3)
    assert re.fullmatch(r"[a-c]{2}[0-9]", texts[1]), texts[1]
    assert texts[2] in ("yes", "no")
    assert len(after.outputs[0].token_ids) == 4
    assert not set(live_children()) - earlier, "child processes left alive"
