"""The blocks a sliding-window group holds for one request, as the real KVCacheManager frees them,
never pass what capacity planning counts for it (`num_window_blocks`), prefix hits or not."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.kv_cache.hashing import BlockHasher
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    num_blocks_per_request,
    num_window_blocks,
)
from engine_core.sched.request import Request
from protocol.sampling import SamplingParams


def _groups(block_size: int, sliding_window: int) -> list[KVCacheGroupSpec]:
    dims = dict(block_size=block_size, num_kv_heads=1, head_dim=4, dtype="float32")
    return [
        KVCacheGroupSpec(["full.0"], FullAttentionSpec(**dims)),
        KVCacheGroupSpec(["window.0"], SlidingWindowSpec(**dims, sliding_window=sliding_window)),
    ]


def _serve_in_steps(manager: KVCacheManager, request: Request, num_per_step: int) -> int:
    """Admit the request with its prefix hits, then give it `num_per_step` tokens a step as the
    scheduler does (no whole-prompt reservation); the peak of window blocks it held."""
    hits, num_computed = manager.get_computed_blocks(request)
    num_new = min(num_per_step, request.num_tokens - num_computed)
    assert manager.allocate_slots(request, num_new, num_computed, hits) is not None
    request.num_computed_tokens = num_computed + num_new
    peak = 0
    while True:
        window_blocks = manager.coordinator.get_blocks(request.req_id)[1]
        peak = max(peak, sum(1 for block in window_blocks if not block.is_null))
        num_new = min(num_per_step, request.num_tokens - request.num_computed_tokens)
        if num_new == 0:
            return peak
        assert manager.allocate_slots(request, num_new) is not None, "a lone request must fit"
        request.num_computed_tokens += num_new


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 6),
    sliding_window=st.integers(1, 20),
    num_per_step=st.integers(1, 12),
    num_tokens=st.integers(2, 60),
)
def test_a_lone_request_fits_the_planned_blocks_and_its_window_stays_within_them(
    block_size: int, sliding_window: int, num_per_step: int, num_tokens: int
) -> None:
    """A pool of exactly the planned blocks (plus the null block) serves the request twice, the
    second time from the prefix cache; the window group never holds more than planned."""
    groups = _groups(block_size, sliding_window)
    num_blocks = num_blocks_per_request(groups, num_tokens, num_per_step) + 1
    manager = KVCacheManager(KVCacheConfig(num_blocks, groups), max_model_len=num_tokens)
    bound = num_window_blocks(groups[1].spec, num_per_step)
    prompt = [(7 * idx) % 50 + 3 for idx in range(num_tokens)]
    for req_id in ("cold", "warm"):
        request = Request(req_id, prompt, SamplingParams(), block_hasher=BlockHasher(block_size))
        assert _serve_in_steps(manager, request, num_per_step) <= bound
        manager.free(request)
        manager.check_invariants()
