"""tiny-encdec's reference: the tokens of one request from a dense forward over its whole decoder
sequence per token, the encoder run anew each time and its K/V held in a plain dict (no blocks,
no slots, one rank). It never pages. Stop rules match the engine's (see reference.py).
"""

import torch

from protocol.sampling import SamplingParams
from worker.attention import ContextChunk
from worker.distributed import single_rank_group
from worker.models.fake.reference import DenseKV
from worker.models.fake.tiny_encdec import TINY_ENCDEC, TinyEncDec
from worker.sampler import SampleBatch, Sampler
from worker.sampling.penalties import TokenHistory


class DenseCrossKV:
    """One sequence's CrossKVContext: DenseKV for self-attention, its encoder K/V by layer."""

    def __init__(self, num_tokens: int, encoder_token_ids: list[int]) -> None:
        self.dense = DenseKV(num_tokens, {})
        self.num_tokens = num_tokens
        self.encoder_token_ids = torch.tensor(encoder_token_ids, dtype=torch.int64)
        self.cross: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer_name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        self.dense.write(layer_name, k, v)

    def chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]:
        self.dense.specs.setdefault(layer_name, None)  # every self-attention layer is causal
        return self.dense.chunks(layer_name, logits_only)

    def gather(self, layer_name: str, chunk: ContextChunk) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dense.gather(layer_name, chunk)

    def encoder_requests(self) -> list[tuple[int, torch.Tensor]]:
        return [(0, self.encoder_token_ids)]

    def token_requests(self) -> torch.Tensor:
        return torch.zeros(self.num_tokens, dtype=torch.int64)

    def write_cross(self, layer_name: str, req_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cross[layer_name] = (k, v)

    def gather_cross(self, layer_name: str, req_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cross[layer_name]


class TinyEncDecReference:
    """tiny-encdec unpaged: build it once, then generate for as many requests as needed.

    Args:
        seed: the model's weight seed (WorkerConfig.seed).
        sampling_seed: the runner seed that unseeded temperature sampling depends on.
    """

    def __init__(self, seed: int = 0, sampling_seed: int = 0) -> None:
        self.model = TinyEncDec(TINY_ENCDEC, single_rank_group(), seed, torch.device("cpu"))
        self.sampler = Sampler(sampling_seed, [TINY_ENCDEC.eos_token_id])

    def logits(self, sequence: list[int], encoder_token_ids: list[int]) -> torch.Tensor:
        """Logits [V] of the token after `sequence`."""
        tokens = torch.tensor(sequence, dtype=torch.int64)
        positions = torch.arange(len(sequence), dtype=torch.int64)
        last = torch.tensor([len(sequence) - 1])
        kv = DenseCrossKV(len(sequence), encoder_token_ids)
        return self.model.forward(tokens, positions, last, kv)[0]

    def generate(
        self,
        prompt_token_ids: list[int],
        encoder_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_model_len: int | None = None,
        handle: int = 0,
    ) -> list[int]:
        """The tokens the engine must produce for this request; `handle`, the request's engine
        handle, seeds unseeded sampling."""
        limit = min(max_model_len or TINY_ENCDEC.max_model_len, TINY_ENCDEC.max_model_len)
        sequence, output = list(prompt_token_ids), []
        while len(sequence) < limit:
            logits = self.logits(sequence, encoder_token_ids)
            history = TokenHistory.one(sequence, len(prompt_token_ids))  # penalties, min_tokens
            request = SampleBatch.one(handle, sampling_params, len(sequence), history)
            token_id = int(self.sampler.sample(logits[None], request)[0])
            sequence.append(token_id)
            output.append(token_id)
            if _stops(token_id, output, sampling_params):
                break
        return output


def _stops(token_id: int, output: list[int], params: SamplingParams) -> bool:
    """max_tokens, or EOS (unless ignore_eos) or a stop id once min_tokens are out."""
    if len(output) >= params.max_tokens:
        return True
    if len(output) < params.min_tokens:
        return False
    is_eos = token_id == TINY_ENCDEC.eos_token_id and not params.ignore_eos
    return is_eos or token_id in params.stop_token_ids
