"""The checkpoint maker: a random-weight Hugging Face checkpoint of a chosen architecture and
shape, with a small byte-level BPE tokenizer, a ChatML chat template and a generation config.

Built offline with transformers and tokenizers (test and benchmark dependencies, never run-time
ones). Run: `python -m bench.make_checkpoint --arch qwen3 DIR` (`--help` lists the options).
"""

import argparse
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen3-moe", "mixtral", "gemma2", "gemma3", "phi3")
MOE_ARCHS = ("qwen3-moe", "mixtral")  # their shapes must name experts
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
# "hub": config.json as the hub ships most checkpoints (top-level rope_theta and rope_scaling,
# torch_dtype, the chat template inside tokenizer_config.json); "transformers5": as
# transformers 5 writes them (rope_parameters, dtype, chat_template.jinja beside it)
SPELLINGS = ("hub", "transformers5")
END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
# ChatML, as the Qwen family formats chats: a default system turn when the chat has none, the
# tools (if any) listed in the system turn as JSON, and the assistant's opening on request.
CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'Tools:\\n' }}{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system' and tools) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's size; the presets name the ones the tests, benchmarks and GPU check use."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the model's; the tokenizer trains up to this many ids
    max_position_embeddings: int
    num_experts: int = 0  # the MoE architectures' experts per sparse layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's (Mixtral's intermediate_size)

    @property
    def has_experts(self) -> bool:
        return self.num_experts > 0


SHAPES = {
    "tiny": Shape(64, 2, 4, 2, 16, 128, 512, 2048),  # the tests: milliseconds per step
    # the MoE tests: 8 experts, 2 a token (Mixtral takes 4 of them and no dense MLP)
    "tiny-moe": Shape(64, 2, 4, 2, 16, 128, 512, 2048, 8, 2, 32),
    # the MoE serving benchmark: the bench shape's active MLP width (4 of 16 experts of 384),
    # about 70M parameters
    "bench-moe": Shape(512, 8, 8, 4, 64, 1536, 8192, 4096, 16, 4, 384),
    # the serving benchmark: about 30M parameters, a few hundred tokens/s on a 2-core CPU
    "bench": Shape(512, 8, 8, 4, 64, 1536, 8192, 4096),
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 128, 3072, 151936, 40960),  # Qwen3-0.6B's shape
    # SmolLM2-135M's shape (llama, tied embeddings): the CPU serving benchmark against vLLM
    "smollm2-135m": Shape(576, 30, 9, 3, 64, 1536, 49152, 8192),
}


@dataclass(frozen=True, slots=True)
class CheckpointSpec:
    """Everything that decides the files written; the same spec writes the same checkpoint."""

    arch: str = "qwen3"
    shape: Shape = SHAPES["tiny"]
    seed: int = 0
    # Large enough that the context visibly moves the logits (HF's 0.02 makes them nearly flat)
    initializer_range: float = 0.2
    dtype: str = "float32"  # of the saved weights
    num_shards: int = 1
    rope_scaling: str = "none"  # llama only
    sliding_window: int | None = None  # mistral, phi3: every layer; qwen: past the first; gemma: 8
    max_window_layers: int | None = None  # qwen: layers [0, K) attend fully, the rest in windows
    layer_types: list[str] = field(default_factory=list)  # explicit per-layer types, or []
    tie_word_embeddings: bool | None = None  # None: the family's habit (qwen3 ties)
    mlp_only_layers: tuple[int, ...] = (0,)  # qwen3-moe: the layers that keep a dense MLP
    spelling: str = "hub"  # of config.json and tokenizer_config.json: one of SPELLINGS


def corpus(seed: int, num_sentences: int = 3000) -> list[str]:
    """Deterministic training text: generated sentences plus a few with multi-byte characters,
    so the BPE merges cover accented letters, CJK and emoji byte sequences."""
    rng = random.Random(seed)
    subjects = ["the engine", "a request", "the scheduler", "every rank", "the cache", "Paris"]
    verbs = ["reads", "writes", "schedules", "evicts", "shares", "finds", "answers", "keeps"]
    objects = ["the block", "a prefix", "tokens", "the capital of France", "its blocks", "42"]
    tails = [".", "!", "?", " quickly.", " again.", " on every step."]
    lines = [
        f"{rng.choice(subjects).capitalize()} {rng.choice(verbs)} {rng.choice(objects)}"
        f"{rng.choice(tails)}"
        for _ in range(num_sentences)
    ]
    lines += ["Café déjà vu, naïve façade.", "東京は日本の首都です。", "Emoji: 🙂🚀✨ done."] * 20
    lines += ["What is the capital of France? The capital of France is Paris."] * 20
    return lines


def build_tokenizer(spec: CheckpointSpec):  # -> tokenizers.Tokenizer (an optional import)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.shape.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(spec.seed), trainer=trainer)
    return tokenizer


def model_config(spec: CheckpointSpec, token_ids: dict[str, int]):  # -> PretrainedConfig
    import transformers

    shape = spec.shape
    common = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=spec.initializer_range,
        rms_norm_eps=1e-6,
        bos_token_id=token_ids[END_OF_TEXT],
        eos_token_id=token_ids[END_OF_TEXT],
        pad_token_id=token_ids[END_OF_TEXT],
    )
    tie = spec.tie_word_embeddings
    if spec.arch == "llama":
        config = transformers.LlamaConfig(
            **common,
            tie_word_embeddings=bool(tie),
            rope_theta=500000.0,  # Llama 3's
            rope_scaling=_llama_rope_scaling(spec.rope_scaling),
        )
    elif spec.arch == "mistral":
        config = transformers.MistralConfig(
            **common, sliding_window=spec.sliding_window, tie_word_embeddings=bool(tie)
        )
    elif spec.arch in MOE_ARCHS:
        config = _moe_config(spec, common)
    elif spec.arch in ("gemma2", "gemma3"):
        # the window defaults to 8 tokens, so that a chat's prompt already passes it
        # untied by default: tied, the scaled input embedding dominates and each token repeats
        gemma = dict(sliding_window=spec.sliding_window or 8, tie_word_embeddings=bool(tie))
        if spec.layer_types:
            gemma["layer_types"] = [f"{kind}_attention" for kind in spec.layer_types]
        if spec.arch == "gemma2":  # Gemma 2 alternates; soft-caps small enough to matter
            config = transformers.Gemma2Config(
                **common, **gemma, attn_logit_softcapping=8.0, final_logit_softcapping=10.0
            )
        else:  # Gemma 3: 5 sliding layers to 1 global one, each type with its own rope
            config = transformers.Gemma3TextConfig(
                **common, **gemma, rope_local_base_freq=1000.0, final_logit_softcapping=10.0
            )
    elif spec.arch == "phi3":
        del common["head_dim"]  # Phi-3's is hidden_size / num_attention_heads
        config = transformers.Phi3Config(
            **common,
            partial_rotary_factor=0.5,
            sliding_window=spec.sliding_window,
            tie_word_embeddings=bool(tie),
        )
    else:
        family = transformers.Qwen2Config if spec.arch == "qwen2" else transformers.Qwen3Config
        tie = (spec.arch == "qwen3") if tie is None else tie
        window = dict(
            use_sliding_window=spec.sliding_window is not None or bool(spec.layer_types),
            sliding_window=spec.sliding_window,
            max_window_layers=shape.num_layers
            if spec.max_window_layers is None
            else spec.max_window_layers,
        )
        if spec.layer_types:
            window["layer_types"] = [f"{kind}_attention" for kind in spec.layer_types]
        config = family(**common, **window, tie_word_embeddings=tie)
    config.dtype = spec.dtype
    return config


def _moe_config(spec: CheckpointSpec, common: dict):  # -> PretrainedConfig
    """Qwen3-MoE (a dense MLP in mlp_only_layers, renormalised top-k, as Qwen3-30B-A3B ships)
    or Mixtral (every layer's MLP is its experts)."""
    import transformers

    shape, tie = spec.shape, bool(spec.tie_word_embeddings)
    if not shape.has_experts:
        raise ValueError(f"architecture {spec.arch!r} needs a shape with experts, not {shape}")
    experts = dict(num_experts_per_tok=shape.num_experts_per_tok, tie_word_embeddings=tie)
    if spec.arch == "mixtral":
        common = dict(common, intermediate_size=shape.moe_intermediate_size)
        return transformers.MixtralConfig(
            **common, **experts, num_local_experts=shape.num_experts, sliding_window=None
        )
    return transformers.Qwen3MoeConfig(
        **common,
        **experts,
        num_experts=shape.num_experts,
        moe_intermediate_size=shape.moe_intermediate_size,
        mlp_only_layers=list(spec.mlp_only_layers),
        norm_topk_prob=True,
        use_sliding_window=spec.sliding_window is not None,
        sliding_window=spec.sliding_window,
    )


def _llama_rope_scaling(kind: str) -> dict | None:
    """Scalings of the kinds Llama checkpoints ship, with small factors for small models."""
    match kind:
        case "none":
            return None
        case "linear":
            return {"rope_type": "linear", "factor": 2.0}
        case "llama3":
            return {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        case "yarn":
            return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    raise ValueError(f"rope scaling {kind!r}: expected one of {list(ROPE_SCALINGS)}")


def make_checkpoint(folder: Path, spec: CheckpointSpec) -> Path:
    """Write the checkpoint of `spec` into `folder` (created); return the folder."""
    import torch
    import transformers

    if spec.arch not in ARCHS:
        raise ValueError(f"architecture {spec.arch!r}: expected one of {list(ARCHS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec)
    token_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = model_config(spec, token_ids)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.arch in ("gemma2", "gemma3"):  # Gemma's (1 + weight) norms start at zero
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, spec.initializer_range)
    model = model.to(getattr(torch, spec.dtype)).eval()
    total_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    shard_bytes = total_bytes // spec.num_shards + 1
    model.save_pretrained(folder, max_shard_size=shard_bytes if spec.num_shards > 1 else "50GB")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=IM_END, pad_token=END_OF_TEXT
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(folder)
    generation = {
        "bos_token_id": token_ids[END_OF_TEXT],
        # A chat ends on <|im_end|>, a plain completion on <|endoftext|>: both stop a request.
        "eos_token_id": [token_ids[IM_END], token_ids[END_OF_TEXT]],
        "pad_token_id": token_ids[END_OF_TEXT],
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if spec.spelling == "hub":
        _respell_as_hub(folder)
    return folder


def _respell_as_hub(folder: Path) -> None:
    """Rewrite transformers 5's spellings the way most hub checkpoints still spell them."""
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    rope = dict(config.pop("rope_parameters", None) or {})
    if "full_attention" in rope:  # Gemma 3: a rope per layer type, as the hub spells them
        full, sliding = rope.pop("full_attention"), rope.pop("sliding_attention")
        config["rope_local_base_freq"] = sliding["rope_theta"]
        rope = full
    if "rope_theta" in rope:
        config["rope_theta"] = rope.pop("rope_theta")
    if rope and rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    config["torch_dtype"] = config.pop("dtype")
    if config.get("model_type") == "qwen3_moe":  # transformers 5 renames num_experts on save
        config["num_experts"] = config.pop("num_local_experts")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    template_path = folder / "chat_template.jinja"
    tokenizer_config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.pop("backend", None)
    tokenizer_config["chat_template"] = template_path.read_text()
    template_path.unlink()
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def parse_args(argv: list[str]) -> tuple[Path, CheckpointSpec]:
    parser = argparse.ArgumentParser(prog="python -m bench.make_checkpoint", description=__doc__)
    parser.add_argument("folder", type=Path, help="where to write the checkpoint (created)")
    parser.add_argument("--arch", choices=ARCHS, default="qwen3")
    parser.add_argument(
        "--shape", choices=list(SHAPES), default=None, help="size preset (tiny or tiny-moe)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the text")
    parser.add_argument("--initializer-range", type=float, default=0.2, help="weights' std")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--shards", type=int, default=1, help="safetensors files, >= 1")
    parser.add_argument("--rope-scaling", choices=ROPE_SCALINGS, default="none", help="llama")
    parser.add_argument("--sliding-window", type=int, default=None, help="tokens per window")
    parser.add_argument(
        "--max-window-layers", type=int, default=None, help="qwen: layers before the windows"
    )
    parser.add_argument(
        "--layer-types",
        default="",
        help="comma-separated full/sliding per layer (qwen), e.g. full,sliding",
    )
    parser.add_argument(
        "--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None
    )
    parser.add_argument(
        "--spelling", choices=SPELLINGS, default="hub", help="of the config files (see SPELLINGS)"
    )
    parser.add_argument(
        "--mlp-only-layers", default="0", help="qwen3-moe: comma-separated dense layers"
    )
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards {args.shards}: expected at least 1")
    layer_types = [kind.strip() for kind in args.layer_types.split(",") if kind.strip()]
    bad = [kind for kind in layer_types if kind not in ("full", "sliding")]
    if bad:
        parser.error(f"--layer-types {bad[0]!r}: expected full or sliding")
    shape_name = args.shape or ("tiny-moe" if args.arch in MOE_ARCHS else "tiny")
    shape = SHAPES[shape_name]
    if (args.arch in MOE_ARCHS) != shape.has_experts:
        kind = "with" if args.arch in MOE_ARCHS else "without"
        parser.error(f"--shape {shape_name}: --arch {args.arch} expects a shape {kind} experts")
    try:
        mlp_only_layers = tuple(int(i) for i in args.mlp_only_layers.split(",") if i.strip())
    except ValueError:
        parser.error(f"--mlp-only-layers {args.mlp_only_layers!r}: expected layer numbers")
    if layer_types and len(layer_types) != shape.num_layers:
        parser.error(f"--layer-types lists {len(layer_types)} layers: expected {shape.num_layers}")
    spec = CheckpointSpec(
        arch=args.arch,
        shape=shape,
        seed=args.seed,
        initializer_range=args.initializer_range,
        dtype=args.dtype,
        num_shards=args.shards,
        rope_scaling=args.rope_scaling,
        sliding_window=args.sliding_window,
        max_window_layers=args.max_window_layers,
        layer_types=layer_types,
        tie_word_embeddings=args.tie_word_embeddings,
        spelling=args.spelling,
        mlp_only_layers=mlp_only_layers,
    )
    return args.folder, spec


def main(argv: list[str] | None = None) -> None:
    folder, spec = parse_args(sys.argv[1:] if argv is None else argv)
    make_checkpoint(folder, spec)
    files = sorted(path.name for path in folder.iterdir())
    print(f"wrote a random {spec.arch} checkpoint ({spec.shape}) to {folder}: {', '.join(files)}")


if __name__ == "__main__":
    main()
