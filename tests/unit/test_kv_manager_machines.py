"""The KVCacheManager state machine (kv_manager_machine.py), once per family of groups: mixed
block sizes, cross attention beside full attention, chunked-local attention and R-SWA (each
alone and beside full attention)."""

from hypothesis import settings
from kv_manager_machine import KVCacheManagerModelMachine
from kv_specs import full_spec, window_spec

from engine_core.kv_cache.spec import ChunkedLocalAttentionSpec, CrossAttentionSpec, RSWASpec


def chunked_local_spec(attention_chunk_size: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=2,
        num_kv_heads=1,
        head_dim=4,
        dtype="float32",
        attention_chunk_size=attention_chunk_size,
    )


def rswa_spec(rswa_window: int) -> RSWASpec:
    return RSWASpec(
        block_size=2, num_kv_heads=1, head_dim=4, dtype="float32", rswa_window=rswa_window
    )


STEP_SETTINGS = settings(stateful_step_count=40, deadline=None)


class MixedBlockSizesMachine(KVCacheManagerModelMachine):
    """Full attention in blocks of 2 beside a window in blocks of 4: hashes at 2, hits at 4."""

    specs = (full_spec(2), window_spec(5, 4))
    num_blocks = 40


class LargerFullBlocksMachine(KVCacheManagerModelMachine):
    """Full attention in the larger blocks: it reads the view, the window the plain hashes."""

    specs = (full_spec(4), window_spec(3, 2))
    num_blocks = 40


class ThreeSizesMachine(KVCacheManagerModelMachine):
    """Block sizes 2, 4 and 6: hashes at 2, hits on multiples of 12."""

    specs = (full_spec(2), window_spec(5, 4), window_spec(7, 6))
    num_blocks = 60


class CrossAttentionMachine(KVCacheManagerModelMachine):
    """Full attention beside cross attention, with recurring encoder inputs, caching on or off."""

    specs = (
        full_spec(),
        CrossAttentionSpec(
            block_size=2, num_kv_heads=1, head_dim=4, dtype="float32", max_num_encoder_tokens=5
        ),
    )
    num_blocks = 24
    max_model_len = 16
    max_chunk_tokens = 5
    base_prompts = ([7] * 8, list(range(100, 108)))
    max_suffix_token = 2
    max_suffix_len = 6
    encoder_inputs = ((1, 2, 3), (4, 5), (1, 2, 3, 4, 5))  # a few, so equal inputs recur
    caching_choices = (True, False)


class ChunkedLocalAttentionMachine(KVCacheManagerModelMachine):
    """One chunked-local group: a token reads only its own chunk of 4."""

    specs = (chunked_local_spec(4),)
    num_blocks = 16
    max_model_len = 24
    max_chunk_tokens = 5
    base_prompts = ([7] * 10, list(range(100, 110)))
    max_suffix_token = 2
    max_suffix_len = 10


class HybridChunkedLocalAttentionMachine(KVCacheManagerModelMachine):
    """Full attention beside a chunked-local group whose chunk is 3 blocks of 2."""

    specs = (full_spec(), chunked_local_spec(6))
    num_blocks = 30
    max_model_len = 32
    base_prompts = ([7] * 12, list(range(100, 112)), [1, 2] * 6)


class RSWAMachine(ChunkedLocalAttentionMachine):
    """One R-SWA group: a token reads the prompt and the 3 tokens before it."""

    specs = (rswa_spec(3),)


class HybridRSWAMachine(HybridChunkedLocalAttentionMachine):
    """Full attention beside R-SWA: hits stop at the prompt in both groups."""

    specs = (full_spec(), rswa_spec(3))
    num_blocks = 40


TestMixedBlockSizesMachine = MixedBlockSizesMachine.TestCase
TestMixedBlockSizesMachine.settings = STEP_SETTINGS
TestLargerFullBlocksMachine = LargerFullBlocksMachine.TestCase
TestLargerFullBlocksMachine.settings = STEP_SETTINGS
TestThreeSizesMachine = ThreeSizesMachine.TestCase
TestThreeSizesMachine.settings = STEP_SETTINGS
TestCrossAttentionMachine = CrossAttentionMachine.TestCase
TestCrossAttentionMachine.settings = STEP_SETTINGS
TestChunkedLocalAttentionMachine = ChunkedLocalAttentionMachine.TestCase
TestChunkedLocalAttentionMachine.settings = STEP_SETTINGS
TestHybridChunkedLocalAttentionMachine = HybridChunkedLocalAttentionMachine.TestCase
TestHybridChunkedLocalAttentionMachine.settings = STEP_SETTINGS
TestRSWAMachine = RSWAMachine.TestCase
TestRSWAMachine.settings = STEP_SETTINGS
TestHybridRSWAMachine = HybridRSWAMachine.TestCase
TestHybridRSWAMachine.settings = STEP_SETTINGS
