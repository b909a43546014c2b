"""SamplingParams of the offline API: the engine's own (protocol/sampling.py) with the fields
vLLM's SamplingParams has that the front end applies rather than the engine: stop strings,
include_stop_str_in_output, skip_special_tokens, bad_words (text, tokenized by the LLM) and `n`
(choices per prompt, each an engine request; api_server/openai/parallel_sampling.py).
`engine_params` strips them. StructuredOutputsParams builds the engine's StructuredOutputs as
vLLM's class of that name is called.
"""

import json as json_text

from api_server.openai.errors import ApiError
from api_server.openai.parallel_sampling import MAX_CHOICES_PER_PROMPT
from api_server.openai.structured_outputs import check_structured_outputs
from protocol import sampling
from protocol.bounds import checked_copy


class SamplingParams(sampling.SamplingParams, frozen=True):
    """protocol's SamplingParams, plus what the offline API applies to the text.

    vLLM's spellings are accepted where kvserve's differ: `top_k` -1 or 0 means every token
    (kvserve's None), and `stop` may be one string. Bounds are checked when a request is built.
    """

    n: int = 1  # completions per prompt, 1 to MAX_CHOICES_PER_PROMPT
    stop: str | list[str] | None = None  # stop strings, matched on the text as the server does
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: list[str] | None = None  # words never generated; the LLM tokenizes them

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def StructuredOutputsParams(
    json: str | dict | None = None,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
    json_object: bool | None = None,
    disable_any_whitespace: bool = False,
) -> sampling.StructuredOutputs:
    """vLLM's `StructuredOutputsParams(...)`: exactly one constraint; `json` a schema as a dict
    or as its JSON text. ValueError when not exactly one is given."""
    schema = json_text.dumps(json) if isinstance(json, dict) else json
    return sampling.StructuredOutputs(
        json=schema,
        json_object=bool(json_object),
        regex=regex,
        choice=choice,
        grammar=grammar,
        disable_any_whitespace=disable_any_whitespace,
    )


def num_choices(params: sampling.SamplingParams) -> int:
    """`n` of `params` (1 for the engine's own kind); ValueError outside its bounds."""
    n = params.n if isinstance(params, SamplingParams) else 1
    if not 1 <= n <= MAX_CHOICES_PER_PROMPT:
        raise ValueError(f"n={n}: expected 1 to {MAX_CHOICES_PER_PROMPT} completions per prompt")
    return n


def engine_params(params: sampling.SamplingParams, **overrides: object) -> sampling.SamplingParams:
    """The engine's SamplingParams of `params` (either kind) with `overrides` (a choice's seed,
    tokenized bad words), every bound checked; a ValueError naming the field otherwise."""
    num_choices(params)
    values = {name: getattr(params, name) for name in sampling.SamplingParams.__struct_fields__}
    values.update(overrides)
    if values["top_k"] in (-1, 0):
        values["top_k"] = None  # vLLM's "every token"
    if values["structured_outputs"] is not None:
        try:  # what the server checks before it submits: the size, nesting and grammar
            check_structured_outputs(values["structured_outputs"], "structured_outputs")
        except ApiError as exc:
            raise ValueError(f"sampling parameters: {exc.message}") from None
    try:
        return checked_copy(sampling.SamplingParams(**values))
    except ValueError as exc:  # msgspec.ValidationError is one, as min_tokens > max_tokens is
        raise ValueError(f"sampling parameters: {exc}") from None
