"""SamplingParams: how a request picks its tokens and when it stops, with declared bounds."""

import re
from typing import Annotated

import msgspec

MAX_TOKENS_LIMIT = 1 << 20
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS_LIMIT)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
MAX_STOP_TOKEN_IDS = 1024
SEED_LIMIT = (1 << 63) - 1
MAX_LOGPROBS = 20  # alternatives per sampled token at most, as OpenAI's top_logprobs
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]  # OpenAI's range
MAX_LOGIT_BIAS_ENTRIES = 1024
LogitBias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]  # OpenAI's range
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_TOKENS = 128
MAX_PROMPT_LOGPROBS = MAX_LOGPROBS
BadWord = Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_BAD_WORD_TOKENS)]
# A schema, regex or grammar's text, at most: the engine compiles it in its step loop, and
# xgrammar takes about 0.4 s for a 64 KiB schema of bounded strings (over a minute at 1 MiB)
MAX_STRUCTURED_SPEC_BYTES = 1 << 16
MAX_CHOICES = 1024
# A JSON schema's nested objects and arrays, at most: xgrammar's conversion time grows with the
# cube of the depth (0.4 s at 200 levels, 48 s at 1,000), and real schemas stay far below this
MAX_JSON_SCHEMA_DEPTH = 64
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKETS = re.compile(r"[\[\]{}]")


def json_nesting_depth(text: str, limit: int) -> int:
    """The deepest nesting of objects and arrays in JSON text (outside its strings), counted only
    until it passes `limit`; unbalanced text is left to the parser to refuse. Never recurses."""
    depth = deepest = 0
    for bracket in _JSON_BRACKETS.findall(_JSON_STRING.sub("", text)):
        if bracket in "{[":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth -= 1
    return deepest


class StructuredOutputs(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A constraint on a request's output, enforced by the engine with a grammar.

    Exactly one kind is set. The front end checks that it compiles before it submits the request;
    the engine compiles it again and fails the request (finish_reason error) if it does not.
    """

    json: Annotated[str, msgspec.Meta(max_length=MAX_STRUCTURED_SPEC_BYTES)] | None = None
    json_object: bool = False  # any JSON object (response_format json_object)
    regex: Annotated[str, msgspec.Meta(max_length=MAX_STRUCTURED_SPEC_BYTES)] | None = None
    choice: Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: Annotated[str, msgspec.Meta(max_length=MAX_STRUCTURED_SPEC_BYTES)] | None = None
    # json and json_object: no whitespace between the JSON's tokens (vLLM's option of this name)
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [
            name
            for name, value in (
                ("json", self.json is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
                ("choice", self.choice is not None),
                ("grammar", self.grammar is not None),
            )
            if value
        ]
        if len(kinds) != 1:
            raise ValueError(
                f"structured outputs set {kinds or 'nothing'}: expected exactly one of "
                "json, json_object, regex, choice, grammar"
            )


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
    # Added to the logit of each listed id before penalties, greedy included (OpenAI's rule);
    # ids must lie inside the model's vocabulary, which the engine checks at admission.
    logit_bias: (
        Annotated[dict[TokenId, LogitBias], msgspec.Meta(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None
    ) = None
    # Only these ids may be sampled (vLLM's allowed_token_ids); None: every id
    allowed_token_ids: (
        Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)]
        | None
    ) = None
    # Token sequences that must never appear in the output (vLLM's bad_words, tokenized by the
    # front end): an id that would complete one is banned at that step.
    bad_words_token_ids: Annotated[list[BadWord], msgspec.Meta(max_length=MAX_BAD_WORDS)] | None = (
        None
    )
    # Logprobs of each prompt token (its top-N alternatives too); None: none
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_PROMPT_LOGPROBS)] | None = None
    structured_outputs: StructuredOutputs | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}"
            )
