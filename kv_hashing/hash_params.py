"""HashParams: every input of a block hash besides a request's own tokens and keys, as an engine
announces it (its `get_routing_info` utility call) and a front end checks it before routing.
"""

import msgspec

from protocol.config import CacheConfig

# The canonical bytes BlockHasher documents, version 1; a change of those bytes bumps it, so an
# old front end never matches a new engine's hashes by accident.
HASH_FORMAT_VERSION = 1


class HashParams(msgspec.Struct, frozen=True):
    """What decides the hashes an engine keys its prefix cache with and announces in KV events.

    Two engines with equal HashParams give the same tokens and extra keys the same hashes, so a
    front end can hash a request once and look it up in both engines' maps.
    """

    is_prefix_caching: bool  # off: the engine caches nothing and publishes no hash
    algo: str  # `--prefix-caching-hash-algo`: "sha256" or "xxhash"
    block_size: int  # tokens per hashed block (the cache's block_size, the hash block size)
    hash_seed: str  # NONE_HASH, the parent of every block at token 0, derives from it
    group_block_size: int  # tokens per block of KV-cache group 0, the group routers look up
    num_kv_cache_groups: int  # groups the engine keys separately (group_idx in its events)
    format_version: int = HASH_FORMAT_VERSION  # of the canonical bytes that are hashed


def hash_params(cache_config: CacheConfig, group_block_sizes: list[int]) -> HashParams:
    """The HashParams of an engine running with `cache_config` over KV-cache groups of these
    block sizes (by group_idx)."""
    return HashParams(
        is_prefix_caching=cache_config.enable_prefix_caching,
        algo=cache_config.prefix_caching_hash_algo,
        block_size=cache_config.block_size,
        hash_seed=cache_config.hash_seed,
        group_block_size=group_block_sizes[0] if group_block_sizes else cache_config.block_size,
        num_kv_cache_groups=len(group_block_sizes),
    )


def decode_hash_params(announced: object, source: str) -> HashParams:
    """The HashParams in an engine's answer (a flat map, other keys ignored); ValueError naming
    `source` when it holds none."""
    try:
        return msgspec.convert(announced, HashParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"hash parameters of {source}: {exc}") from None


def hash_params_mismatch(first: HashParams, other: HashParams) -> str | None:
    """The first field in which two engines' hashes differ, as `field: a != b`; None if none."""
    pairs = zip(msgspec.structs.astuple(first), msgspec.structs.astuple(other), strict=True)
    for field, (mine, theirs) in zip(first.__struct_fields__, pairs, strict=True):
        if mine != theirs:
            return f"{field}: {mine!r} != {theirs!r}"
    return None
