"""GGUF files (`--model FILE.gguf`): a random Llama written as llama.cpp lays it out (q/k rows
permuted, Q4_K, Q4_0, Q8_0 and F16 tensors, a byte-level BPE vocabulary with merges, a chat
template) serves greedy tokens equal to transformers loading the same file, at TP 1 and 2 (each
rank dequantizing its own slices), with prefix caching, chunked prefill and preemption; its
tokenizer gives transformers' ids and chat prompt; unreadable files are refused by name.
"""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from api_server.tokenizer.checkpoint_tokenizer import CheckpointTokenizer
from api_server.tokenizer.gguf_tokenizer import gguf_tokenizer
from bench.workload import run_workload
from tests.unit.gguf_files import (
    CHATML,
    hf_gguf_model,
    hf_gguf_tokenizer,
    quantize_q4_k,
    sentencepiece_vocabulary,
    write_gguf,
)
from tests.unit.hf_checkpoints import hf_greedy
from tests.unit.test_hf_generate import PROMPTS, assert_greedy_matches, workload
from tests.unit.thread_tp_group import run_ranks
from worker.distributed import single_rank_group
from worker.models.hf.checkpoint import check_checkpoint
from worker.models.hf.config import CheckpointError, is_checkpoint

CPU = torch.device("cpu")
MAX_TOKENS = 10
TEXTS = [
    "hello there 12345, how are you?",
    " the  lazy\n\ndog <|im_end|> jumps",
    "ünïcode € and emoji 🙂",
]
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "the quick brown fox?"},
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """The file and transformers' greedy (tokens, margins) of every prompt on it."""
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    write_gguf(path, seed=2)
    model = hf_gguf_model(path)
    return path, [hf_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS]


def test_the_q4_k_writer_agrees_with_the_gguf_library() -> None:
    """The tests' own Q4_K encoder: the library's decoder reads back each value to within one
    4-bit step of its sub-block."""
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((4, 512)) * 0.3).astype(np.float32)
    decoded = gguf.quants.dequantize(quantize_q4_k(values), T.Q4_K)
    steps = (values.reshape(-1, 32).max(1) - np.minimum(values.reshape(-1, 32).min(1), 0)) / 15
    error = np.abs(decoded - values).reshape(-1, 32).max(1)
    assert (error <= steps * 0.75 + 1e-3).all()


def test_the_file_is_a_checkpoint_with_its_config(gguf_case: tuple[Path, list]) -> None:
    path, _ = gguf_case
    assert is_checkpoint(str(path))
    config = check_checkpoint(str(path), 2)
    assert (config.architecture, config.num_layers, config.head_dim) == ("LlamaForCausalLM", 2, 64)
    assert not config.tie_word_embeddings
    assert config.eos_token_ids == (config.vocab_size - 1,)  # <|im_end|>, the last token


def test_the_tokenizer_and_chat_template_equal_transformers(gguf_case: tuple[Path, list]) -> None:
    path, _ = gguf_case
    theirs = hf_gguf_tokenizer(path)
    ours = CheckpointTokenizer(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    rendered = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert ours.render_chat(MESSAGES) == expected


def test_a_bos_is_added_where_the_file_says(tmp_path: Path) -> None:
    path = tmp_path / "bos.gguf"
    write_gguf(path, pre="llama-bpe", add_bos=True)
    theirs, ours = hf_gguf_tokenizer(path), CheckpointTokenizer(path)
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    assert ours.encode(TEXTS[0])[0] == ours.bos_token_id


def test_a_sentencepiece_vocabulary_equals_transformers(tmp_path: Path) -> None:
    """Llama 2 / Mistral style: no merges in the file (derived from the scores), a BOS by
    default, bytes of characters no piece covers as <0xNN> tokens."""
    path = tmp_path / "spm.gguf"
    write_gguf(path, add_bos=None, tokenizer="llama")
    theirs, ours = hf_gguf_tokenizer(path), CheckpointTokenizer(path)
    for text in [*TEXTS, "  two leading spaces", "the\tquick\n"]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("the")[0] == ours.bos_token_id == 1
    rendered = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert ours.render_chat(MESSAGES) == expected


def test_greedy_tokens_equal_transformers_on_the_same_file(gguf_case: tuple[Path, list]) -> None:
    path, references = gguf_case
    work = workload(path, max_num_batched_tokens=12, async_scheduling=True)
    result = run_workload(work, single_rank_group(), CPU)
    assert result.num_hit_tokens > 0
    assert_greedy_matches("gguf", result, references)


def test_tp2_ranks_dequantize_their_slices_and_survive_preemption(
    gguf_case: tuple[Path, list],
) -> None:
    """q/k/v and gate/up rows are cut from the quantized bytes; o's columns (128 of a Q4_K row of
    256) from the dequantized rows; down's (256 of Q8_0) from the bytes."""
    path, references = gguf_case
    work = workload(path, 24, max_num_batched_tokens=16, async_scheduling=True)
    rank0, rank1 = run_ranks(2, lambda group: run_workload(work, group, CPU))
    assert rank0.outputs == rank1.outputs
    assert rank0.num_preemptions > 0
    assert_greedy_matches("gguf-tp2", rank0, references)


def _tiny_gguf(path: Path, arch: str = "llama", tokenizer_model: str = "gpt2", **types) -> None:
    """A one-layer file whose tensors have the given types (bytes of zeros)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in dict(
        context_length=64,
        embedding_length=256,
        block_count=1,
        feed_forward_length=256,
        head_count=4,
        head_count_kv=4,
        layer_norm_rms_eps=1e-6,
    ).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(["a", "b", "c", "d"])
    writer.add_token_merges([])
    shapes = {"token_embd": (4, 256), "output_norm": (256,), "blk.0.attn_norm": (256,)}
    shapes["blk.0.ffn_norm"] = (256,)
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        shapes[f"blk.0.{name}"] = (256, 256)
    for name, shape in shapes.items():
        qtype = types.get(name.rsplit(".", 1)[-1], T.F32)
        values = np.zeros(shape, dtype=np.float32)
        if qtype == T.F32:
            writer.add_tensor(f"{name}.weight", values)
        else:
            block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            data = np.zeros((shape[0], shape[1] // block_values * block_bytes), dtype=np.uint8)
            writer.add_tensor(f"{name}.weight", data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_refusals_name_the_key_or_tensor(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    _tiny_gguf(good, attn_v=T.Q8_0)
    check_checkpoint(str(good), 1)
    odd_type = tmp_path / "iq.gguf"
    _tiny_gguf(odd_type, attn_v=T.IQ2_XXS)
    with pytest.raises(CheckpointError, match=r"tensor blk\.0\.attn_v\.weight has type IQ2_XXS"):
        check_checkpoint(str(odd_type), 1)
    other_arch = tmp_path / "falcon.gguf"
    _tiny_gguf(other_arch, arch="falcon")
    with pytest.raises(CheckpointError, match=r"general\.architecture='falcon'"):
        check_checkpoint(str(other_arch), 1)
    unigram = tmp_path / "t5.gguf"
    _tiny_gguf(unigram, tokenizer_model="t5")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model='t5'"):
        gguf_tokenizer(str(unigram))
    not_gguf = tmp_path / "broken.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="cannot read"):
        check_checkpoint(str(not_gguf), 1)


def _sentencepiece_gguf(path: Path, arch: str, extra_pieces: list[str] | None = None) -> None:
    """A file of `arch` holding a Llama-2-style SentencePiece vocabulary (and an embedding),
    `extra_pieces` appended as normal pieces."""
    tokens, scores, types = sentencepiece_vocabulary()
    for piece in extra_pieces or []:
        tokens, scores, types = [*tokens, piece], [*scores, -float(len(tokens))], [*types, 1]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHATML)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_phi3_sentencepiece_vocabulary_equals_transformers(tmp_path: Path) -> None:
    """Phi-3's files spell spaces in a normalizer: text that starts with spaces keeps one more
    "\u2581" than Llama 2's Metaspace gives it, as transformers builds the tokenizer."""
    path = tmp_path / "phi3.gguf"
    _sentencepiece_gguf(path, "phi3")
    theirs, ours = hf_gguf_tokenizer(path), CheckpointTokenizer(path)
    for text in [*TEXTS, "  two leading spaces", " one", "the\tquick\n"]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    rendered = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert ours.render_chat(MESSAGES) == expected


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_sentencepiece_vocabulary_equals_transformers(tmp_path: Path, arch: str) -> None:
    """Gemma's files: no space prepended, pieces of spaces stored as spaces, merges derived in
    the pieces' file order; ids, text and the chat prompt as transformers builds them."""
    path = tmp_path / f"{arch}.gguf"
    _sentencepiece_gguf(path, arch, extra_pieces=["  ", "   ", "\u2581the\u2581"])
    theirs, ours = hf_gguf_tokenizer(path), CheckpointTokenizer(path)
    for text in [*TEXTS, "  two leading spaces", "a   b    c", " one", "the\tquick\n"]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    rendered = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert ours.render_chat(MESSAGES) == expected
