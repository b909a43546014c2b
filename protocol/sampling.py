"""SamplingParams: how a request picks its tokens and when it stops, with declared bounds."""

from typing import Annotated

import msgspec

MAX_TOKENS_LIMIT = 1 << 20
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS_LIMIT)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
MAX_STOP_TOKEN_IDS = 1024
SEED_LIMIT = (1 << 63) - 1
MAX_LOGPROBS = 20  # alternatives per sampled token at most, as OpenAI's top_logprobs
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]  # OpenAI's range


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Sampling and stop settings of one request.

    Bounds are declared on the fields and checked on decode (or by `msgspec.convert` for objects
    built in-process, where msgspec does not check constructor arguments); `__post_init__` runs on
    every construction, decode and convert, so no instance has `min_tokens > max_tokens`.
    """

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_LIMIT)] = 16
    # Until this many were generated, the ranks never sample EOS (unless ignore_eos) or stop ids
    # (vLLM's rule), and the stop rules ignore them
    min_tokens: TokenCount = 0
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0  # 0 means greedy
    seed: Annotated[int, msgspec.Meta(ge=0, le=SEED_LIMIT)] | None = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    # Filters applied in this order before a draw at temperature > 0 (greedy ignores them):
    # penalties on the logits, then min_p, top_k and top_p on the probabilities (vLLM's order).
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0  # smallest set of this mass
    top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None  # most likely ids kept; None: all
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0  # of the top probability
    # Subtracted from the logit of every id generated so far: once (presence), per occurrence
    # (frequency); repetition divides positive logits (multiplies negative ones) of every id
    # in the prompt or output. They apply to greedy decoding too, as in vLLM.
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 1.0  # 1 is none
    # Alternatives returned with each sampled token's own logprob; None: no logprobs at all
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None

    def __post_init__(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}"
            )
