"""KVCacheRequest: what the KV-cache layer reads of a request, and nothing more.

The scheduler's Request satisfies it structurally; the KV layer never imports the scheduler.
"""

from array import array
from collections.abc import Sequence
from typing import Protocol

from engine_core.kv_cache.hashing import BlockHash


class KVCacheRequest(Protocol):
    """A request as the KV-cache layer sees it: read-only, never changed by the layer."""

    @property
    def req_id(self) -> str: ...

    @property
    def all_token_ids(self) -> array:
        """Prompt then generated token ids; BlockStored events copy full blocks of them."""
        ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """`block_hashes[i]` is the hash of full block i, chained on every block before it."""
        ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int:
        """Leading tokens of `all_token_ids` that came with the request; R-SWA keeps them all."""
        ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V are in the cache, or scheduled to be."""
        ...

    @property
    def num_preemptions(self) -> int:
        """Times the request was preempted; re-admissions are counted apart in the stats."""
        ...
