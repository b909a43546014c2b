"""ChoiceLogprobs: the engine's TokenLogprobs of one choice in OpenAI's two shapes, completions'
`{tokens, token_logprobs, top_logprobs, text_offset}` and chat's `{content: [{token, logprob,
bytes, top_logprobs}]}`, one fragment per streamed chunk or the whole at the end; and a
prompt's logprobs in vLLM's prompt_logprobs shape.
"""

import math

from api_server.tokenizer.prompt_tokenizer import PromptTokenizer
from protocol.client_messages import TokenLogprobs

# JSON has no -inf (a token the filters could never draw still has a logprob); vLLM clamps so too
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) or logprob < LOGPROB_FLOOR else logprob


def _token_entry(text: str, logprob: float) -> dict[str, object]:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


class ChoiceLogprobs:
    """Shapes one choice's logprobs as they arrive.

    `num_top` alternatives are shown per token (the request's logprobs or top_logprobs). For
    completions, `text_offset` is each token's start in the choice's text, counting every token's
    own text (vLLM's rule), so it keeps growing across chunks.
    Invariant: every list of `_whole` has one entry per token pushed so far.
    """

    def __init__(self, tokenizer: PromptTokenizer, is_chat: bool, num_top: int) -> None:
        self.tokenizer = tokenizer
        self.is_chat = is_chat
        self.num_top = num_top
        self._next_offset = 0
        self._whole = self._empty()

    def _empty(self) -> dict[str, list]:
        if self.is_chat:
            return {"content": []}
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def push(self, logprobs: TokenLogprobs) -> dict[str, list]:
        """The fragment of these tokens (a chunk's `logprobs`); the whole keeps them too."""
        fragment = self._empty()
        rows = zip(logprobs.token_ids, logprobs.logprobs, strict=True)
        for token_ids, values in rows:
            if not token_ids or len(token_ids) != len(values):
                raise ValueError(
                    f"a logprob row of {len(token_ids)} ids and {len(values)} values: expected "
                    "the sampled id first and as many values as ids"
                )
            texts = self.tokenizer.token_texts(token_ids[: 1 + self.num_top])
            tops = list(zip(texts[1:], values[1 : 1 + self.num_top], strict=True))
            if self.is_chat:
                entry = _token_entry(texts[0], values[0])
                entry["top_logprobs"] = [_token_entry(text, value) for text, value in tops]
                fragment["content"].append(entry)
                continue
            fragment["tokens"].append(texts[0])
            fragment["token_logprobs"].append(_finite(values[0]))
            # the sampled token's own logprob is always among the top ones, as vLLM shows it
            top = {texts[0]: _finite(values[0])}
            top.update((text, _finite(value)) for text, value in tops)
            fragment["top_logprobs"].append(top)
            fragment["text_offset"].append(self._next_offset)
            self._next_offset += len(texts[0])
        for key, items in fragment.items():
            self._whole[key].extend(items)
        return fragment

    def whole(self) -> dict[str, list]:
        return self._whole

    def whole_after_prompt(
        self, prompt_token_ids: list[int], prompt_logprobs: TokenLogprobs
    ) -> dict[str, list]:
        """Completions' whole logprobs led by the echoed prompt's (vLLM's echo with logprobs):
        the first prompt token has none (null), each other its own and the top N; text_offset
        counts the prompt tokens' texts, then the output's as before, shifted past them."""
        if self.is_chat or len(prompt_logprobs.token_ids) != len(prompt_token_ids) - 1:
            raise ValueError(
                f"{len(prompt_logprobs.token_ids)} prompt logprob rows for a completion prompt of "
                f"{len(prompt_token_ids)} tokens: expected one fewer"
            )
        texts = self.tokenizer.token_texts(prompt_token_ids)
        offsets = [0]
        for text in texts[:-1]:
            offsets.append(offsets[-1] + len(text))
        prompt_part = ChoiceLogprobs(self.tokenizer, False, self.num_top).push(prompt_logprobs)
        shift = offsets[-1] + len(texts[-1])
        whole = self._whole
        return {
            "tokens": [texts[0], *prompt_part["tokens"], *whole["tokens"]],
            "token_logprobs": [None, *prompt_part["token_logprobs"], *whole["token_logprobs"]],
            "top_logprobs": [None, *prompt_part["top_logprobs"], *whole["top_logprobs"]],
            "text_offset": [*offsets, *(offset + shift for offset in whole["text_offset"])],
        }


def prompt_logprobs_json(
    tokenizer: PromptTokenizer, entries: TokenLogprobs
) -> list[dict[str, dict[str, object]] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token (nothing scores it), then per
    token a map from token id to {logprob, rank, decoded_token}: the prompt token itself (its
    rank in the distribution) and the top N (ranks 1..N)."""
    shaped: list[dict[str, dict[str, object]] | None] = [None]
    rows = zip(entries.token_ids, entries.logprobs, entries.sampled_token_ranks, strict=True)
    for token_ids, values, rank in rows:
        if not token_ids or len(token_ids) != len(values):
            raise ValueError(
                f"a prompt logprob row of {len(token_ids)} ids and {len(values)} values: "
                "expected the prompt token first and as many values as ids"
            )
        texts = tokenizer.token_texts(token_ids)
        ranks = [rank, *range(1, len(token_ids))]
        entry: dict[str, dict[str, object]] = {}
        for token_id, text, value, token_rank in zip(token_ids, texts, values, ranks, strict=True):
            entry.setdefault(
                str(token_id),
                {"logprob": _finite(value), "rank": token_rank, "decoded_token": text},
            )
        shaped.append(entry)
    return shaped
