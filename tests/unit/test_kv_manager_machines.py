"""The KVCacheManager state machine (kv_manager_machine.py), once per family of groups: full
attention and windows with the general-path twin, mixed block sizes, cross attention beside full
attention, chunked-local attention and R-SWA (each alone and beside full attention), and Mamba
state groups in planned batched steps (alone and beside full attention, both modes)."""

from hypothesis import settings
from kv_manager_machine import KVCacheManagerModelMachine
from kv_specs import chunked_local_spec, full_spec, rswa_spec, window_spec

from engine_core.kv_cache.spec import (
    CrossAttentionSpec,
    MambaSpec,
)


def mamba_spec(mode: str) -> MambaSpec:
    return MambaSpec(2, ((2, 2),), "float32", mamba_cache_mode=mode)


STEP_SETTINGS = settings(stateful_step_count=40, deadline=None)
MAMBA_STEP_SETTINGS = settings(stateful_step_count=30, deadline=None)


class ShortcutsMachine(KVCacheManagerModelMachine):
    """One full-attention group, its single-group shortcut against the general path."""

    specs = (full_spec(),)
    num_blocks = 20
    max_model_len = 32
    base_prompts = ([7] * 12, list(range(100, 112)), [1, 2] * 6)
    checks_shortcuts = True


class HybridShortcutsMachine(ShortcutsMachine):
    """Full attention beside a window, the in-place shortcut against the general path."""

    specs = (full_spec(), window_spec(5))
    num_blocks = 36


class WindowShortcutsMachine(ShortcutsMachine):
    """One group that skips blocks: no single-group shortcut, the in-place one instead."""

    specs = (window_spec(5),)


class LocalShortcutsMachine(ShortcutsMachine):
    """Every kind that skips blocks beside full attention, so each answers is_step_in_place."""

    specs = (full_spec(), window_spec(5), chunked_local_spec(4), rswa_spec(3))
    num_blocks = 64


class MambaMachine(KVCacheManagerModelMachine):
    """One align-mode Mamba group, in planned steps whose requests may be dropped once planned."""

    specs = (mamba_spec("align"),)
    num_blocks = 12
    max_model_len = 24
    base_prompts = ([7] * 12, list(range(100, 112)))
    max_suffix_len = 10
    plans_batches = True
    can_drop_planned = True


class HybridMambaMachine(MambaMachine):
    specs = (full_spec(), mamba_spec("align"))
    can_drop_planned = False
    num_blocks = 28


class OneBlockMambaMachine(MambaMachine):
    specs = (mamba_spec("none"),)
    num_blocks = 6


class HybridOneBlockMambaMachine(MambaMachine):
    specs = (full_spec(), mamba_spec("none"))
    can_drop_planned = False
    num_blocks = 20


class HybridAlignWithoutCachingMachine(MambaMachine):
    specs = (full_spec(), mamba_spec("align"))
    caching_choices = (False,)
    num_blocks = 20


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
TestKVCacheManagerMachine = ShortcutsMachine.TestCase
TestKVCacheManagerMachine.settings = STEP_SETTINGS
TestHybridKVCacheManagerMachine = HybridShortcutsMachine.TestCase
TestHybridKVCacheManagerMachine.settings = STEP_SETTINGS
TestWindowKVCacheManagerMachine = WindowShortcutsMachine.TestCase
TestWindowKVCacheManagerMachine.settings = STEP_SETTINGS
TestLocalKVCacheManagerMachine = LocalShortcutsMachine.TestCase
TestLocalKVCacheManagerMachine.settings = STEP_SETTINGS
TestMambaMachine = MambaMachine.TestCase
TestMambaMachine.settings = MAMBA_STEP_SETTINGS
TestHybridMambaMachine = HybridMambaMachine.TestCase
TestHybridMambaMachine.settings = MAMBA_STEP_SETTINGS
TestOneBlockMambaMachine = OneBlockMambaMachine.TestCase
TestOneBlockMambaMachine.settings = MAMBA_STEP_SETTINGS
TestHybridOneBlockMambaMachine = HybridOneBlockMambaMachine.TestCase
TestHybridOneBlockMambaMachine.settings = MAMBA_STEP_SETTINGS
TestHybridAlignWithoutCachingMachine = HybridAlignWithoutCachingMachine.TestCase
TestHybridAlignWithoutCachingMachine.settings = MAMBA_STEP_SETTINGS
