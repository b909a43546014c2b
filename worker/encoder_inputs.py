"""EncoderInputs: each request's encoder input on one rank, and which requests must compute their
encoder K/V in their next step (new ones, and resumed ones, whose cross-attention blocks are new).

It holds token ids only; it never touches a tensor of the KV cache.
"""

import numpy as np

from protocol.kv_cache_spec import CrossAttentionSpec, KVCacheConfig


class EncoderInputs:
    """Encoder token ids by request handle, kept while the request lives (parked ones too).

    Invariants: every held input is a non-empty int64 array; `pending` holds only held handles;
    with `is_required`, every request the rank was given brought an input (and none otherwise).
    """

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        self.is_required = any(
            isinstance(group.spec, CrossAttentionSpec) for group in kv_cache_config.kv_cache_groups
        )
        self.token_ids: dict[int, np.ndarray] = {}  # handle -> [num_encoder_tokens] int64
        self.pending: set[int] = set()  # handles whose encoder runs in their next scheduled step

    def add(self, handle: int, encoder_token_ids: bytes | None) -> None:
        """Hold a new request's input; its encoder runs when the request is next scheduled."""
        if not self.is_required:
            if encoder_token_ids is not None:
                raise ValueError(
                    f"new request {handle} brings encoder_token_ids, but the model has no "
                    "cross-attention layers"
                )
            return
        if encoder_token_ids is None or not encoder_token_ids or len(encoder_token_ids) % 4:
            size = None if encoder_token_ids is None else len(encoder_token_ids)
            raise ValueError(
                f"new request {handle} brings encoder_token_ids of {size} bytes: the "
                "encoder-decoder model expects a non-empty int32 array"
            )
        self.token_ids[handle] = np.frombuffer(encoder_token_ids, dtype="<i4").astype(np.int64)
        self.pending.add(handle)

    def resume(self, handle: int) -> None:
        """A preempted request comes back with new cross-attention blocks: encode it again."""
        if handle in self.token_ids:
            self.pending.add(handle)

    def forget(self, handle: int) -> None:
        self.token_ids.pop(handle, None)
        self.pending.discard(handle)

    def take_pending(self, handles: list[int]) -> list[int]:
        """Indices into `handles` (this step's requests) whose encoder runs in this step; they
        are no longer pending afterwards."""
        if not self.pending:
            return []
        idxs = [idx for idx, handle in enumerate(handles) if handle in self.pending]
        for idx in idxs:
            self.pending.discard(handles[idx])
        return idxs

    def num_encoder_tokens(self, handles: list[int]) -> np.ndarray:
        """[R] encoder tokens of each of `handles`; every one must hold an input."""
        return np.array([len(self.token_ids[handle]) for handle in handles], dtype=np.int64)

    def check_invariants(self, live_handles: set[int]) -> None:
        """Walk the inputs against the rank's live (batch or parked) requests."""
        assert self.pending <= self.token_ids.keys(), (
            f"pending encoders {sorted(self.pending - self.token_ids.keys())} have no input"
        )
        for handle, token_ids in self.token_ids.items():
            assert len(token_ids) > 0 and token_ids.dtype == np.int64, (
                f"request {handle} holds encoder input {token_ids.dtype} {token_ids.shape}"
            )
        expected = live_handles if self.is_required else set()
        assert self.token_ids.keys() == expected, (
            f"encoder inputs for {sorted(self.token_ids)}, live requests {sorted(live_handles)}"
        )
