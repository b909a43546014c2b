"""FirstBlockAffinity: the first-block policy's choice of engine, by the affinity of a prompt's
first block and each engine's outstanding tokens.

Pure policy: no sockets, no awaits. The Router asks it and counts the request in the chosen
engine's record, where every policy reads outstanding tokens.
"""

import hashlib
from array import array
from collections import OrderedDict

from api_server.routing.engine_record import EngineRecord

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


class FirstBlockAffinity:
    """Spreads requests over the engines of `records`.

    A request whose first block was seen before goes to the engine that served it then, so the
    engine's prefix cache serves it too, unless that engine carries more than
    `max_imbalance_tokens` outstanding tokens beyond the least loaded available engine; every
    other request goes to the least loaded one (lowest index on a tie). The chosen engine becomes
    the prefix's engine. Outstanding tokens are the records' (EngineLoad.outstanding_tokens).

    Invariants: `_affinity` holds at most `max_entries` prefixes, each naming an engine index
    in range.
    """

    def __init__(
        self,
        records: list[EngineRecord],
        block_size: int,
        max_imbalance_tokens: int = DEFAULT_MAX_IMBALANCE_TOKENS,
        max_entries: int = DEFAULT_MAX_AFFINITY_ENTRIES,
    ) -> None:
        if not records or block_size < 1 or max_imbalance_tokens < 0 or max_entries < 1:
            raise ValueError(
                f"first-block policy over {len(records)} engines, block_size {block_size}, "
                f"max_imbalance_tokens {max_imbalance_tokens}, max_entries {max_entries}: "
                "expected positive counts"
            )
        self.records = records
        self.block_size = block_size
        self.max_imbalance_tokens = max_imbalance_tokens
        self.max_entries = max_entries
        self._affinity: OrderedDict[bytes, int] = OrderedDict()  # least recently routed first

    def choose(self, prompt_token_ids: list[int], is_available: list[bool]) -> int:
        """The engine for a request; the caller counts it there (EngineLoad.add)."""
        num_engines = len(self.records)
        candidates = [idx for idx in range(num_engines) if is_available[idx]]
        if not candidates:
            raise LookupError(f"no engine available among {num_engines}")
        outstanding = [record.load.outstanding_tokens for record in self.records]
        least = min(candidates, key=lambda idx: outstanding[idx])
        chosen = least
        key = prefix_key(prompt_token_ids, self.block_size)
        if key is not None:
            previous = self._affinity.pop(key, None)
            if previous is not None and is_available[previous]:
                excess = outstanding[previous] - outstanding[least]
                if excess <= self.max_imbalance_tokens:
                    chosen = previous
            self._affinity[key] = chosen
            if len(self._affinity) > self.max_entries:
                self._affinity.popitem(last=False)
        return chosen

    def engine_of_prefix(self, prompt_token_ids: list[int]) -> int | None:
        """The engine that last served this prompt's first block, if any."""
        key = prefix_key(prompt_token_ids, self.block_size)
        return None if key is None else self._affinity.get(key)

    def check_invariants(self) -> None:
        num_engines = len(self.records)
        assert len(self._affinity) <= self.max_entries, (
            f"{len(self._affinity)} affinity entries: expected at most {self.max_entries}"
        )
        stray = [idx for idx in self._affinity.values() if not 0 <= idx < num_engines]
        assert not stray, f"affinity names engines {stray}: expected 0..{num_engines - 1}"
