"""RequestAtBlockSize: a request as a KV-cache group whose blocks span several hash blocks sees it.

Requests hash at `hash_block_size`; a group with larger blocks caches through this view, so the
BlockPool reads hash i as the hash of that group's block i. It copies nothing and changes nothing.
"""

from array import array

from engine_core.kv_cache.hashing import BlockHashListWithBlockSize
from engine_core.kv_cache.kv_request import KVCacheRequest


class RequestAtBlockSize:
    """A request as a group of larger blocks sees it: `block_hashes` is the view at its block
    size (BlockHashListWithBlockSize); every other field is the request's own."""

    __slots__ = ("_request", "block_hashes")

    def __init__(self, request: KVCacheRequest, hash_block_size: int, block_size: int) -> None:
        self._request = request
        self.block_hashes = BlockHashListWithBlockSize(
            request.block_hashes, hash_block_size, block_size
        )

    @property
    def req_id(self) -> str:
        return self._request.req_id

    @property
    def all_token_ids(self) -> array:
        return self._request.all_token_ids

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self._request.num_prompt_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self._request.num_computed_tokens

    @property
    def num_preemptions(self) -> int:
        return self._request.num_preemptions
