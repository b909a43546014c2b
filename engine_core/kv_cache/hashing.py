"""The engine's name for block hashing, whose one home is kv_hashing/block_hasher.py (the front
end hashes requests with the same code): re-exported here so the KV-cache layer keeps its imports.
"""

from kv_hashing.block_hasher import (
    GROUP_ID_NUM_BYTES,
    HASH_ALGOS,
    BlockHash,
    BlockHasher,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    ExtraKey,
    first_block_extra_keys,
    get_block_hash,
    get_group_id,
    get_hash_block_size,
    group_id_suffix,
    make_block_hash_with_group_id,
    make_block_hasher,
)

__all__ = [
    "GROUP_ID_NUM_BYTES",
    "HASH_ALGOS",
    "BlockHash",
    "BlockHashListWithBlockSize",
    "BlockHashWithGroupId",
    "BlockHasher",
    "ExtraKey",
    "first_block_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_hash_block_size",
    "group_id_suffix",
    "make_block_hash_with_group_id",
    "make_block_hasher",
]
