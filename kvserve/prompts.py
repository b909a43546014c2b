"""The prompts and conversations the offline API accepts, in every form vLLM's `LLM` accepts
them, turned into one list with one SamplingParams per prompt. Plain Python: no tokenizer, no
engine; the LLM encodes the texts afterwards.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from protocol.sampling import SamplingParams

Message = dict[str, object]  # {"role": ..., "content": ...}
TokenIdsPrompt = dict[str, list[int]]  # vLLM's {"prompt_token_ids": [...]}
PromptText = dict[str, str]  # vLLM's {"prompt": "..."}
Prompt = str | list[int] | TokenIdsPrompt | PromptText


@dataclass(frozen=True, slots=True)
class PromptInput:
    """One prompt as given: its text, or its token ids (exactly one of them is set)."""

    text: str | None
    token_ids: list[int] | None


def _one_prompt(prompt: object, idx: int) -> PromptInput:
    if isinstance(prompt, str):
        return PromptInput(prompt, None)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return _one_prompt(list(prompt["prompt_token_ids"]), idx)
        if isinstance(prompt.get("prompt"), str):
            return PromptInput(prompt["prompt"], None)
    if isinstance(prompt, list) and all(
        isinstance(token_id, int) and not isinstance(token_id, bool) for token_id in prompt
    ):
        if not prompt:
            raise ValueError(f"prompt {idx}: no token ids: expected at least one")
        return PromptInput(None, list(prompt))
    raise TypeError(
        f"prompt {idx} of type {type(prompt).__name__}: expected a str, a list of token ids, "
        'or a dict with "prompt_token_ids" or "prompt"'
    )


def normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[PromptInput]:
    """One PromptInput per prompt: a single prompt (a str, one list of ids, one dict) is a
    batch of one; a list of them keeps its order."""
    is_single_ids = isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
    if isinstance(prompts, str | dict) or is_single_ids:
        return [_one_prompt(prompts, 0)]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts of type {type(prompts).__name__}: expected a str or a list")
    return [_one_prompt(prompt, idx) for idx, prompt in enumerate(prompts)]


def params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt: the defaults, the one given for all, or the list given,
    which must be as long as the prompts."""
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(
            f"{len(params)} sampling params for {num_prompts} prompts: expected one for all "
            "or one per prompt"
        )
    for idx, one in enumerate(params):
        if not isinstance(one, SamplingParams):
            raise TypeError(f"sampling_params[{idx}] of type {type(one).__name__}: expected one")
    return params


def normalize_conversations(
    messages: Sequence[Message] | Sequence[Sequence[Message]],
) -> list[list[Message]]:
    """A list of conversations: one conversation (a list of messages) is a batch of one."""
    if not messages:
        raise ValueError("no messages: expected a conversation or a list of them")
    if isinstance(messages[0], dict):
        conversations = [list(messages)]
    else:
        conversations = [list(conversation) for conversation in messages]
    for idx, conversation in enumerate(conversations):
        bad = [m for m in conversation if not (isinstance(m, dict) and "role" in m)]
        if not conversation or bad:
            raise ValueError(
                f"conversation {idx}: expected a non-empty list of {{'role', 'content'}} dicts"
            )
    return conversations  # type: ignore[return-value]
