"""PrefixAffinityRouter: which engine serves a request, by prefix affinity and outstanding tokens.

Pure policy: no sockets, no awaits. The engine pool asks it, then tells it when a request ends.
"""

import hashlib
from array import array
from collections import OrderedDict

DEFAULT_MAX_IMBALANCE_TOKENS = 8192
DEFAULT_MAX_AFFINITY_ENTRIES = 65536
PREFIX_DIGEST_BYTES = 16


def prefix_key(prompt_token_ids: list[int], block_size: int) -> bytes | None:
    """A digest of the prompt's first full block; None when the prompt is shorter than a block,
    since such a prompt leaves no block in any engine's prefix cache to share."""
    if len(prompt_token_ids) < block_size:
        return None
    first_block = array("i", prompt_token_ids[:block_size]).tobytes()
    return hashlib.blake2b(first_block, digest_size=PREFIX_DIGEST_BYTES).digest()


class PrefixAffinityRouter:
    """Spreads requests over `num_engines` engines.

    A request whose first block was seen before goes to the engine that served it then, so the
    engine's prefix cache serves it too, unless that engine carries more than
    `max_imbalance_tokens` outstanding tokens beyond the least loaded available engine; every
    other request goes to the least loaded one (lowest index on a tie). The chosen engine becomes
    the prefix's engine.

    Invariants: `outstanding_tokens[i]` is the sum of `num_tokens` of the requests chosen for
    engine i and not yet released, never negative; `_affinity` holds at most `max_entries`
    prefixes, each naming an engine index in range.
    """

    def __init__(
        self,
        num_engines: int,
        block_size: int,
        max_imbalance_tokens: int = DEFAULT_MAX_IMBALANCE_TOKENS,
        max_entries: int = DEFAULT_MAX_AFFINITY_ENTRIES,
    ) -> None:
        if num_engines < 1 or block_size < 1 or max_imbalance_tokens < 0 or max_entries < 1:
            raise ValueError(
                f"router of {num_engines} engines, block_size {block_size}, max_imbalance_tokens "
                f"{max_imbalance_tokens}, max_entries {max_entries}: expected positive counts"
            )
        self.num_engines = num_engines
        self.block_size = block_size
        self.max_imbalance_tokens = max_imbalance_tokens
        self.max_entries = max_entries
        self.outstanding_tokens = [0] * num_engines
        self._affinity: OrderedDict[bytes, int] = OrderedDict()  # least recently routed first

    def choose(self, prompt_token_ids: list[int], num_tokens: int, is_available: list[bool]) -> int:
        """The engine for a request of `num_tokens` (prompt plus most tokens it may generate);
        counts them as outstanding there until `release`."""
        candidates = [idx for idx in range(self.num_engines) if is_available[idx]]
        if not candidates:
            raise LookupError(f"no engine available among {self.num_engines}")
        least = min(candidates, key=lambda idx: self.outstanding_tokens[idx])
        chosen = least
        key = prefix_key(prompt_token_ids, self.block_size)
        if key is not None:
            previous = self._affinity.pop(key, None)
            if previous is not None and is_available[previous]:
                excess = self.outstanding_tokens[previous] - self.outstanding_tokens[least]
                if excess <= self.max_imbalance_tokens:
                    chosen = previous
            self._affinity[key] = chosen
            if len(self._affinity) > self.max_entries:
                self._affinity.popitem(last=False)
        self.outstanding_tokens[chosen] += num_tokens
        return chosen

    def release(self, engine_idx: int, num_tokens: int) -> None:
        """A request counted by `choose` on `engine_idx` has ended."""
        if num_tokens > self.outstanding_tokens[engine_idx]:
            raise ValueError(
                f"release of {num_tokens} tokens on engine {engine_idx}: only "
                f"{self.outstanding_tokens[engine_idx]} outstanding"
            )
        self.outstanding_tokens[engine_idx] -= num_tokens

    def engine_of_prefix(self, prompt_token_ids: list[int]) -> int | None:
        """The engine that last served this prompt's first block, if any."""
        key = prefix_key(prompt_token_ids, self.block_size)
        return None if key is None else self._affinity.get(key)

    def check_invariants(self) -> None:
        negative = [(idx, n) for idx, n in enumerate(self.outstanding_tokens) if n < 0]
        assert not negative, f"negative outstanding tokens (engine, tokens): {negative}"
        assert len(self._affinity) <= self.max_entries, (
            f"{len(self._affinity)} affinity entries: expected at most {self.max_entries}"
        )
        stray = [idx for idx in self._affinity.values() if not 0 <= idx < self.num_engines]
        assert not stray, f"affinity names engines {stray}: expected 0..{self.num_engines - 1}"
