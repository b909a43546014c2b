"""GGUF files for the tests, written with the `gguf` library from a random-weight transformers
Llama, as llama.cpp's converter lays them out: its tensor names, q and k rows permuted within each
head, the vocabulary, merges and chat template as metadata, and weights quantized to the types
the test names (Q8_0 and Q4_0 by the library; Q4_K by `quantize_q4_k` below, since the library
only dequantizes K-quants).
"""

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as T
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.unit.hf_checkpoints import INITIALIZER_RANGE

QK_K = 256  # values in a K-quant block
SUB_BLOCK = 32  # values sharing one 6-bit scale and min in Q4_K
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog 123 4567",
    "hello there, how are you today? I'm fine, thanks!",
    "serving language models with paged attention and prefix caching",
    "def main():\n    return 42\n",
] * 20
# A small model whose rows are whole Q4_K blocks (256 values)
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=INITIALIZER_RANGE,
    tie_word_embeddings=False,
)
# Each tensor kind's type: both K-quant cuts (rows of q/k/gate/up, unaligned columns of o) and
# block-aligned columns of down are read
TYPES = {
    "token_embd": T.F16,
    "output": T.Q8_0,
    "attn_q": T.Q4_K,
    "attn_k": T.Q4_K,
    "attn_v": T.Q4_0,
    "attn_output": T.Q4_K,
    "ffn_gate": T.Q4_K,
    "ffn_up": T.Q8_0,
    "ffn_down": T.Q8_0,
}
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """Rows of float32 (each a multiple of 256 long) as Q4_K bytes [rows, 144 per 256 values]:
    per 256 values an f16 scale d and min dmin, 8 six-bit (scale, min) pairs packed in 12 bytes,
    and 256 four-bit quants, a value being d * scale * q - dmin * min."""
    rows, cols = values.shape
    blocks = values.reshape(-1, QK_K // SUB_BLOCK, SUB_BLOCK).astype(np.float32)
    low = np.minimum(blocks.min(axis=2), 0.0)  # [B, 8], at most 0
    step = (blocks.max(axis=2) - low) / 15.0
    d = (step.max(axis=1) / 63.0).astype(np.float16)
    dmin = ((-low).max(axis=1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(d32 > 0, np.rint(step / d32), 0).clip(0, 63).astype(np.uint8)
        mins = np.where(dmin32 > 0, np.rint(-low / dmin32), 0).clip(0, 63).astype(np.uint8)
        unit = (d32 * scale)[:, :, None]
        offset = (dmin32 * mins)[:, :, None]
        q = np.where(unit > 0, np.rint((blocks + offset) / unit), 0).clip(0, 15).astype(np.uint8)
    packed = np.zeros((blocks.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        packed[:, j] = (scale[:, j] & 63) | ((scale[:, j + 4] >> 4) << 6)
        packed[:, j + 4] = (mins[:, j] & 63) | ((mins[:, j + 4] >> 4) << 6)
        packed[:, j + 8] = (scale[:, j + 4] & 0xF) | ((mins[:, j + 4] & 0xF) << 4)
    qs = np.zeros((blocks.shape[0], 128), dtype=np.uint8)
    for chunk in range(4):
        qs[:, 32 * chunk : 32 * chunk + 32] = q[:, 2 * chunk] | (q[:, 2 * chunk + 1] << 4)
    out = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=1
    )
    return out.reshape(rows, cols // QK_K * 144)


def quantize(values: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.Q4_K:
        return quantize_q4_k(values)
    if qtype in (T.F32, T.F16):
        return values.astype(np.float32 if qtype == T.F32 else np.float16)
    return gguf.quants.quantize(values, qtype)


def permute_like_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's order of a llama's q or k rows: each head's two rotary halves interleaved."""
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, cols).swapaxes(1, 2).reshape(rows, cols)


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE of about 300 tokens, trained on CORPUS (merges included)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def sentencepiece_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A Llama-2-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then pieces learned on
    CORPUS with "\u2581" for spaces, best first (score -rank); with each token's type."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=[], show_progress=False)
    trained.train_from_iterator(CORPUS, trainer)
    pieces = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    types = [2, 3, 3, *([6] * 256)]  # unknown, control, byte
    scores = [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    for special in SPECIAL_TOKENS[1:]:  # ChatML's markers, as control tokens
        tokens.append(special)
        types.append(3)
        scores.append(0.0)
    return tokens, scores, types


def write_gguf(
    path: Path,
    seed: int = 0,
    pre: str = "qwen2",
    add_bos: bool | None = False,
    tokenizer: str = "gpt2",
) -> None:
    """A random Llama as llama.cpp would convert it, to `path`; `tokenizer` "gpt2" (byte-level BPE
    with merges, split as `pre` names) or "llama" (SentencePiece pieces and scores, no merges).
    `add_bos` None leaves the key out of the file."""
    if tokenizer == "gpt2":
        bpe = json.loads(train_tokenizer().to_str())["model"]
        tokens = [token for token, _ in sorted(bpe["vocab"].items(), key=lambda item: item[1])]
        merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
        tokens += SPECIAL_TOKENS
        token_types = [1] * (len(tokens) - len(SPECIAL_TOKENS)) + [3] * len(SPECIAL_TOKENS)
        scores = None
        bos, eos = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
    else:
        tokens, scores, token_types = sentencepiece_vocabulary()
        merges = None
        bos, eos = 1, tokens.index("<|im_end|>")
    config = transformers.LlamaConfig(vocab_size=len(tokens), **SHAPE)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    state = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(SHAPE["max_position_embeddings"])
    writer.add_embedding_length(SHAPE["hidden_size"])
    writer.add_block_count(SHAPE["num_hidden_layers"])
    writer.add_feed_forward_length(SHAPE["intermediate_size"])
    writer.add_head_count(SHAPE["num_attention_heads"])
    writer.add_head_count_kv(SHAPE["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    writer.add_rope_freq_base(SHAPE["rope_theta"])
    writer.add_rope_dimension_count(SHAPE["hidden_size"] // SHAPE["num_attention_heads"])
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if merges is not None:
        writer.add_tokenizer_pre(pre)
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML)

    def add(name: str, values: np.ndarray, qtype: T) -> None:
        data = quantize(values, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"], TYPES["token_embd"])
    add("output.weight", state["lm_head.weight"], TYPES["output"])
    add("output_norm.weight", state["model.norm.weight"], T.F32)
    for i in range(SHAPE["num_hidden_layers"]):
        for hf, ours in HF_TO_GGUF.items():
            values = state[f"model.layers.{i}.{hf}.weight"]
            if ours == "attn_q":
                values = permute_like_llama_cpp(values, SHAPE["num_attention_heads"])
            elif ours == "attn_k":
                values = permute_like_llama_cpp(values, SHAPE["num_key_value_heads"])
            add(f"blk.{i}.{ours}.weight", values, TYPES.get(ours, T.F32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_gguf_model(path: Path) -> transformers.PreTrainedModel:
    """transformers' own reading of the file (it dequantizes with the same library)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def hf_gguf_tokenizer(path: Path):
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# The other architectures' files: 2 layers of 256 (Q8_0 rows are whole 32-value blocks), written
# from a random transformers model with the gguf library's own tensor names for the arch
ARCH_SHAPE = dict(SHAPE, vocab_size=384, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCH_FIELDS = {  # the config of each arch's model, over ARCH_SHAPE
    "qwen2": {},
    # transformers' GGUF reader takes Qwen3's head_dim from its config default (128)
    "qwen3": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=128),
    "gemma2": dict(head_dim=64, sliding_window=8, tie_word_embeddings=True),
    "gemma3": dict(head_dim=64, sliding_window=8, num_hidden_layers=6, tie_word_embeddings=True),
    "phi3": dict(tie_word_embeddings=False),
    # top-k weights renormalised, as llama.cpp and transformers read every Qwen3-MoE file
    "qwen3moe": dict(
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=768,  # transformers' GGUF reader keeps its config default
        norm_topk_prob=True,
    ),
}
ARCH_MODELS = {
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
    "qwen3moe": transformers.Qwen3MoeForCausalLM,
}
ARCH_CONFIGS = {
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "gemma2": transformers.Gemma2Config,
    "gemma3": transformers.Gemma3TextConfig,
    "phi3": transformers.Phi3Config,
    "qwen3moe": transformers.Qwen3MoeConfig,
}
GEMMA_ARCHS = ("gemma2", "gemma3")


def _qtype(is_embedding: bool, values: np.ndarray) -> T:
    """A file's type for a tensor: vectors in F32, the embedding in F16, matrices in Q8_0."""
    return T.F32 if values.ndim == 1 else T.F16 if is_embedding else T.Q8_0


def round_tripped(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """`model` with every weight quantized and dequantized as write_arch_gguf stores it: the
    reference for a file transformers cannot read as written."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            values = param.detach().float().numpy()
            qtype = _qtype(name == "model.embed_tokens.weight", values)
            rows = values.reshape(-1, values.shape[-1])
            restored = gguf.quants.dequantize(quantize(rows, qtype), qtype)
            param.copy_(torch.from_numpy(np.asarray(restored, dtype=np.float32)).view_as(param))
    return model


def arch_model(arch: str, seed: int, **fields: object) -> transformers.PreTrainedModel:
    """The random float32 model a file of `arch` is written from (ARCH_FIELDS[arch] overridden
    by `fields`; Gemma's norms random too)."""
    fields = {**ARCH_SHAPE, **ARCH_FIELDS[arch], **fields}
    config = ARCH_CONFIGS[arch](**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = ARCH_MODELS[arch](config).eval()
    if arch in GEMMA_ARCHS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, INITIALIZER_RANGE)
    return model


def _arch_tensors(arch: str, model: transformers.PreTrainedModel) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names (the gguf library's map for the arch):
    Gemma's norms stored as 1 + weight, experts stacked [experts, rows, cols]."""
    config = model.config
    gguf_arch = getattr(gguf.MODEL_ARCH, arch.upper())
    names = gguf.get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    out = {}
    for name, tensor in model.state_dict().items():
        values = tensor.detach().float().numpy()
        if ".mlp.experts.gate_up_proj" in name:  # [E, 2 * I, D]: gate rows, then up rows
            stem = name.removesuffix(".gate_up_proj")
            inter = values.shape[1] // 2
            out[names.get_name(stem + ".gate_proj") + ".weight"] = values[:, :inter]
            out[names.get_name(stem + ".up_proj") + ".weight"] = values[:, inter:]
            continue
        if ".mlp.experts.down_proj" in name:
            out[names.get_name(name) + ".weight"] = values
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(stem)
        assert gguf_name is not None, f"no llama.cpp name for {name} in {arch}"
        if arch in GEMMA_ARCHS and name.endswith("norm.weight"):
            values = values + 1.0
        out[f"{gguf_name}.{suffix}"] = values
    return out


def write_arch_gguf(
    path: Path,
    arch: str,
    seed: int = 0,
    extra_tensors: dict[str, np.ndarray] | None = None,
    **fields: object,
) -> transformers.PreTrainedModel:
    """A random model of `arch` as llama.cpp would convert it, to `path`: matrices in Q8_0, the
    embedding in F16, vectors in F32, Gemma's and Qwen3-MoE's metadata beside the common keys,
    and `extra_tensors` (llama.cpp's names) as given. The model it came from."""
    model = arch_model(arch, seed, **fields)
    config = model.config
    bpe = json.loads(train_tokenizer().to_str())["model"]
    tokens = [token for token, _ in sorted(bpe["vocab"].items(), key=lambda item: item[1])]
    tokens += SPECIAL_TOKENS
    tokens += [f"<unused{i}>" for i in range(config.vocab_size - len(tokens))]
    assert len(tokens) == config.vocab_size, len(tokens)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters.get("rope_theta", 10000.0))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if arch in GEMMA_ARCHS:
        writer.add_sliding_window(config.sliding_window)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    rope = config.rope_parameters
    if rope.get("rope_type") == "longrope":  # llama.cpp's Phi-3: factors as tensors
        extra_tensors = dict(extra_tensors or {})
        for kind in ("long", "short"):
            extra_tensors[f"rope_factors_{kind}.weight"] = np.array(
                rope[f"{kind}_factor"], dtype=np.float32
            )
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_chat_template(CHATML)
    for name, values in (_arch_tensors(arch, model) | (extra_tensors or {})).items():
        qtype = _qtype(name == "token_embd.weight", values)
        data = quantize(values.reshape(-1, values.shape[-1]), qtype)
        data = data.reshape(*values.shape[:-1], data.shape[-1])
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
