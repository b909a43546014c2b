"""Reference generation: each model's tokens computed without paging, from the prompt alone.

tiny-llama runs a dense forward over the whole sequence per token, each layer masked as its spec
reads (`read_mask`; R-SWA also by the prompt's length); checksum and fixed-time sum their values
straight from the token list. Stop rules match the engine's: max_tokens, max_model_len, and EOS
(unless ignore_eos) or a stop id after min_tokens; the stop token is kept.
"""

from collections.abc import Callable

import torch

from protocol.kv_cache_spec import KVCacheSpec
from protocol.sampling import SamplingParams
from worker.attention import ContextChunk, read_mask
from worker.distributed import single_rank_group
from worker.models.fake.checksum import CHECKSUM, context_sum, kv_values, mix_logits
from worker.models.fake.tiny_llama import TinyLlama
from worker.models.fake.tiny_mamba import TINY_MAMBA_HYBRID
from worker.models.fake.tiny_mamba_reference import tiny_mamba_logits
from worker.models.fake.tiny_mla import TINY_MLA
from worker.models.fake.tiny_mla_reference import tiny_mla_logits
from worker.models.registry import CHECKSUMS, TINY_LLAMAS, get_model_info
from worker.sampler import SampleBatch, Sampler
from worker.sampling.penalties import TokenHistory


class DenseKV:
    """One whole sequence's K/V in contiguous tensors: entry i is position i. No blocks, no slots.

    It lives for one dense forward, which writes every layer's K/V of all positions at once, so
    there is no state to walk between steps.

    Args:
        specs: each layer's KV-cache spec, which decides what its queries read; None is full
            attention.
        num_prompt_tokens: the leading tokens that are the prompt (R-SWA reads them all); None:
            the whole sequence.
    """

    def __init__(
        self,
        num_tokens: int,
        specs: dict[str, KVCacheSpec | None],
        num_prompt_tokens: int | None = None,
    ) -> None:
        self.num_tokens = num_tokens
        self.specs = specs
        self.num_prompt_tokens = num_tokens if num_prompt_tokens is None else num_prompt_tokens
        self.store: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer_name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        self.store[layer_name] = (k.double(), v.double())

    def chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]:
        positions = torch.arange(self.num_tokens)
        queries = positions[-1:] if logits_only else positions
        spec = self.specs[layer_name]
        if spec is None:
            visible = positions[None, :] <= queries[:, None]  # [n, T]
        else:
            ctx, query = positions.numpy()[None, :], queries.numpy()[:, None]
            visible = torch.from_numpy(read_mask(spec, ctx, query, self.num_prompt_tokens))
        zeros = torch.zeros((1, self.num_tokens), dtype=torch.int64)  # [1, T]
        return [ContextChunk(queries[None, :], zeros, zeros, positions[None, :], visible[None])]

    def gather(self, layer_name: str, chunk: ContextChunk) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.store[layer_name]
        return k[None], v[None]


def _stops(token_id: int, output: list[int], params: SamplingParams, eos: list[int]) -> bool:
    if len(output) >= params.max_tokens:
        return True
    if len(output) < params.min_tokens:
        return False
    is_eos = token_id in eos and not params.ignore_eos
    return is_eos or token_id in params.stop_token_ids


class ReferenceModel:
    """One model, unpaged: build it once, then generate for as many prompts as needed.

    Args:
        seed: the model's weight seed (WorkerConfig.seed).
        sampling_seed: the runner seed that unseeded temperature sampling depends on.
    """

    def __init__(self, model_name: str, seed: int = 0, sampling_seed: int = 0) -> None:
        self.info = get_model_info(model_name, block_size=16)
        if model_name == TINY_MLA.name:  # its own dense forward, over latents (tiny_mla_reference)
            self._logits_of = _whole_sequence_logits(tiny_mla_logits(seed))
        elif model_name == TINY_MAMBA_HYBRID.name:  # states carried from zero (its own module)
            self._logits_of = _whole_sequence_logits(tiny_mamba_logits(seed))
        else:
            self._logits_of = (
                _whole_sequence_logits(_checksum_logits)
                if model_name in CHECKSUMS
                else _tiny_llama_logits(model_name, seed)
            )
        self._sampler = Sampler(sampling_seed, self.info.eos_token_ids)

    def next_token_logits(self, sequence: list[int], num_prompt_tokens: int) -> torch.Tensor:
        """The raw logits [V] of the token after `sequence` (its first tokens the prompt)."""
        return self._logits_of(sequence, num_prompt_tokens)

    def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_model_len: int | None = None,
        handle: int = 0,
    ) -> list[int]:
        """The tokens the engine must produce for this prompt; `handle`, the request's engine
        handle, seeds unseeded sampling."""
        info = self.info
        limit = min(max_model_len or info.max_model_len, info.max_model_len)
        sequence, output = list(prompt_token_ids), []
        while len(sequence) < limit:
            logits = self.next_token_logits(sequence, len(prompt_token_ids))
            history = TokenHistory.one(sequence, len(prompt_token_ids))  # for penalties
            request = SampleBatch.one(handle, sampling_params, len(sequence), history)
            token_id = int(self._sampler.sample(logits[None], request)[0])
            sequence.append(token_id)
            output.append(token_id)
            if _stops(token_id, output, sampling_params, info.eos_token_ids):
                break
        return output


def reference_generate(
    model_name: str,
    prompt_token_ids: list[int],
    sampling_params: SamplingParams,
    *,
    seed: int = 0,
    max_model_len: int | None = None,
    handle: int = 0,
    sampling_seed: int = 0,
) -> list[int]:
    """The tokens the engine must produce for one prompt (see ReferenceModel for many)."""
    model = ReferenceModel(model_name, seed, sampling_seed)
    return model.generate(
        prompt_token_ids, sampling_params, max_model_len=max_model_len, handle=handle
    )


def _whole_sequence_logits(
    logits_of: Callable[[list[int]], torch.Tensor],
) -> Callable[[list[int], int], torch.Tensor]:
    """A model whose every layer reads every earlier position: the prompt length does not matter."""

    def logits(sequence: list[int], num_prompt_tokens: int) -> torch.Tensor:
        return logits_of(sequence)

    return logits


def _checksum_logits(sequence: list[int]) -> torch.Tensor:
    """Logits of the next token: the context sum over every position, layer and head."""
    tokens = torch.tensor(sequence, dtype=torch.int64)
    positions = torch.arange(len(sequence), dtype=torch.int64)
    heads = torch.arange(CHECKSUM.num_kv_heads, dtype=torch.int64)
    total = torch.zeros(1, dtype=torch.int64)  # [1]
    mask = torch.ones((1, len(sequence)), dtype=torch.bool)  # [1, T]
    for layer_idx in range(CHECKSUM.num_layers):
        k, v = kv_values(tokens, positions, layer_idx, heads, CHECKSUM.head_dim)
        total += context_sum(k[None], v[None], positions[None], mask)
    return mix_logits(total, CHECKSUM.vocab_size)[0]


def _tiny_llama_logits(model_name: str, seed: int) -> Callable[[list[int], int], torch.Tensor]:
    config = TINY_LLAMAS[model_name]
    model = TinyLlama(config, single_rank_group(), seed, torch.device("cpu"))
    specs: dict[str, KVCacheSpec | None] = {}
    for group in config.kv_cache_groups(block_size=16, dtype="float64"):
        specs.update(dict.fromkeys(group.layer_names, group.spec))

    def logits_of(sequence: list[int], num_prompt_tokens: int) -> torch.Tensor:
        tokens = torch.tensor(sequence, dtype=torch.int64)
        positions = torch.arange(len(sequence), dtype=torch.int64)
        last = torch.tensor([len(sequence) - 1])
        kv = DenseKV(len(sequence), specs, num_prompt_tokens)
        return model.forward(tokens, positions, last, kv)[0]

    return logits_of
