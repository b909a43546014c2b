"""Chained block hashes over a canonical byte encoding; never pickle, never Python's hash().

Any process, in any language, reproduces a hash from the tokens alone (BlockHasher documents
the bytes). Prefix-cache keys append the KV-cache group id to the hash. Requests hash at one
`hash_block_size`; a group with larger blocks reads them through BlockHashListWithBlockSize.
"""

import hashlib
import math
import struct
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import NewType, Protocol, overload

import msgspec
import xxhash

from protocol.buffers import pack_int32
from protocol.config import DEFAULT_HASH_SEED, HASH_ALGOS, CacheConfig, HashAlgo

GROUP_ID_NUM_BYTES = 4

BlockHash = NewType("BlockHash", bytes)  # the digest of one full block and its whole prefix
BlockHashWithGroupId = NewType(
    "BlockHashWithGroupId", bytes
)  # BlockHash + 4-byte big-endian group id

# A tagged extra key, such as ("cache_salt", "tenant-a") or ("lora", "adapter-7").
ExtraKey = tuple[str, str | int]

_EXTRA_KEY_ENCODER = msgspec.msgpack.Encoder()


class _HashObject(Protocol):
    def digest(self) -> bytes: ...


def _hash_constructor(algo: HashAlgo) -> Callable[[bytes], _HashObject]:
    """The hash object constructor of `algo`; `.digest()` of its result is the block hash."""
    if algo == "sha256":
        return hashlib.sha256
    if algo == "xxhash":
        return xxhash.xxh3_128
    raise ValueError(
        f"unknown prefix-caching hash algorithm {algo!r}: expected one of {HASH_ALGOS}"
    )


class BlockHasher:
    """Hashes full blocks of `block_size` tokens with one algorithm and one NONE_HASH seed.

    The bytes hashed for one block are, in order:
        parent digest       the previous block's hash, or NONE_HASH for the block at token 0
        u32 little-endian   the number of tokens in the block
        u32 little-endian   each token id
        msgpack             the extra keys, a list of [tag, value] pairs; absent when there are none
    """

    __slots__ = ("_block_bytes", "_header", "_new_hash", "algo", "block_size", "none_hash")

    def __init__(
        self, block_size: int, algo: HashAlgo = "sha256", seed: str = DEFAULT_HASH_SEED
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.algo = algo
        self.block_size = block_size
        self._new_hash = _hash_constructor(algo)
        self._header = block_size.to_bytes(4, "little")
        self._block_bytes = struct.Struct(f"{4 * block_size}s")  # one block's packed tokens
        self.none_hash: bytes = self._new_hash(b"kvserve.NONE_HASH\x00" + seed.encode()).digest()

    def hash_block(
        self,
        parent_hash: bytes | None,
        token_ids: Sequence[int] | array,
        extra_keys: Sequence[ExtraKey] = (),
    ) -> bytes:
        """The hash of one full block, chained on its parent's hash."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"a block holds {self.block_size} tokens, got {len(token_ids)}")
        parent = self.none_hash if parent_hash is None else parent_hash
        data = parent + self._header + pack_int32(token_ids)
        if extra_keys:
            data += _EXTRA_KEY_ENCODER.encode([list(key) for key in extra_keys])
        return self._new_hash(data).digest()

    def extend_hashes(
        self,
        block_hashes: list[BlockHash],
        token_ids: Sequence[int] | array,
        extra_keys: Sequence[ExtraKey] = (),
    ) -> None:
        """Append to `block_hashes` the hash of every full block of `token_ids` not hashed yet.

        `block_hashes` must hold the hashes of the first blocks of the same sequence; extra keys
        go on block 0 only. The new blocks' tokens are packed once, not block by block, and cut
        into the bytes that follow each parent digest before the chain runs.
        """
        block_size = self.block_size
        num_hashed = len(block_hashes)
        num_full = len(token_ids) // block_size
        if num_full <= num_hashed:
            return
        data = pack_int32(token_ids[num_hashed * block_size : num_full * block_size])
        header = self._header
        if num_hashed and num_full == num_hashed + 1:  # a decode filled one more block
            block_hashes.append(self._new_hash(block_hashes[-1] + header + data).digest())
            return
        # iter_unpack cuts the packed tokens into one bytes object per block in C.
        tails = [header + block for (block,) in self._block_bytes.iter_unpack(data)]
        if extra_keys and num_hashed == 0:
            tails[0] += _EXTRA_KEY_ENCODER.encode([list(key) for key in extra_keys])
        new_hash, append = self._new_hash, block_hashes.append
        parent = block_hashes[-1] if num_hashed else self.none_hash
        for tail in tails:
            # A BlockHash is plain bytes at run time: the NewType call would only cost a frame.
            parent = new_hash(parent + tail).digest()
            append(parent)

    def hash_prefix(
        self, token_ids: Sequence[int] | array, extra_keys: Sequence[ExtraKey] = ()
    ) -> list[BlockHash]:
        """Hashes of every full block of a token sequence; extra keys go on block 0 only."""
        hashes: list[BlockHash] = []
        self.extend_hashes(hashes, token_ids, extra_keys)
        return hashes


def get_hash_block_size(block_sizes: Iterable[int]) -> int:
    """The block size requests hash at: the gcd of the prefix-cached groups' block sizes.

    Every group's block size is then a whole number of hash blocks, which is the one rule vLLM
    0.33.0 puts on its groups (its default `hash_block_size` is this gcd too). With one block
    size, as in most models, it is that size and no group needs a view.
    """
    sizes = list(block_sizes)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"block sizes {sizes}: expected at least one, each at least 1")
    return math.gcd(*sizes)


class BlockHashListWithBlockSize(Sequence[BlockHash]):
    """A request's hashes at `hash_block_size`, seen as hashes of blocks of `block_size` tokens.

    Block i of `block_size` tokens ends where hash block `(i + 1) * scale - 1` ends (scale =
    block_size // hash_block_size). That hash already chains over every token before it, so it
    names the larger block and its whole prefix: the view indexes it and combines nothing, and
    it reads the list live (a hash appended later shows through). Prefix-cache keys append the
    group id, so a larger group's key never meets a smaller group's key for the same hash.

    | tokens      | 0-15 | 16-31 | 32-47 | 48-63 |   hash_block_size 16
    | hashes      | A    | B     | C     | D     |
    | view (32)   |      B       |      D        |
    """

    __slots__ = ("_block_hashes", "_scale")

    def __init__(
        self, block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
    ) -> None:
        if block_size % hash_block_size:
            raise ValueError(
                f"block_size={block_size} is not a multiple of hash_block_size={hash_block_size}"
            )
        self._block_hashes = block_hashes
        self._scale = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self._block_hashes) // self._scale

    def snapshot(self) -> list[BlockHash]:
        """The view's hashes as they are now, in a plain list (one slice, no call per item):
        what a lookup scans, since nothing appends to the request's hashes during one."""
        scale = self._scale
        return list(self._block_hashes[scale - 1 :: scale])

    @overload
    def __getitem__(self, idx: int) -> BlockHash: ...

    @overload
    def __getitem__(self, idx: slice) -> list[BlockHash]: ...

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"block {idx} of a view holding {len(self)} full blocks")
        return self._block_hashes[(idx + 1) * self._scale - 1]


def first_block_extra_keys(cache_salt: str | None) -> tuple[ExtraKey, ...]:
    """The extra keys of a request's first block; chaining carries them to every later block."""
    return () if cache_salt is None else (("cache_salt", cache_salt),)


def group_id_suffix(group_id: int) -> bytes:
    """What a prefix-cache key appends to a block hash: the group id as 4 big-endian bytes."""
    return group_id.to_bytes(GROUP_ID_NUM_BYTES, "big")


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> BlockHashWithGroupId:
    """The prefix-cache key: the hash bytes followed by `group_id_suffix(group_id)`."""
    return BlockHashWithGroupId(block_hash + group_id_suffix(group_id))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-GROUP_ID_NUM_BYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-GROUP_ID_NUM_BYTES:], "big")


def make_block_hasher(cache_config: CacheConfig, block_size: int) -> BlockHasher | None:
    """The hasher requests use with prefix caching on; None with it off (nothing is hashed)."""
    if not cache_config.enable_prefix_caching:
        return None
    return BlockHasher(block_size, cache_config.prefix_caching_hash_algo, cache_config.hash_seed)
