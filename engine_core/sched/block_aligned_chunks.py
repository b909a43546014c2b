"""BlockAlignedChunks: where a prefill chunk may end when a Mamba group checkpoints its state in
align mode. Pure arithmetic on token counts; the Scheduler asks it, it decides nothing else.

A recurrent state is written only where a step ends, so a boundary state a later prefix hit
could resume from exists only if some chunk ends exactly there.
"""

from dataclasses import dataclass

from engine_core.kv_cache.kv_request import KVCacheRequest
from protocol.config import CacheConfig, SchedulerConfig
from protocol.kv_cache_spec import KVCacheConfig, MambaSpec


@dataclass(frozen=True, slots=True)
class BlockAlignedChunks:
    """Clips prefill chunks to end on block boundaries, as the reference requires of align mode.

    ```
    prompt 10, block 4:  | 0..4 | 4..8 | 8..10 |   every chunk but the last ends on a boundary,
                                ^ 8: the last boundary an identical prompt's hit could reach
    ```
    """

    block_size: int  # tokens per block, the spacing of the checkpoints
    max_chunk_tokens: int  # the most tokens a step ever gives one prefill

    @classmethod
    def for_configs(
        cls,
        kv_cache_config: KVCacheConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
    ) -> "BlockAlignedChunks | None":
        """The clipper when an align-mode Mamba group checkpoints states; None otherwise, and
        without a prefix cache (no checkpoint) or chunked prefill (a prompt is one step)."""
        if not (cache_config.enable_prefix_caching and scheduler_config.enable_chunked_prefill):
            return None
        for group in kv_cache_config.kv_cache_groups:
            spec = group.spec
            if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
                max_chunk_tokens = scheduler_config.max_num_batched_tokens
                threshold = scheduler_config.long_prefill_token_threshold
                if threshold:
                    max_chunk_tokens = min(max_chunk_tokens, threshold)
                return cls(spec.block_size, max_chunk_tokens)
        return None

    def clip(
        self,
        request: KVCacheRequest,
        num_computed_tokens: int,
        num_new_tokens: int,
        shared_prefix_boundary: int = 0,
    ) -> int:
        """The tokens to schedule from `num_computed_tokens` (hits included): at most
        `num_new_tokens`, possibly 0 when not even one block's worth fits this step.

        Decode steps (and a resumed request's last token) pass unchanged. A chunk that does not
        end the prefill ends on a block boundary, and no chunk runs past the last boundary
        before `num_tokens` (the farthest a hit on an identical prompt reaches, since the last
        token is always computed) or past the next boundary when it starts mid-block.

        `shared_prefix_boundary` is the request's junction (KVCacheBlocks): how far a group
        other than this one hit, past the state this one holds. No chunk runs past the last
        boundary before it either, so the state there is written and the next request sharing
        that prefix resumes from it, as the reference's scheduler stops there.
        """
        block_size = self.block_size
        start = num_computed_tokens
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if start >= prefill_end:
            return num_new_tokens
        end = start + num_new_tokens
        if end < prefill_end:
            aligned_end = end // block_size * block_size
            # A block wider than any step's chunk can only be crossed in pieces.
            if aligned_end > start or block_size <= self.max_chunk_tokens:
                end = aligned_end
        last_boundary = (request.num_tokens - 1) // block_size * block_size
        next_boundary = (start // block_size + 1) * block_size
        junction_stop = 0
        if start < shared_prefix_boundary < end:
            junction_stop = start + (shared_prefix_boundary - start) // block_size * block_size
        stops = (last_boundary, next_boundary if start % block_size else 0, junction_stop)
        for stop in stops:
            if start < stop < end:
                end = stop
        return max(end - start, 0)
