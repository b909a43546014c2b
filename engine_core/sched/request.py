"""Request: the engine's state of one generation request, from admission to finish.

Token ids (prompt plus generated) live in one int32 array. Block hashes grow incrementally as
blocks of those tokens fill up, generated tokens included.
"""

import enum
import hashlib
from array import array
from collections.abc import Sequence

from engine_core.kv_cache.hashing import (
    BlockHash,
    BlockHasher,
    ExtraKey,
    first_block_extra_keys,
)
from engine_core.sched.prompt_logprobs import PromptLogprobs
from protocol.buffers import pack_int32
from protocol.client_messages import FinishReason
from protocol.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again, its blocks freed; it will recompute
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One request's tokens, progress and prefix-cache hashes.

    Once built, a request changes only in the Scheduler (scheduler.py): its progress and status
    there, its tokens through the methods below; no other module assigns a field
    (tests/unit/test_request_state_owner.py checks it).

    Invariants: `num_computed_tokens <= num_tokens`; `block_hashes[i]` is the hash of tokens
    `[i * block_size, (i + 1) * block_size)` for every full block, and there is one per full block.
    The block size is the hasher's: the KV cache's `hash_block_size` (the gcd of its groups'
    block sizes); a group with larger blocks reads these through BlockHashListWithBlockSize.
    """

    __slots__ = (
        "_block_hasher",
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "client_id",
        "client_req_id",
        "encoder_token_ids",
        "eos_token_ids",
        "finishing_token_ids",
        "handle",
        "max_num_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "num_tokens_sent",
        "priority",
        "prompt_logprobs",
        "req_id",
        "sampling_params",
        "status",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: array | list[int],
        sampling_params: SamplingParams,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        eos_token_ids: Sequence[int] = (),
        block_hasher: BlockHasher | None = None,
        client_id: bytes = b"",
        handle: int = 0,
        client_req_id: str | None = None,
        encoder_token_ids: array | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """`max_model_len`: the longest sequence the engine serves, which caps this request's
        length with `max_tokens`; None for one that no scheduler serves (tests, benchmarks)."""
        self.req_id = req_id  # unique in the engine: the client's own id, scoped by its client
        self.client_req_id = req_id if client_req_id is None else client_req_id  # in outputs
        self.all_token_ids = array("i", prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(self.all_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # An encoder-decoder model's encoder input, whose K/V fill the cross-attention blocks.
        self.encoder_token_ids = encoder_token_ids
        self.eos_token_ids = eos_token_ids  # the model's: every id that ends a generation
        # Derived once from the frozen sampling params, for the stop rules on every step.
        self.finishing_token_ids = frozenset(
            sampling_params.stop_token_ids
            if sampling_params.ignore_eos
            else [*sampling_params.stop_token_ids, *eos_token_ids]
        )  # ids that finish it once min_tokens outputs exist: stop ids, EOS unless ignore_eos
        # The length cap: the request finishes once it holds this many tokens (stop.py).
        max_num_tokens = self.num_prompt_tokens + sampling_params.max_tokens
        if max_model_len is not None and max_model_len < max_num_tokens:
            max_num_tokens = max_model_len
        self.max_num_tokens = max_num_tokens
        self.client_id = client_id  # the ZMQ identity of the client that sent it
        self.handle = handle  # the integer name of this request on the engine-worker wire
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache, or scheduled to be
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.num_preemptions = 0
        self.num_tokens_sent = 0  # tokens the workers hold for this request
        # Tokens scheduled to be sampled whose values have not come back yet (0 or 1 in the
        # synchronous loop, up to 2 with asynchronous scheduling); the workers already hold them.
        self.num_output_placeholders = 0
        # its prompt_logprobs so far, gathered from the replies; None unless it asked for them
        self.prompt_logprobs = None if sampling_params.prompt_logprobs is None else PromptLogprobs()
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_encoder_tokens(self) -> int:
        return 0 if self.encoder_token_ids is None else len(self.encoder_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> array:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> array:
        return self.all_token_ids[self.num_prompt_tokens :]

    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.append_output_token_id(token_ids)
            return
        self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def append_output_token_id(self, token_id: int) -> None:
        """Append one sampled token: the decode fast path of `append_output_token_ids`."""
        tokens = self.all_token_ids
        tokens.append(token_id)
        # One more token completes a block exactly when the length reaches a block boundary.
        if self._block_hasher is not None and not len(tokens) % self._block_hasher.block_size:
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            block_hashes = self.block_hashes
            # Extra keys go on block 0 only: once it is hashed, they are never read again.
            extra_keys = () if block_hashes else self._first_block_extra_keys()
            self._block_hasher.extend_hashes(block_hashes, self.all_token_ids, extra_keys)

    def _first_block_extra_keys(self) -> tuple[ExtraKey, ...]:
        """The salt's keys, and a digest of the encoder input: every decoder block's K/V past
        the first cross-attention layer depend on it, so two requests share a prefix only when
        their encoder inputs are equal."""
        extra_keys = first_block_extra_keys(self.cache_salt)
        if self.encoder_token_ids is None:
            return extra_keys
        digest = hashlib.sha256(pack_int32(self.encoder_token_ids)).hexdigest()
        return (*extra_keys, ("encoder", digest))

    def check_invariants(self) -> None:
        """Holds between any two calls. With asynchronous scheduling the tokens that steps in
        flight will sample are placeholders, and a step may compute all but the latest of them:
        computed tokens may pass the known ones by one less than the placeholders."""
        num_placeholders = self.num_output_placeholders
        num_ahead = max(num_placeholders - 1, 0)
        assert (
            num_placeholders >= 0 and 0 <= self.num_computed_tokens <= self.num_tokens + num_ahead
        ), f"{self!r} with {num_placeholders} output placeholders"
        assert self.num_prompt_tokens <= self.num_tokens, repr(self)
        if self._block_hasher is not None:
            num_full_blocks = self.num_tokens // self._block_hasher.block_size
            assert len(self.block_hashes) == num_full_blocks, (
                f"{self!r} has {len(self.block_hashes)} block hashes, expected {num_full_blocks}"
            )

    def __lt__(self, other: "Request") -> bool:
        """Priority order: lower priority value first, then earlier arrival, then the handle."""
        return (self.priority, self.arrival_time, self.handle) < (
            other.priority,
            other.arrival_time,
            other.handle,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
