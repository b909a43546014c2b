"""Structured outputs in the engine and on the rank: the grammar owner's bitmask, advance and
termination; the rank's bitmask application; and the engine's real Scheduler driving a real
ModelRunner (tiny-llama over the shipped byte tokenizer), where constrained requests follow their
grammar and end with "stop" while unconstrained ones beside them keep their exact tokens and, with
asynchronous scheduling, their one-step lookahead.
"""

import json
import re
import time
from collections import deque
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import torch
from in_process_engine import engine_config, model_runner

from api_server.tokenizer.build_tokenizer import TOKENIZER_DIR
from engine_core.core import EngineCore
from engine_core.executors import SerialPipeline
from engine_core.structured.manager import StructuredOutputManager, choice_grammar
from engine_core.structured.vocabulary import VocabType, _decoding_of, read_tokenizer_vocabulary
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams, StructuredOutputs
from protocol.worker_messages import GrammarBitmask
from worker.model_runner import ModelRunner
from worker.models.fake.reference import reference_generate
from worker.models.registry import get_model_info
from worker.sampling.grammar_bitmask import apply_grammar_bitmask

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
VOCAB_SIZE = 512  # tiny-llama's, past the byte tokenizer's 263 tokens
EOS_ID = 257  # <|eos|>
MAX_MODEL_LEN = 160


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    vocabulary = read_tokenizer_vocabulary(TOKENIZER_DIR)
    return StructuredOutputManager(vocabulary, VOCAB_SIZE, [EOS_ID])


def _allowed_ids(bitmask: GrammarBitmask, row: int, vocab_size: int) -> list[int]:
    words = np.frombuffer(bitmask.bitmask, dtype="<i4").reshape(-1, (vocab_size + 31) // 32)
    bits = np.unpackbits(words[row].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size]).tolist()


def test_byte_tokenizer_vocabulary_is_byte_level() -> None:
    vocabulary = read_tokenizer_vocabulary(TOKENIZER_DIR)
    assert vocabulary.vocab_type is VocabType.BYTE_LEVEL
    assert vocabulary.num_tokens == 263 and vocabulary.encoded_vocab[257] == "<|eos|>"


@pytest.mark.parametrize(
    ("decoder", "expected"),
    [
        ({"type": "ByteLevel"}, (VocabType.BYTE_LEVEL, False)),
        (  # a Llama-2 / sentencepiece decoder: byte fallback, "▁" for space, the prefix stripped
            {
                "type": "Sequence",
                "decoders": [
                    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                    {"type": "ByteFallback"},
                    {"type": "Fuse"},
                    {"type": "Strip", "content": " ", "start": 1, "stop": 0},
                ],
            },
            (VocabType.BYTE_FALLBACK, True),
        ),
        ({"type": "Metaspace", "prepend_scheme": "never"}, (VocabType.RAW, False)),
        (None, (VocabType.RAW, False)),
    ],
    ids=["byte-level", "byte-fallback", "metaspace", "none"],
)
def test_vocabulary_type_follows_the_decoder(decoder: dict | None, expected: tuple) -> None:
    assert _decoding_of(decoder) == expected


def test_bitmask_allows_what_the_regex_allows_and_ends_on_eos(
    manager: StructuredOutputManager,
) -> None:
    manager.add_request(1, StructuredOutputs(regex="a[bc]"))
    bitmask = manager.grammar_bitmask([1], [3])
    assert np.frombuffer(bitmask.req_idxs, dtype="<i4").tolist() == [3]
    assert _allowed_ids(bitmask, 0, VOCAB_SIZE) == [ord("a")]
    assert manager.accept_token(1, ord("a"))
    assert _allowed_ids(manager.grammar_bitmask([1], [0]), 0, VOCAB_SIZE) == [ord("b"), ord("c")]
    assert not manager.accept_token(1, ord("x")), "a token the grammar refuses"
    assert manager.accept_token(1, ord("c")) and not manager.is_terminated(1)
    # complete: only the stop token; ids past the tokenizer's (263..511) never
    assert _allowed_ids(manager.grammar_bitmask([1], [0]), 0, VOCAB_SIZE) == [EOS_ID]
    assert manager.accept_token(1, EOS_ID) and manager.is_terminated(1)
    assert not manager.accept_token(1, EOS_ID), "nothing follows the end"
    manager.remove_request(1)
    assert 1 not in manager.matchers


def test_choice_grammar_matches_each_choice_exactly(manager: StructuredOutputManager) -> None:
    assert choice_grammar(['say "hi"', "a\\b"]) == 'root ::= "say \\"hi\\"" | "a\\\\b"'
    assert choice_grammar(["\x01a\n"]) == 'root ::= "\\u0001a\\u000a"'
    with pytest.raises(ValueError, match="NUL"):
        choice_grammar(["a\x00"])
    manager.add_request(2, StructuredOutputs(choice=["yes", "no"]))
    assert _allowed_ids(manager.grammar_bitmask([2], [0]), 0, VOCAB_SIZE) == [ord("n"), ord("y")]
    manager.remove_request(2)


def test_bounded_json_strings_refuse_control_characters_and_surrogates(
    manager: StructuredOutputManager,
) -> None:
    """xgrammar alone lets a maxLength string hold raw U+0000-U+001F, which JSON forbids, and
    the bytes of a lone surrogate, which are no UTF-8 at all."""
    schema = {"type": "string", "maxLength": 4}
    manager.add_request(4, StructuredOutputs(json=json.dumps(schema)))
    assert manager.accept_token(4, ord('"'))
    allowed = _allowed_ids(manager.grammar_bitmask([4], [0]), 0, VOCAB_SIZE)
    assert ord("a") in allowed and ord('"') in allowed
    assert not set(range(32)) & set(allowed)
    assert manager.accept_token(4, 0xED), "the lead byte of U+D000..U+D7FF"
    assert 0x9F in _allowed_ids(manager.grammar_bitmask([4], [0]), 0, VOCAB_SIZE)
    assert not manager.accept_token(4, 0xA0), "U+D800..U+DFFF are surrogates, never characters"
    manager.remove_request(4)
    manager.add_request(4, StructuredOutputs(json='{"type": "string"}'))
    assert manager.accept_token(4, ord('"')) and manager.accept_token(4, 0xED)
    assert not manager.accept_token(4, 0xA0), "nor in an unbounded string"
    manager.remove_request(4)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (StructuredOutputs(json="{not json"), "json does not compile"),
        (StructuredOutputs(json='{"type": "object"' + ', "a": {"b": 1}' * 0 + "]"), "json"),
        (StructuredOutputs(regex="(unclosed"), "regex does not compile"),
        (StructuredOutputs(grammar="root ::= undefined_rule"), "grammar does not compile"),
        (
            StructuredOutputs(json='{"properties": {"a": ' * 10_000 + "{}" + "}}" * 10_000),
            "json does not compile",
        ),
        (  # a minute of xgrammar's time, were the depth not checked first
            StructuredOutputs(json='{"type": "array", "items": ' * 1_000 + "{}" + "}" * 1_000),
            "nested more than 64 levels deep",
        ),
    ],
    ids=["bad-json", "unbalanced", "bad-regex", "bad-grammar", "10000-levels", "1000-levels"],
)
def test_a_spec_that_cannot_compile_is_a_value_error_naming_its_kind(
    manager: StructuredOutputManager, spec: StructuredOutputs, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        manager.add_request(3, spec)
    assert 3 not in manager.matchers


def test_rank_masks_refused_ids_and_leaves_raw_logits() -> None:
    logits = torch.zeros(3, 70)
    words = np.zeros((1, 3), dtype=np.int32)
    words[0, 1] = 1 << 4  # only id 36
    bitmask = GrammarBitmask(pack_int32([5]), words.tobytes())
    masked = apply_grammar_bitmask(logits, bitmask, np.array([1, 5, 6]))
    assert torch.isinf(masked[1]).sum() == 69 and masked[1, 36] == 0
    assert not torch.isinf(masked[0]).any() and not torch.isinf(masked[2]).any()
    assert not torch.isinf(logits).any(), "the raw logits feed logprobs"
    assert apply_grammar_bitmask(logits, None, np.array([0])) is logits
    with pytest.raises(ValueError, match="not all sampled"):
        apply_grammar_bitmask(logits, bitmask, np.array([1, 4, 6]))
    narrow = GrammarBitmask(pack_int32([0]), np.full((1, 1), -1, dtype=np.int32).tobytes())
    masked = apply_grammar_bitmask(logits, narrow, np.array([0]))
    assert not torch.isinf(masked[0, :32]).any() and torch.isinf(masked[0, 32:]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rank_masks_cuda_logits_as_it_masks_cpu_ones() -> None:
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, size=(2, 5), dtype=np.int64).astype(np.int32)
    bitmask = GrammarBitmask(pack_int32([0, 2]), words.tobytes())
    logits = torch.randn(3, 150, dtype=torch.float32)
    expected = apply_grammar_bitmask(logits, bitmask, np.array([0, 1, 2]))
    on_device = apply_grammar_bitmask(logits.cuda().bfloat16(), bitmask, np.array([0, 1, 2]))
    assert torch.equal(torch.isinf(on_device.cpu()), torch.isinf(expected))


JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
    },
    "required": ["name", "kind", "tags"],
    "additionalProperties": False,
}
CONSTRAINED = [
    ("regex", StructuredOutputs(regex=r"[a-z]{2,5}-[0-9]{1,3}")),
    ("choice", StructuredOutputs(choice=["alpha", "beta", "gamma"])),
    ("json", StructuredOutputs(json=json.dumps(JSON_SCHEMA))),
]


def _engine(
    async_scheduling: bool, num_blocks: int = 40, block_size: int = 16
) -> tuple[EngineCore, int]:
    info = get_model_info("tiny-llama", block_size)
    kv_cache_config = KVCacheConfig(num_blocks, info.kv_cache_groups)
    runner = model_runner(
        "tiny-llama", kv_cache_config, CPU, info.max_model_len, eos_token_ids=info.eos_token_ids
    )
    config = engine_config(
        block_size,
        max_num_batched_tokens=64,
        max_model_len=MAX_MODEL_LEN,
        async_scheduling=async_scheduling,
    )
    config = msgspec.structs.replace(config, tokenizer=str(TOKENIZER_DIR))
    return EngineCore(config, kv_cache_config, info, runner), info.eos_token_ids[0]


def _check_text(kind: str, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", text), text
    elif kind == "choice":
        assert text in ("alpha", "beta", "gamma"), text
    else:
        value = json.loads(text)
        assert set(value) == {"name", "kind", "tags"} and value["kind"] in ("cat", "dog"), text
        assert len(value["name"]) <= 6 and len(value["tags"]) <= 2, text


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_constrained_requests_follow_their_grammar_beside_exact_free_ones(
    async_scheduling: bool,
) -> None:
    core, eos_id = _engine(async_scheduling, num_blocks=42, block_size=4)  # preempts
    free_params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = {f"free{idx}": [40 + idx, 71, 99, 12, 250] for idx in range(2)}
    params = dict.fromkeys(prompts, free_params)
    kinds: dict[str, str] = {}
    for idx, (kind, spec) in enumerate(CONSTRAINED * 2):
        req_id = f"{kind}{idx}"
        prompts[req_id] = [60 + idx, 33, 120]
        kinds[req_id] = kind
        params[req_id] = SamplingParams(  # greedy first, then sampled
            max_tokens=150, temperature=0.0 if idx < 3 else 1.0, seed=11, structured_outputs=spec
        )
    for req_id, prompt in prompts.items():
        request = EngineCoreRequest(req_id, pack_int32(prompt), params[req_id], 0.0)
        assert core.add_request(request) is None
    handles = {r.client_req_id: r.handle for r in core.scheduler.requests.values()}
    tokens: dict[str, list[int]] = {req_id: [] for req_id in prompts}
    finish: dict[str, str] = {}
    most_in_flight = 0
    for _ in range(2000):
        if not core.has_work():
            break
        for outputs in core.step().values():
            for output in outputs.outputs:
                tokens[output.req_id].extend(output.new_token_ids)
                if output.finish_reason is not None:
                    finish[output.req_id] = output.finish_reason.name
        most_in_flight = max(most_in_flight, core.scheduler.num_steps_in_flight)
    assert most_in_flight == 2 * async_scheduling, "free requests keep their lookahead"
    assert core.scheduler.num_preemptions > 0, "the pool should force a preemption"
    for req_id, prompt in prompts.items():
        if req_id not in kinds:
            expected = reference_generate(
                "tiny-llama",
                prompt,
                free_params,
                max_model_len=MAX_MODEL_LEN,
                handle=handles[req_id],
            )
            assert tokens[req_id] == expected, req_id
            continue
        assert finish[req_id] == "STOP", (req_id, finish[req_id], bytes(tokens[req_id]))
        assert tokens[req_id][-1] == eos_id
        text = bytes(tokens[req_id][:-1]).decode()
        _check_text(kinds[req_id], text)
    assert not core.scheduler.requests
    assert not core.scheduler.structured_output_manager.matchers


def _step_until_idle(core: EngineCore, limit_s: float = 30.0) -> list:
    """Every output of stepping `core` until it has no work, within `limit_s`."""
    import time

    deadline = time.monotonic() + limit_s
    outputs = []
    while core.has_work():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for batch in core.step().values():
            outputs.extend(batch.outputs)
    return outputs


def test_engine_rejects_a_grammar_that_does_not_compile_before_scheduling() -> None:
    core, _ = _engine(False)
    params = SamplingParams(structured_outputs=StructuredOutputs(regex="(unclosed"))
    assert core.add_request(EngineCoreRequest("bad", pack_int32([1, 2]), params, 0.0)) is None
    (output,) = _step_until_idle(core)  # it compiled off the step loop, and failed
    assert output.finish_reason.name == "ERROR" and "regex does not compile" in output.error
    assert not output.new_token_ids and core.scheduler.next_step_id == 1, "nothing was scheduled"
    assert not core.scheduler.requests and not core.has_work()


class _GatedCompile:
    """Holds every grammar compile until `gate` is set, as a schema that takes seconds would."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        import threading

        self.gate = threading.Event()
        self._compile = manager.compile
        manager.compile = self  # type: ignore[method-assign]

    def __call__(self, spec: StructuredOutputs) -> object:
        assert self.gate.wait(30.0), "the test never opened the gate"
        return self._compile(spec)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_compiling_grammar_never_stalls_the_requests_beside_it(async_scheduling: bool) -> None:
    """A grammar compiles off the step loop: while it does, an unconstrained request runs to
    its end with exact tokens; then the constrained one is queued and follows its grammar."""
    core, eos_id = _engine(async_scheduling)
    gated = _GatedCompile(core.scheduler.structured_output_manager)
    constrained = SamplingParams(max_tokens=40, structured_outputs=CONSTRAINED[0][1])
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    assert (
        core.add_request(EngineCoreRequest("regex", pack_int32([61, 33]), constrained, 0.0)) is None
    )
    assert core.add_request(EngineCoreRequest("free", pack_int32([40, 71, 99]), free, 0.0)) is None
    assert core.is_live(b"", "regex") and core.num_unfinished_requests == 2
    tokens: dict[str, list[int]] = {"regex": [], "free": []}
    handle = next(iter(core.scheduler.requests.values())).handle
    for _ in range(100):  # the free request's steps, and one telling the ranks it finished
        if core.is_only_waiting():
            break
        for batch in core.step().values():
            for output in batch.outputs:
                tokens[output.req_id].extend(output.new_token_ids)
    assert core.is_only_waiting() and core.has_work(), "only the compile is left"
    assert tokens["regex"] == [] and core.is_live(b"", "regex")
    expected = reference_generate(
        "tiny-llama", [40, 71, 99], free, max_model_len=MAX_MODEL_LEN, handle=handle
    )
    assert tokens["free"] == expected
    gated.gate.set()
    outputs = _step_until_idle(core)
    json_tokens = [token for output in outputs for token in output.new_token_ids]
    assert outputs[-1].finish_reason.name == "STOP" and json_tokens[-1] == eos_id
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", bytes(json_tokens[:-1]).decode())
    assert not core.scheduler.structured_output_manager.compiling


def test_a_request_aborted_or_failed_while_its_grammar_compiles_ends_at_once() -> None:
    core, _ = _engine(True)
    gated = _GatedCompile(core.scheduler.structured_output_manager)
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(choice=["ab"]))
    for req_id in ("a", "b"):
        request = EngineCoreRequest(req_id, pack_int32([5, 6]), params, 0.0)
        assert core.add_request(request) is None
    (aborted,) = core.abort_requests(["a"])[b""].outputs
    assert aborted.req_id == "a" and aborted.finish_reason.name == "ABORT"
    assert core.is_only_waiting() and not core.is_live(b"", "a")
    (failed,) = core.fail_all("the ranks died")[b""].outputs
    assert failed.req_id == "b" and failed.finish_reason.name == "ERROR"
    assert failed.error == "the ranks died"
    assert not core.has_work() and core.num_unfinished_requests == 0
    gated.gate.set()
    manager = core.scheduler.structured_output_manager
    assert not manager.compiling and not manager.matchers
    core.close()
    assert manager.fileno() == -1


def test_a_request_id_reused_after_an_abort_never_waits_on_its_new_compile() -> None:
    """An aborted compile's end and its id's next compile are two compiles: the engine hands
    over only the one that ended, and a step never waits on a compile still queued."""
    import threading

    core, _ = _engine(True)
    gated = _GatedCompile(core.scheduler.structured_output_manager)
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(choice=["ab"]))
    for req_id in ("slow", "b"):  # "slow" holds the compile thread, "b" queues behind it
        request = EngineCoreRequest(req_id, pack_int32([5, 6]), params, 0.0)
        assert core.add_request(request) is None
    core.abort_requests(["b"])  # its queued compile is cancelled, which ends it at once
    assert core.add_request(EngineCoreRequest("b", pack_int32([7, 8]), params, 0.0)) is None
    stepped = threading.Thread(target=core.step, daemon=True)
    stepped.start()
    stepped.join(5.0)
    is_stalled = stepped.is_alive()
    gated.gate.set()  # let a stalled step end before the test does
    stepped.join(30.0)
    assert not is_stalled, "the step waited for a grammar still queued behind another"
    assert core.is_live(b"", "b") and core.is_live(b"", "slow")
    outputs = _step_until_idle(core)
    assert sorted(o.req_id for o in outputs if o.finish_reason is not None) == ["b", "slow"]
    assert all(o.finish_reason.name == "STOP" for o in outputs if o.finish_reason is not None)
    core.close()


def test_requests_compiling_count_toward_their_clients_live_requests() -> None:
    """max_num_requests_per_client bounds a client's live requests, those whose grammars
    compile included: the one past it is refused when it comes, not after its compile."""
    core, _ = _engine(False)
    scheduler = core.scheduler
    scheduler.admission.max_num_requests_per_client = 2
    gated = _GatedCompile(scheduler.structured_output_manager)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(choice=["ab"]))
    for req_id in ("c0", "c1"):
        request = EngineCoreRequest(req_id, pack_int32([5, 6]), params, 0.0)
        assert core.add_request(request, b"client") is None
    refusal = core.add_request(EngineCoreRequest("c2", pack_int32([5, 6]), params, 0.0), b"client")
    assert refusal is not None, "a third live request of a client allowed two"
    (refused,) = refusal.outputs
    assert refused.req_id == "c2" and "client busy" in refused.error
    other = core.add_request(EngineCoreRequest("c0", pack_int32([5, 6]), params, 0.0), b"other")
    assert other is None, "another client's share is its own"
    gated.gate.set()
    outputs = _step_until_idle(core)
    finished = sorted(
        (o.req_id, o.finish_reason.name) for o in outputs if o.finish_reason is not None
    )
    assert finished == [("c0", "STOP"), ("c0", "STOP"), ("c1", "STOP")]
    core.close()


def test_an_id_whose_grammar_compiles_is_live_to_every_request_that_reuses_it() -> None:
    """A request reusing the id of one whose grammar compiles is a duplicate, constrained or
    not: it is refused, and the compiling one runs on, alone under its id."""
    core, _ = _engine(False)
    gated = _GatedCompile(core.scheduler.structured_output_manager)
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(choice=["ab"]))
    assert core.add_request(EngineCoreRequest("a", pack_int32([5, 6]), params, 0.0)) is None
    free = SamplingParams(max_tokens=3, ignore_eos=True)
    refusal = core.add_request(EngineCoreRequest("a", pack_int32([7, 8]), free, 0.0))
    assert refusal is not None, "a second live request under the id of a compiling one"
    assert "duplicate req_id" in refusal.outputs[0].error
    gated.gate.set()
    outputs = _step_until_idle(core)
    assert [(o.req_id, o.finish_reason.name) for o in outputs if o.finish_reason is not None] == [
        ("a", "STOP")
    ]
    assert bytes(token for o in outputs for token in o.new_token_ids)[:2] == b"ab"
    core.close()


def test_requests_whose_grammars_compile_count_as_waiting_in_stats_and_load() -> None:
    """A request whose grammar compiles waits to run, as vLLM counts it: the waiting count and
    the load a front end routes by hold it, from its arrival."""
    core, _ = _engine(True)
    gated = _GatedCompile(core.scheduler.structured_output_manager)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(choice=["ab"]))
    assert core.add_request(EngineCoreRequest("a", pack_int32([5, 6, 7]), params, 0.0)) is None
    stats = core.make_stats()
    assert (stats.num_waiting_reqs, stats.num_running_reqs) == (1, 0)
    assert core.get_stats()["num_waiting_reqs"] == 1
    assert core.make_load() == {"waiting_prefill_tokens": 3, "running_decodes": 0}
    gated.gate.set()
    _step_until_idle(core)
    assert core.make_stats().num_waiting_reqs == 0
    assert core.make_load() == {"waiting_prefill_tokens": 0, "running_decodes": 0}
    core.close()


class _BitmaskSendFails(SerialPipeline):
    """A pipeline whose `fail_at`-th following bitmask cannot be sent, as when a rank on the
    ring exits between two steps."""

    def __init__(self, executor: ModelRunner, fail_at: int) -> None:
        super().__init__(executor)
        self.fail_at = fail_at
        self.num_sent = 0

    def send_grammar_bitmask(self, step_id: int, grammar_bitmask: GrammarBitmask) -> None:
        self.num_sent += 1
        if self.num_sent == self.fail_at:
            raise RuntimeError("rank 1 exited")
        super().send_grammar_bitmask(step_id, grammar_bitmask)


def test_a_bitmask_that_cannot_be_sent_fails_the_next_step_after_the_applied_ones_outputs() -> None:
    """Sending a step's following bitmask fails as sending a step does: the step applied just
    before it has its outputs delivered, and the failure is raised by the next call."""
    info = get_model_info("tiny-llama", 16)
    kv_cache_config = KVCacheConfig(40, info.kv_cache_groups)
    runner = model_runner(
        "tiny-llama", kv_cache_config, CPU, info.max_model_len, eos_token_ids=info.eos_token_ids
    )
    config = engine_config(16, max_model_len=MAX_MODEL_LEN, async_scheduling=True)
    config = msgspec.structs.replace(config, tokenizer=str(TOKENIZER_DIR))
    pipeline = _BitmaskSendFails(runner, fail_at=2)
    core = EngineCore(config, kv_cache_config, info, pipeline)
    params = SamplingParams(
        max_tokens=40, structured_outputs=StructuredOutputs(choice=["alphabet soup"])
    )
    assert core.add_request(EngineCoreRequest("c", pack_int32([5, 6]), params, 0.0)) is None
    delivered: list[int] = []
    deadline = time.monotonic() + 30.0
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        while time.monotonic() < deadline:  # its grammar compiles first, off the step loop
            for batch in core.step().values():
                for output in batch.outputs:
                    delivered.extend(output.new_token_ids)
    assert pipeline.num_sent == 2
    (request,) = core.scheduler.requests.values()
    assert delivered == list(request.output_token_ids), "applied tokens never reached the client"
    assert bytes(delivered) == b"alphabet soup"[: len(delivered)] and delivered


class _CompileEndsWhileTaken(deque):
    """The manager's queue of ended compiles, where the compile thread finishes `on_first_pop`
    while `take_compiled` hands over the queue: the moment a stale wake byte could be left."""

    def __init__(self, on_first_pop: Callable[[], None]) -> None:
        super().__init__()
        self.on_first_pop: Callable[[], None] | None = on_first_pop

    def popleft(self) -> tuple:
        if (on_first_pop := self.on_first_pop) is not None:
            self.on_first_pop = None
            on_first_pop()
        return super().popleft()


def test_a_compile_that_ends_while_results_are_taken_leaves_no_stale_wake() -> None:
    """The wake pipe is readable while a compile has ended and not been taken, and not after:
    a byte left behind would wake the server's poll at once for as long as it idles."""
    import select
    import threading

    manager = StructuredOutputManager(
        read_tokenizer_vocabulary(TOKENIZER_DIR), VOCAB_SIZE, [EOS_ID]
    )
    gated = _GatedCompile(manager)
    gated.gate.set()
    spec = StructuredOutputs(choice=["ab"])
    manager.start_compile("a", spec)
    wait_until = time.monotonic() + 30.0
    while not manager.has_compiled():
        assert time.monotonic() < wait_until, "compile a did not end"
        time.sleep(0.01)
    gated.gate = threading.Event()  # compile b waits for the hand-over of a

    def end_compile_b() -> None:  # as the compile thread would, during the hand-over
        gated.gate.set()
        give_up = time.monotonic() + 2.0  # b may have to wait for the hand-over to end
        while len(ended) < 2 and time.monotonic() < give_up:
            time.sleep(0.005)

    ended = _CompileEndsWhileTaken(end_compile_b)
    ended.extend(manager._compiled)
    manager._compiled = ended
    manager.start_compile("b", spec)
    taken = [key for key, _ in manager.take_compiled()]
    while "b" not in taken and not manager.has_compiled():  # its end is queued, or taken
        assert time.monotonic() < wait_until, "compile b did not end"
        time.sleep(0.01)

    def is_awake() -> bool:
        return bool(select.select([manager.fileno()], [], [], 0)[0])

    assert is_awake() == manager.has_compiled(), "the wake pipe disagrees with the queue"
    taken += [key for key, _ in manager.take_compiled()]
    assert taken == ["a", "b"]
    assert not manager.has_compiled() and not is_awake(), "a wake byte was left behind"
    manager.close()


def test_engine_without_a_vocabulary_refuses_constrained_requests() -> None:
    info = get_model_info("tiny-llama", 16)
    kv_cache_config = KVCacheConfig(8, info.kv_cache_groups)
    runner = model_runner("tiny-llama", kv_cache_config, CPU, info.max_model_len)
    core = EngineCore(engine_config(16, max_model_len=64), kv_cache_config, info, runner)
    params = SamplingParams(structured_outputs=StructuredOutputs(choice=["a"]))
    rejected = core.add_request(EngineCoreRequest("r", pack_int32([1, 2]), params, 0.0))
    assert rejected is not None and "tokenizer.json" in rejected.outputs[0].error


def test_a_token_the_grammar_refuses_fails_only_its_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranks that ignored the bitmask (a bug) sample a token the grammar refuses: that request
    ends with an error naming the token, and the unconstrained one beside it runs on exactly."""
    monkeypatch.setattr(
        "worker.model_runner.apply_grammar_bitmask", lambda logits, bitmask, rows: logits
    )
    core, _ = _engine(False)
    free_params = SamplingParams(max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(  # a choice the model would never write unforced
        max_tokens=12, structured_outputs=StructuredOutputs(choice=["\x01\x02\x03"])
    )
    for req_id, params in (("free", free_params), ("bad", constrained)):
        request = EngineCoreRequest(req_id, pack_int32([50, 60, 70]), params, 0.0)
        assert core.add_request(request) is None
    handle = core.scheduler.requests[next(iter(core.scheduler.requests))].handle
    tokens: dict[str, list[int]] = {"free": [], "bad": []}
    errors: dict[str, str | None] = {}
    while core.has_work():
        for outputs in core.step().values():
            for output in outputs.outputs:
                tokens[output.req_id].extend(output.new_token_ids)
                if output.finish_reason is not None:
                    errors[output.req_id] = output.error
    assert "grammar refused sampled token" in errors["bad"] and len(tokens["bad"]) == 1
    assert errors["free"] is None
    expected = reference_generate(
        "tiny-llama", [50, 60, 70], free_params, max_model_len=MAX_MODEL_LEN, handle=handle
    )
    assert tokens["free"] == expected
    assert not core.scheduler.structured_output_manager.matchers


def _run_alone(core: EngineCore, req_id: str, params: SamplingParams) -> tuple[list[int], int, int]:
    """(tokens, steps scheduled, steps whose bitmask followed them) of one request alone."""
    request = EngineCoreRequest(req_id, pack_int32([70, 33, 120]), params, 0.0)
    assert core.add_request(request) is None
    tokens: list[int] = []
    num_deferred = 0
    while core.has_work():
        for outputs in core.step().values():
            for output in outputs.outputs:
                tokens.extend(output.new_token_ids)
        if core.scheduler.steps_in_flight:
            newest = core.scheduler.steps_in_flight.newest()
            num_deferred += newest.scheduler_output.grammar_bitmask_follows
        core.check_invariants()
    return tokens, core.scheduler.next_step_id - 1, num_deferred


@pytest.mark.parametrize(("kind", "spec"), CONSTRAINED, ids=[kind for kind, _ in CONSTRAINED])
def test_asynchronous_loop_keeps_a_constrained_requests_lookahead(
    kind: str, spec: StructuredOutputs
) -> None:
    """With asynchronous scheduling a constrained request is planned for every step, its
    bitmask following the step once the token before it is known: it takes as many steps as the
    synchronous loop (one more, for the pipeline's tail), not twice as many, and samples exactly
    the synchronous loop's greedy tokens."""
    params = SamplingParams(max_tokens=150, temperature=0.0, structured_outputs=spec)
    sync_tokens, sync_steps, sync_deferred = _run_alone(_engine(False)[0], "sync", params)
    async_core = _engine(True)[0]
    async_tokens, async_steps, async_deferred = _run_alone(async_core, "async", params)
    assert async_tokens == sync_tokens
    _check_text(kind, bytes(sync_tokens[:-1]).decode())
    # a step per token, and one that tells the ranks the request finished
    assert len(sync_tokens) > 3 and sync_steps == len(sync_tokens) + 1
    assert async_steps <= sync_steps + 1, (async_steps, sync_steps)
    assert sync_deferred == 0 and async_deferred >= len(sync_tokens) - 2
    assert not async_core.scheduler.structured_output_manager.matchers


def test_a_deferred_bitmask_row_of_a_finished_request_allows_every_token(
    manager: StructuredOutputManager,
) -> None:
    """A request that finished after its step was planned has no matcher when the step's
    bitmask is made: its row allows everything (what it samples is dropped)."""
    manager.add_request(7, StructuredOutputs(choice=["ab"]))
    manager.remove_request(7)
    bitmask = manager.grammar_bitmask([7], [0])
    assert _allowed_ids(bitmask, 0, VOCAB_SIZE) == list(range(VOCAB_SIZE))


def test_a_following_bitmask_is_taken_by_the_step_that_awaits_it() -> None:
    """The worker's thread puts a step's bitmask as it arrives; the step thread waits for it,
    and refuses one naming another step, or one that never comes by its deadline."""
    import threading

    from protocol.worker_messages import StepGrammarBitmask
    from worker.sampling.grammar_bitmask import FollowingGrammarBitmasks

    bitmask = GrammarBitmask(pack_int32([0]), pack_int32([-1] * 16))
    following = FollowingGrammarBitmasks(timeout_s=5.0)
    timer = threading.Timer(0.05, following.put, [StepGrammarBitmask(3, 1, bitmask)])
    timer.start()
    assert following.take(3, 1) == bitmask
    timer.join()
    following.put(StepGrammarBitmask(4, 1, bitmask))
    with pytest.raises(ValueError, match="grammar bitmask of step 4"):
        following.take(5, 1)
    following.put(StepGrammarBitmask(6, 1, bitmask))
    with pytest.raises(ValueError, match="still unused"):
        following.put(StepGrammarBitmask(7, 1, bitmask))
    following.take(6, 1)
    with pytest.raises(TimeoutError, match="step 8's grammar bitmask"):
        FollowingGrammarBitmasks(timeout_s=0.05).take(8, 1)
