"""The model registry: a name gives the ModelInfo the engine plans with, and the Model (model.py)
a rank runs.

Names: `checksum`, `fixed-time` (checksum, each forward a set device time), `tiny-llama` and
`tiny-llama-hybrid` (full and sliding-window layers: two KV-cache groups). kv_cache_groups report
the whole model's num_kv_heads, before TP sharding. `tiny-local` has full-attention, chunked-local
and R-SWA layers (three groups). tiny-llama's KV is exact in float32 and float64.
`tiny-mla` caches one latent per token and layer (one MLA group, the same latent on every rank).
`tiny-encdec` is an encoder-decoder: its requests bring encoder input, cached in a cross-attention
group beside the decoder's self-attention group. `tiny-mamba-hybrid` has full-attention layers
and recurrent layers whose states live in a Mamba group (mode align). Any other `--model` that is
a folder holding config.json is a Hugging Face checkpoint (worker/models/hf/).
"""

import torch

from protocol.config import WorkerConfig
from protocol.worker_messages import ModelInfo
from worker.attention_backends.backend import resolve_attention_backend
from worker.distributed import TPGroup
from worker.kv_cache import torch_dtype
from worker.models.fake.checksum import CHECKSUM, ChecksumConfig, ChecksumModel
from worker.models.fake.fixed_time import FIXED_TIME, build_fixed_time
from worker.models.fake.tiny_encdec import TINY_ENCDEC, TinyEncDec
from worker.models.fake.tiny_llama import (
    TINY_LLAMA,
    TINY_LLAMA_HYBRID,
    TINY_LLAMA_HYBRID_2X,
    TINY_LOCAL,
    TinyLlama,
    TinyLlamaConfig,
)
from worker.models.fake.tiny_mamba import TINY_MAMBA_HYBRID, TinyMambaHybrid
from worker.models.fake.tiny_mla import TINY_MLA, TinyMLA
from worker.models.hf.checkpoint import check_checkpoint
from worker.models.hf.config import is_checkpoint, read_hf_config
from worker.models.hf.decoder import HFDecoder
from worker.models.hf.kv_groups import hf_model_info
from worker.models.model import Model
from worker.models.names import ENCODER_DECODER_MODEL_NAMES, MODEL_NAMES

TINY_LLAMAS: dict[str, TinyLlamaConfig] = {
    TINY_LLAMA.name: TINY_LLAMA,
    TINY_LLAMA_HYBRID.name: TINY_LLAMA_HYBRID,
    TINY_LLAMA_HYBRID_2X.name: TINY_LLAMA_HYBRID_2X,
    TINY_LOCAL.name: TINY_LOCAL,
}
CHECKSUMS: dict[str, ChecksumConfig] = {CHECKSUM.name: CHECKSUM, FIXED_TIME.name: FIXED_TIME}
_BUILT = (*CHECKSUMS, *TINY_LLAMAS, TINY_MLA.name, TINY_ENCDEC.name, TINY_MAMBA_HYBRID.name)
if _BUILT != MODEL_NAMES or (TINY_ENCDEC.name,) != ENCODER_DECODER_MODEL_NAMES:
    raise ImportError(
        f"worker/models/names.py lists {MODEL_NAMES} (encoder-decoder "
        f"{ENCODER_DECODER_MODEL_NAMES}): expected the registry's {_BUILT} ({TINY_ENCDEC.name!r})"
    )
DEFAULT_MODEL_STEP_MS = WorkerConfig().model_step_ms
FAKE_MODEL_DTYPE = "float32"  # what "auto" means for the built-in models
FP8_KV_DTYPE = "fp8_e4m3"  # what --kv-cache-dtype fp8 stores


def _check_name(name: str) -> None:
    if name not in MODEL_NAMES and not is_checkpoint(name):
        raise ValueError(
            f"unknown model {name!r}: expected one of {list(MODEL_NAMES)} or a folder holding "
            "config.json"
        )


def resolve_dtypes(
    name: str, dtype: str, kv_cache_dtype: str, device: torch.device
) -> tuple[str, str]:
    """(compute dtype, KV-cache dtype) of a model. `auto` compute is a checkpoint's own dtype on
    CUDA and float32 on the CPU (and always float32 for the built-in models, whose `dtype` is
    their KV dtype); `auto` KV follows the compute dtype."""
    if dtype == "auto":
        is_cuda_checkpoint = device.type == "cuda" and is_checkpoint(name)
        dtype = read_hf_config(name).dtype if is_cuda_checkpoint else FAKE_MODEL_DTYPE
    if kv_cache_dtype == "fp8":
        kv_cache_dtype = FP8_KV_DTYPE
    return dtype, dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def get_model_info(
    name: str, block_size: int, dtype: str = "float32", tp_size: int = 1
) -> ModelInfo:
    """What the engine needs to plan: vocabulary, EOS, max length and the KV-cache groups.

    `dtype` is the KV-cache dtype of tiny-llama and of a checkpoint; checksum and fixed-time
    always store int64 values. A checkpoint's groups depend on `tp_size` where TP replicates its
    KV heads.
    """
    _check_name(name)
    if is_checkpoint(name):
        return hf_model_info(read_hf_config(name), block_size, dtype, tp_size)
    if name in CHECKSUMS:
        config = CHECKSUMS[name]
        groups = config.kv_cache_groups(block_size)
    elif name == TINY_MLA.name:
        config = TINY_MLA  # one MLA group: a latent per token and layer, the same on every rank
        groups = config.kv_cache_groups(block_size, dtype)
    elif name == TINY_ENCDEC.name:
        config = TINY_ENCDEC  # the decoder's self-attention group, then the cross-attention group
        groups = config.kv_cache_groups(block_size, dtype)
    elif name == TINY_MAMBA_HYBRID.name:
        config = TINY_MAMBA_HYBRID  # the attention layers' group, then the recurrent states'
        groups = config.kv_cache_groups(block_size, dtype)
    else:
        config = TINY_LLAMAS[name]
        groups = config.kv_cache_groups(block_size, dtype)
    return ModelInfo(
        name=name,
        vocab_size=config.vocab_size,
        eos_token_ids=[] if config.eos_token_id is None else [config.eos_token_id],
        max_model_len=config.max_model_len,
        kv_cache_groups=groups,
    )


def build_model(
    name: str,
    tp_group: TPGroup,
    device: torch.device,
    seed: int = 0,
    model_step_ms: float = DEFAULT_MODEL_STEP_MS,  # fixed-time's device time per forward
    dtype: str = FAKE_MODEL_DTYPE,  # a checkpoint's compute dtype (resolve_dtypes)
    model_prefill_token_us: float = 0.0,  # fixed-time's extra device time per prompt token
    attention_backend: str = "auto",  # a checkpoint's (worker/attention_backends/backend.py)
    max_model_len: int | None = None,  # the engine's; None: the model's own
) -> Model:
    """The model `name` on this rank; every rank of a group must pass the same seed. A
    checkpoint is checked (CheckpointError) before this rank reads its slices of the weights."""
    _check_name(name)
    if is_checkpoint(name):
        config = check_checkpoint(name, tp_group.tp_size)
        backend = resolve_attention_backend(attention_backend, device)
        return HFDecoder(
            config, tp_group, device, torch_dtype(dtype), backend, max_model_len=max_model_len
        )
    if name == CHECKSUM.name:
        return ChecksumModel(CHECKSUM, tp_group, device)
    if name == FIXED_TIME.name:
        return build_fixed_time(tp_group, device, model_step_ms, model_prefill_token_us)
    if name == TINY_MLA.name:
        return TinyMLA(TINY_MLA, tp_group, seed, device)
    if name == TINY_ENCDEC.name:
        return TinyEncDec(TINY_ENCDEC, tp_group, seed, device)
    if name == TINY_MAMBA_HYBRID.name:
        return TinyMambaHybrid(TINY_MAMBA_HYBRID, tp_group, seed, device)
    return TinyLlama(TINY_LLAMAS[name], tp_group, seed, device)


def prompt_logits_refusal(model: str, uses_step_buffers: bool) -> str | None:
    """Why a rank of `model` cannot compute prompt logits; None when it can. A model's last
    layer must attend every query row on request: tiny-llama's and a checkpoint's do, through
    the paged reference or block-gather attention; the Triton step buffers and graphs keep one
    logits row per request, and the other built-in models compute sequence-level logits."""
    if uses_step_buffers:
        return "the Triton attention backend keeps one logits row per request"
    if is_checkpoint(model) or model in TINY_LLAMAS:
        return None
    return f"the built-in model {model} computes logits of sampled tokens only"
