"""A checkpoint's own tokenizer in the front end: loaded from its files without transformers, its
chat template rendering the same ids as transformers' apply_chat_template (imported here only),
and its streamed text equal to a decode of all the ids, never a broken character."""

import asyncio
import json
import random
import time
from pathlib import Path

import msgspec
import pytest
from tokenizers import Tokenizer, processors

from api_server.openai.engine_requests import chat_job, completion_jobs
from api_server.openai.protocol import CHAT_DECODER, COMPLETION_DECODER, parse_body
from api_server.openai.tokenization import TokenizeRequest, tokenize
from api_server.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from api_server.tokenizer.checkpoint_tokenizer import CheckpointTokenizer
from api_server.tokenizer.prompt_tokenizer import ByteTokenizer, load_tokenizer
from bench.make_checkpoint import CHATML_TEMPLATE, CheckpointSpec, build_tokenizer, corpus

transformers = pytest.importorskip("transformers")

BEGIN_OF_TEXT = "<|begin_of_text|>"
LLAMA3_SPECIALS = (BEGIN_OF_TEXT, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
# The shape of Llama 3's template: bos printed by the template itself, headers, trimmed content
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Tools: ' + tools | tojson(indent=2) + '\\n' }}{%- endif %}"
    "{{- 'Today: ' + strftime_now('%Y') + '\\n' + system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['user', 'assistant'] %}"
    "{{- raise_exception('roles must be user or assistant') }}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer briefly. "},
        {"role": "user", "content": "Café déjà vu 🙂🚀"},
        {"role": "assistant", "content": "東京は日本の首都です。"},
        {"role": "user", "content": "  and again  "},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def _hf_chat_ids(folder: Path, messages: list[dict], **kwargs: object) -> list[int]:
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    rendered = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer as bench/make_checkpoint.py saves it (transformers 5's chat_template.jinja)."""
    folder = tmp_path_factory.mktemp("chatml")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(CheckpointSpec()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-style tokenizer written as hub checkpoints ship one: a post-processor adding
    bos, and the chat template inside tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("llama3")
    tokenizer = build_tokenizer(CheckpointSpec())
    tokenizer.add_special_tokens(list(LLAMA3_SPECIALS))
    bos_id = tokenizer.token_to_id(BEGIN_OF_TEXT)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BEGIN_OF_TEXT} $A",
        pair=f"{BEGIN_OF_TEXT} $A {BEGIN_OF_TEXT} $B",
        special_tokens=[(BEGIN_OF_TEXT, bos_id)],
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BEGIN_OF_TEXT,
        "eos_token": {"content": "<|eot_id|>", "special": True, "__type": "AddedToken"},
        "chat_template": LLAMA3_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_load_tokenizer_picks_the_byte_tokenizer_or_the_checkpoints(chatml_dir: Path) -> None:
    assert isinstance(load_tokenizer("tiny-llama"), ByteTokenizer)
    ours = load_tokenizer(str(chatml_dir))
    assert isinstance(ours, CheckpointTokenizer)
    assert ours.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert isinstance(load_tokenizer("tiny-llama", str(chatml_dir)), CheckpointTokenizer)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        load_tokenizer(str(chatml_dir.parent))


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_ids_equal_transformers(
    chatml_dir: Path, messages: list[dict], add_generation_prompt: bool
) -> None:
    ours = CheckpointTokenizer(chatml_dir).render_chat(messages, add_generation_prompt)
    theirs = _hf_chat_ids(chatml_dir, messages, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_tools_reach_the_template_as_transformers_passes_them(chatml_dir: Path) -> None:
    ours = CheckpointTokenizer(chatml_dir)
    ids = ours.render_chat(CHATS[1], True, TOOLS)
    assert ids == _hf_chat_ids(chatml_dir, CHATS[1], tools=TOOLS, add_generation_prompt=True)
    assert '"name": "lookup"' in ours.decode(ids)  # tojson without HTML escapes


@pytest.mark.parametrize("messages", CHATS)
def test_a_template_that_prints_bos_gets_it_once_as_in_transformers(
    llama3_dir: Path, messages: list[dict]
) -> None:
    ours = CheckpointTokenizer(llama3_dir)
    ids = ours.render_chat(messages, True, TOOLS)
    assert ids == _hf_chat_ids(llama3_dir, messages, tools=TOOLS, add_generation_prompt=True)
    assert ids.count(ours.bos_token_id) == 1 and ids[0] == ours.bos_token_id


@pytest.mark.parametrize("add_bos_token", [None, True, False])
@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "LlamaTokenizerFast"])
def test_a_completion_prompt_is_encoded_as_in_transformers(
    llama3_dir: Path, tmp_path: Path, add_bos_token: bool | None, tokenizer_class: str
) -> None:
    """The post-processor's bos, whatever tokenizer_config.json's add_bos_token says: given a
    tokenizer.json, transformers follows the post-processor alone."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((llama3_dir / name).read_text())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = tokenizer_class
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = CheckpointTokenizer(tmp_path)
    for text in ("The capital of France is", "Emoji: 🙂 done.", f"{BEGIN_OF_TEXT}twice"):
        assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.encode("Paris")[0] == ours.bos_token_id


def test_tokenize_adds_special_tokens_as_vllm_does(llama3_dir: Path) -> None:
    """vLLM's /tokenize defaults: a prompt gets the post-processor's bos, a chat only what its
    template prints; add_special_tokens overrides either, and token_strs are vocabulary entries."""
    ours = CheckpointTokenizer(llama3_dir)
    hf = transformers.AutoTokenizer.from_pretrained(llama3_dir)
    bos = ours.bos_token_id

    def tokens(**body: object) -> list[int]:
        return tokenize(msgspec.convert(body, TokenizeRequest), ours, 8192)["tokens"]  # type: ignore[return-value]

    assert tokens(prompt="Paris") == hf("Paris")["input_ids"]
    assert (
        tokens(prompt="Paris", add_special_tokens=False)
        == hf("Paris", add_special_tokens=False)["input_ids"]
    )
    assert tokens(messages=CHATS[0]).count(bos) == 1
    assert tokens(messages=CHATS[0], add_special_tokens=True)[:2] == [bos, bos]
    shown = tokenize(
        msgspec.convert({"prompt": "Paris", "return_token_strs": True}, TokenizeRequest), ours, None
    )
    assert shown["token_strs"] == hf.convert_ids_to_tokens(shown["tokens"])


def test_add_special_tokens_reaches_completions_and_chats(llama3_dir: Path) -> None:
    """vLLM's defaults (true for a completion, false for a chat), overridden per request."""
    ours = CheckpointTokenizer(llama3_dir)
    bos = ours.bos_token_id

    def prompt_ids(body: dict) -> list[int]:
        raw = json.dumps(body).encode()
        if "messages" in body:
            return chat_job(parse_body(raw, CHAT_DECODER), ours, "c").prompt_token_ids  # type: ignore[arg-type]
        return completion_jobs(parse_body(raw, COMPLETION_DECODER), ours, "c")[0].prompt_token_ids  # type: ignore[arg-type]

    assert prompt_ids({"prompt": "Paris"})[0] == bos
    assert bos not in prompt_ids({"prompt": "Paris", "add_special_tokens": False})
    assert prompt_ids({"messages": CHATS[0]}).count(bos) == 1  # the template's own
    assert prompt_ids({"messages": CHATS[0], "add_special_tokens": True})[:2] == [bos, bos]


def test_raise_exception_in_a_template_is_a_chat_template_error(llama3_dir: Path) -> None:
    with pytest.raises(ChatTemplateError, match="roles must be user or assistant"):
        CheckpointTokenizer(llama3_dir).render_chat([{"role": "tool", "content": "x"}])


def test_templates_cannot_reach_python_internals() -> None:
    escapes = [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set ns = namespace(_x=1) %}{{ ns._x }}",
        "{{ messages.append(1) }}",  # the sandbox is immutable: no mutation of the inputs
    ]
    for source in escapes:
        with pytest.raises(ChatTemplateError, match=r"is unsafe|leading underscore"):
            ChatTemplate(source, {}).render([{"role": "user", "content": "x"}])


def test_generation_blocks_and_loop_controls_render() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    )
    rendered = ChatTemplate(source, {}).render([{"content": c} for c in "abc"])
    assert rendered == "ab"


def test_a_folder_without_a_template_is_refused_for_chats(tmp_path: Path) -> None:
    build_tokenizer(CheckpointSpec()).save(str(tmp_path / "tokenizer.json"))
    ours = CheckpointTokenizer(tmp_path)
    assert not ours.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        ours.render_chat([{"role": "user", "content": "x"}])


def _streamed(tokenizer: CheckpointTokenizer, token_ids: list[int], rng: random.Random) -> str:
    """The text of `token_ids` pushed in random runs, as engine outputs bring them."""
    detokenizer = tokenizer.detokenizer()
    pieces, start = [], 0
    while start < len(token_ids):
        stop = start + rng.randint(1, 3)
        pieces.append(detokenizer.push(token_ids[start:stop]))
        start = stop
    pieces.append(detokenizer.finish())
    for piece in pieces:
        assert "\ufffd" not in piece, f"a broken character in {pieces}"
    return "".join(pieces)


def test_streamed_text_equals_a_decode_of_every_id(chatml_dir: Path) -> None:
    """Multi-byte characters and emoji split across tokens come out whole in the later piece."""
    ours = CheckpointTokenizer(chatml_dir)
    rng = random.Random(0)
    texts = [*corpus(1)[-60:], "naïve 🙂🚀✨ 東京", "🙂" * 5 + "é" * 7]
    split_somewhere = False
    for text in texts:
        token_ids = ours.encode(text)
        split_somewhere |= any("\ufffd" in t for t in ours.token_texts(token_ids))
        assert _streamed(ours, token_ids, rng) == ours.decode(token_ids) == text
    assert split_somewhere, "no character was split across tokens: the test proves nothing"


def test_special_tokens_are_skipped_unless_asked(chatml_dir: Path) -> None:
    ours = CheckpointTokenizer(chatml_dir)
    token_ids = ours.encode("Paris<|im_end|>")
    skipping = ours.detokenizer()
    assert skipping.push(token_ids) + skipping.finish() == "Paris"
    keeping = ours.detokenizer(skip_special_tokens=False)
    assert keeping.push(token_ids) + keeping.finish() == "Paris<|im_end|>"


def test_a_cut_off_character_at_the_end_is_a_replacement_as_in_decode(chatml_dir: Path) -> None:
    ours = CheckpointTokenizer(chatml_dir)
    raw = Tokenizer.from_file(str(chatml_dir / "tokenizer.json"))
    token_ids = ours.encode("ok 🙂")
    split = next(idx for idx in range(1, len(token_ids)) if "\ufffd" in raw.decode(token_ids[:idx]))
    detokenizer = ours.detokenizer()
    text = detokenizer.push(token_ids[:split]) + detokenizer.finish()
    assert text == ours.decode(token_ids[:split]) and text.endswith("\ufffd")
    assert ours.detokenizer().push([10**6]) == ""  # outside the vocabulary: dropped, as decode


# A ChatML template that renders tool calls and their results, in the way Qwen's do
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls %}"
    "{{- '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments}"
    " | tojson + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + message.content }}"
    "{{- '</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_tool_calls_and_results_render_as_transformers_renders_them(
    chatml_dir: Path, tmp_path: Path
) -> None:
    """OpenAI sends a call's arguments as JSON text; the template gets them as a dict, as vLLM
    passes them to transformers."""
    from api_server.openai.protocol import CHAT_DECODER, parse_body

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((chatml_dir / name).read_text())
    (tmp_path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": ""}}
    call["function"]["arguments"] = json.dumps({"city": "Paris", "days": 2})
    body = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": TOOLS,
    }
    request = parse_body(json.dumps(body).encode(), CHAT_DECODER)
    request.check_supported()
    messages = [message.template_message() for message in request.messages]  # type: ignore[attr-defined]
    ours = CheckpointTokenizer(tmp_path).render_chat(messages, True, TOOLS)
    theirs_messages = json.loads(json.dumps(body["messages"]))
    theirs_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 2}
    del theirs_messages[1]["content"]
    theirs = _hf_chat_ids(tmp_path, theirs_messages, tools=TOOLS, add_generation_prompt=True)
    assert ours == theirs
    assert '"city": "Paris"' in CheckpointTokenizer(tmp_path).decode(ours)


@pytest.mark.parametrize("which", ["checkpoint", "byte"])
def test_a_long_prompt_tokenized_in_a_thread_leaves_the_event_loop_running(
    chatml_dir: Path, which: str
) -> None:
    """Guards against a long prompt stalling every stream: tokenizers' encode holds the GIL, so a
    worker thread did not help; a 1.4 MB prompt froze the front end for about a second."""
    tokenizer = CheckpointTokenizer(chatml_dir) if which == "checkpoint" else ByteTokenizer()
    text = "The capital of France is Paris. " * 20_000  # 640 KB

    async def largest_loop_gap_s() -> tuple[float, float]:
        start_s = last_s = time.perf_counter()
        gaps_s = []
        encoding = asyncio.ensure_future(asyncio.to_thread(tokenizer.encode, text))
        while not encoding.done():
            await asyncio.sleep(0.001)
            now_s = time.perf_counter()
            gaps_s.append(now_s - last_s)
            last_s = now_s
        assert encoding.result()[:3] == tokenizer.encode(text[:40])[:3]
        return max(gaps_s), time.perf_counter() - start_s

    largest_gap_s, total_s = asyncio.run(largest_loop_gap_s())
    assert largest_gap_s < total_s / 2, (largest_gap_s, total_s)
