"""Block hashing: the documented canonical encoding, chaining, tagged extra keys and group-id
keys. tests/integration/test_hash_interpreters.py checks another interpreter's digests."""

import hashlib
from array import array

import msgspec
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kv_hashing.block_hasher import (
    DEFAULT_HASH_SEED,
    HASH_ALGOS,
    BlockHasher,
    first_block_extra_keys,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

BLOCK_SIZE = 4


def spec_digest(algo: str, parent: bytes, token_ids: list[int], extra_keys: list) -> bytes:
    """The encoding as hashing.py documents it, written out independently of its code."""
    data = parent + len(token_ids).to_bytes(4, "little")
    data += b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids)
    if extra_keys:
        data += msgspec.msgpack.encode([list(key) for key in extra_keys])
    if algo == "sha256":
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_block_hash_follows_the_documented_encoding(algo: str) -> None:
    hasher = BlockHasher(BLOCK_SIZE, algo)
    salt = [("cache_salt", "tenant-a")]
    first = hasher.hash_block(None, [1, 2, 3, 4], salt)
    assert first == spec_digest(algo, hasher.none_hash, [1, 2, 3, 4], salt)
    second = hasher.hash_block(first, [5, 6, 7, 8])
    assert second == spec_digest(algo, first, [5, 6, 7, 8], [])
    assert len(first) == (32 if algo == "sha256" else 16)


def test_none_hash_derives_from_a_fixed_default_seed() -> None:
    assert (
        BlockHasher(BLOCK_SIZE).none_hash
        == BlockHasher(BLOCK_SIZE, seed=DEFAULT_HASH_SEED).none_hash
    )
    assert BlockHasher(BLOCK_SIZE).none_hash != BlockHasher(BLOCK_SIZE, seed="other").none_hash
    expected = hashlib.sha256(b"kvserve.NONE_HASH\x00" + DEFAULT_HASH_SEED.encode()).digest()
    assert BlockHasher(BLOCK_SIZE).none_hash == expected


def test_hash_chains_over_the_whole_prefix() -> None:
    hasher = BlockHasher(BLOCK_SIZE)
    a = hasher.hash_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    b = hasher.hash_prefix([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same block tokens, different parent
    assert a[1] == hasher.hash_block(a[0], [5, 6, 7, 8])


def test_hash_prefix_hashes_only_full_blocks() -> None:
    hasher = BlockHasher(BLOCK_SIZE)
    assert len(hasher.hash_prefix(list(range(11)))) == 2
    assert hasher.hash_prefix([1, 2, 3]) == []


def test_cache_salt_goes_on_the_first_block_and_chaining_carries_it() -> None:
    hasher = BlockHasher(BLOCK_SIZE)
    tokens = list(range(8))
    plain = hasher.hash_prefix(tokens)
    salted = hasher.hash_prefix(tokens, first_block_extra_keys("s"))
    assert plain[0] != salted[0] and plain[1] != salted[1]
    assert salted[1] == hasher.hash_block(salted[0], tokens[4:])
    assert first_block_extra_keys(None) == ()


def test_extra_keys_are_tagged_so_kinds_never_collide() -> None:
    hasher = BlockHasher(BLOCK_SIZE)
    salt = hasher.hash_block(None, [1, 2, 3, 4], [("cache_salt", "x")])
    lora = hasher.hash_block(None, [1, 2, 3, 4], [("lora", "x")])
    assert salt != lora


@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=40))
def test_list_and_int32_array_tokens_hash_alike(tokens: list[int]) -> None:
    hasher = BlockHasher(BLOCK_SIZE, "xxhash")
    hashes = hasher.hash_prefix(tokens)
    assert hashes == hasher.hash_prefix(array("i", tokens))
    parent = None
    for idx, block_hash in enumerate(hashes):
        parent = hasher.hash_block(parent, tokens[idx * BLOCK_SIZE : (idx + 1) * BLOCK_SIZE])
        assert block_hash == parent


def test_block_hash_with_group_id_is_hash_then_four_big_endian_bytes() -> None:
    block_hash = BlockHasher(BLOCK_SIZE).hash_block(None, [1, 2, 3, 4])
    key = make_block_hash_with_group_id(block_hash, 258)
    assert key == block_hash + b"\x00\x00\x01\x02"
    assert get_block_hash(key) == block_hash and get_group_id(key) == 258
    assert make_block_hash_with_group_id(block_hash, 0) != make_block_hash_with_group_id(
        block_hash, 1
    )


def test_bad_arguments_raise_with_the_value() -> None:
    with pytest.raises(ValueError, match="block_size must be at least 1, got 0"):
        BlockHasher(0)
    with pytest.raises(ValueError, match="unknown prefix-caching hash algorithm 'md5'"):
        BlockHasher(BLOCK_SIZE, "md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a block holds 4 tokens, got 3"):
        BlockHasher(BLOCK_SIZE).hash_block(None, [1, 2, 3])
