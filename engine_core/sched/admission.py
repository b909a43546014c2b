"""Admission: which client requests may queue (the waiting bound and each client's share), the
engine's key for a client's request id, and the Request built from an accepted one. Pure
bookkeeping, no I/O; the Scheduler calls it.
"""

import itertools
from dataclasses import dataclass

from engine_core.kv_cache.hashing import BlockHasher
from engine_core.sched.request import Request
from engine_core.sched.validation import validate_encoder_tokens, validate_request
from protocol.client_messages import EngineCoreRequest
from protocol.config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class HeldRequests:
    """What the engine holds outside the scheduler (requests whose grammars compile), as it
    bears on one incoming request: they are live and waiting like the scheduler's own."""

    num_waiting: int = 0  # every client's
    num_client_live: int = 0  # the incoming request's client's
    is_live: bool = False  # whether that client holds one under the incoming request's id


NONE_HELD = HeldRequests()


def scoped_req_id(client_id: bytes, req_id: str) -> str:
    """The engine's key of a client's request. The in-process caller (client id b"") keeps its
    own ids; a socket client's identity is never empty, so keys of two clients never collide."""
    return f"{client_id.hex()}/{req_id}" if client_id else req_id


class Admission:
    """Bounds on queued work, checked before a request is accepted.

    Invariants: `num_live_by_client` holds, per client, the number of its requests the scheduler
    holds (waiting or running), and no zero entries.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.max_num_waiting_requests = config.max_num_waiting_requests
        self.max_num_requests_per_client = config.max_num_requests_per_client
        self.num_live_by_client: dict[bytes, int] = {}

    def check(
        self, client_id: bytes, client_req_id: str, num_waiting: int, num_held: int = 0
    ) -> None:
        """ValueError with a "busy, retry" reason when the queue or the client's share is full.
        `num_held`: the client's live requests the engine holds outside the scheduler (their
        grammars compiling), which count toward its share."""
        if num_waiting >= self.max_num_waiting_requests:
            raise ValueError(
                f"engine busy: {num_waiting} requests are waiting "
                f"(max_num_waiting_requests={self.max_num_waiting_requests}); "
                f"retry {client_req_id!r} later"
            )
        num_live = self.num_live_by_client.get(client_id, 0) + num_held
        if num_live >= self.max_num_requests_per_client:
            raise ValueError(
                f"client busy: it has {num_live} live requests "
                f"(max_num_requests_per_client={self.max_num_requests_per_client}); "
                f"retry {client_req_id!r} when one finishes"
            )

    def on_admitted(self, client_id: bytes) -> None:
        self.num_live_by_client[client_id] = self.num_live_by_client.get(client_id, 0) + 1

    def on_finished(self, client_id: bytes) -> None:
        num_live = self.num_live_by_client[client_id] - 1
        if num_live:
            self.num_live_by_client[client_id] = num_live
        else:
            del self.num_live_by_client[client_id]

    def num_live(self, client_id: bytes) -> int:
        return self.num_live_by_client.get(client_id, 0)

    def check_invariants(self, client_ids: list[bytes]) -> None:
        """`client_ids`: the client of every live request, one entry per request."""
        counted: dict[bytes, int] = {}
        for client_id in client_ids:
            counted[client_id] = counted.get(client_id, 0) + 1
        assert counted == self.num_live_by_client, (
            f"live requests per client {counted}, admission counted {self.num_live_by_client}"
        )


class RequestIntake:
    """Checks a client's request against the model and the queue bounds and builds its Request.

    Each built Request gets a fresh handle (the workers' key for it); 0 is never a live handle.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: list[int],
        max_num_encoder_tokens: int | None,
        block_hasher: BlockHasher | None,
        prompt_logits_refusal: str | None = None,  # why the ranks cannot: ModelInfo's
    ) -> None:
        self.admission = Admission(config)
        self.prompt_logits_refusal = prompt_logits_refusal
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_num_encoder_tokens = max_num_encoder_tokens
        self._block_hasher = block_hasher
        self._handles = itertools.count(1)

    def build(
        self,
        request: EngineCoreRequest,
        client_id: bytes,
        num_waiting: int,
        is_live: bool,
        num_held: int = 0,
    ) -> Request:
        """The queued Request, or ValueError naming what is wrong or which bound is full.

        `is_live`: whether the client already has a live request with this id; `num_held`: as
        for `Admission.check`."""
        self.admission.check(client_id, request.req_id, num_waiting, num_held)
        prompt, params = validate_request(request, self.max_model_len, self.vocab_size, is_live)
        if params.prompt_logprobs is not None and self.prompt_logits_refusal is not None:
            raise ValueError(
                f"bad sampling parameters: prompt_logprobs={params.prompt_logprobs} of "
                f"{request.req_id!r} cannot be served: {self.prompt_logits_refusal}; expected null"
            )
        encoder = validate_encoder_tokens(request, self.max_num_encoder_tokens, self.vocab_size)
        return Request(
            scoped_req_id(client_id, request.req_id),
            prompt,
            params,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            eos_token_ids=self.eos_token_ids,
            block_hasher=self._block_hasher,
            client_id=client_id,
            handle=next(self._handles),
            client_req_id=request.req_id,
            encoder_token_ids=encoder,
            max_model_len=self.max_model_len,
        )
