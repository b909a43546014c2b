"""Messages between the engine's worker ROUTER socket and the workers (one DEALER per rank).

On this wire a request is named by an integer handle that the engine assigns and never reuses;
the client's string req_id stays on the engine. Per-request columns are int32 bytes.
"""

from typing import Annotated

import msgspec

from protocol.kv_cache_spec import KVCacheConfig, KVCacheGroupSpec
from protocol.kv_transfer import KVTransferOrders
from protocol.sampling import SamplingParams

Rank = Annotated[int, msgspec.Meta(ge=0)]
NumBlocks = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # a count of blocks, int32


class ModelInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the engine needs to know of the model that every rank runs; all ranks must agree."""

    name: str
    vocab_size: int
    eos_token_ids: list[int]  # every id that ends a generation (unless ignore_eos); [] for none
    max_model_len: int  # longest sequence (prompt plus output) the model supports, in tokens
    kv_cache_groups: list[KVCacheGroupSpec]  # the model's layers grouped by spec
    # Why the ranks cannot compute prompt logits (prompt_logprobs); None: they can
    prompt_logits_refusal: str | None = None
    # What names the weights (worker/kv_transfer.model_fingerprint): a P/D pair must agree on
    # it; "" when unknown
    fingerprint: str = ""


class WorkerHello(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The first message of a worker: who it is and how many blocks its memory can hold."""

    protocol_version: int
    rank: Rank
    tp_size: Annotated[int, msgspec.Meta(ge=1)]
    pid: int
    host: str
    device: str  # "cpu" or "cuda:N"
    model_info: ModelInfo
    num_blocks_available: int  # blocks this rank could allocate for the whole model
    # This boot of this machine (Linux's boot_id), None if unknown: ranks whose host_id is the
    # engine's may take their steps over the shared-memory ring (a hostname can repeat).
    host_id: str | None = None
    is_shm_ring_capable: bool = False  # the rank can map the engine's ring and read steps off it


class WorkerReady(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The worker allocated exactly `num_blocks` blocks per layer."""

    rank: Rank
    num_blocks: int
    generation: int = 1  # the one its KVCacheConfig named
    # it attached to the KVCacheConfig's ring as a reader; False for a rank the config named
    # as one: it could not, and takes its steps over ZMQ (the engine releases its reader slot)
    is_shm_ring_attached: bool = False
    # where this rank serves pulls of its pinned blocks (a prefill engine's rank, when the
    # KVCacheConfig named a kv_transfer_address); None: it serves none
    kv_transfer_endpoint: str | None = None


class NewRequestData(msgspec.Struct, frozen=True, array_like=True):
    """A request the workers have not seen: everything they need to run it."""

    handle: int  # engine-assigned, never reused; the client's req_id stays on the engine
    prompt_token_ids: bytes  # int32 little-endian
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # one list per KV-cache group
    num_computed_tokens: int  # tokens already in the cache (prefix hit) before this step
    # int32 little-endian: the encoder input whose K/V the workers write into the cross-attention
    # blocks when the request is first scheduled (and again when it resumes); None: no encoder
    encoder_token_ids: bytes | None = None
    # Leading prompt_token_ids that are the client's prompt; None: all of them. A request sent
    # again whole after a rank fault carries its generated tokens too, and R-SWA layers must
    # still keep only the real prompt visible.
    num_prompt_tokens: int | None = None


class CachedRequestData(msgspec.Struct, frozen=True, array_like=True):
    """Deltas for requests the workers already hold, as int32 columns aligned by position."""

    # int32: the engine-assigned handle of each request
    handles: bytes = b""
    # handles resumed after preemption: their new_block_ids replace their tables
    resumed_handles: list[int] = []
    # int32: the tokens each request gained since the workers last saw it, concatenated
    new_token_ids: bytes = b""
    # int32 per request: how many of new_token_ids are its own
    num_new_token_ids: bytes = b""
    # per request, None or one list per group: appended to its table; replaces it for resumed
    new_block_ids: list[tuple[list[int], ...] | None] = []
    # int32 per request: tokens already in the cache before this step
    num_computed_tokens: bytes = b""


class KVTransfers(msgspec.Struct, frozen=True, array_like=True):
    """One step's copies between the device pool and the tiers below it (DESIGN.md §3.5).

    The engine decides every move; each rank runs the four lists in field order before the
    step's forward, so a page or slot is always read before a later list overwrites it. Each
    list is int32 little-endian (source, destination) pairs. A slot is one block id's pages in
    every shared KV tensor of the rank (protocol.kv_cache_spec.bytes_per_block).
    """

    host_to_disk: bytes = b""  # (host slot, disk slot): a host victim moves down to the disk tier
    device_to_host: bytes = b""  # (block id, host slot): an evicted device page moves down
    disk_to_host: bytes = b""  # (disk slot, host slot): checksum verified; failures are reported
    host_to_device: bytes = b""  # (host slot, block id): a lower-tier hit is copied in


class GrammarBitmask(msgspec.Struct, frozen=True, array_like=True):
    """The tokens each constrained request of a step may sample (structured outputs).

    Row r of `bitmask` belongs to the request at `req_idxs[r]`, its place in SchedulerOutput
    order (new requests, then cached ones); only requests that sample this step have a row. Bit
    i of word w allows token id 32 * w + i; a row is ceil(vocab_size / 32) words wide.
    """

    req_idxs: bytes  # int32, ascending
    bitmask: bytes  # int32 little-endian, [len(req_idxs), ceil(vocab_size / 32)] row-major


class SchedulerOutput(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """One step's work, broadcast unchanged to every rank."""

    step_id: int  # 1, 2, 3...; every rank checks continuity
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: bytes  # int32 per request: new requests first, then cached ones, in order
    total_num_scheduled_tokens: int
    finished_handles: list[int]  # requests the workers must forget
    preempted_handles: list[int]  # requests whose blocks were freed; a later step resumes them
    generation: int = 1  # the worker generation it is for; a rank of another one refuses it
    # Per KV-cache group, the leading blocks every running request's table shares once this
    # step's blocks are allocated (cascade attention reads them once); []: none reported
    num_common_prefix_blocks: list[NumBlocks] = []
    kv_transfers: KVTransfers | None = None  # None: no tier traffic this step
    grammar_bitmask: GrammarBitmask | None = None  # None: no constrained request samples
    kv_transfer_orders: KVTransferOrders | None = None  # P/D pins and pulls; None: none
    # Asynchronous scheduling: this step's grammar bitmask is sent after it, in a
    # StepGrammarBitmask, once the engine has the previous step's tokens; each rank runs the
    # forward, then waits for it before sampling. grammar_bitmask is None then.
    grammar_bitmask_follows: bool = False


class ModelRunnerOutput(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """One rank's result for one step: a sampled token per scheduled request."""

    step_id: int
    rank: int
    handles: bytes  # int32, the scheduled requests in SchedulerOutput order
    sampled_token_ids: bytes  # int32, one per request (meaningless for a partial prefill chunk)
    generation: int = 1  # the step's; the engine drops replies of an older generation
    # One entry per sampled request that asked for logprobs, in `handles` order, N being its
    # sampling_params.logprobs; the model's raw distribution (before temperature and filters).
    logprobs: bytes = b""  # float32: the sampled token's logprob, then its top-N alternatives'
    logprob_token_ids: bytes = b""  # int32, aligned with logprobs: the sampled id, the top N
    sampled_token_ranks: bytes = b""  # int32 per such request: 1 is the most likely token
    forward_s: float = 0.0  # seconds this rank spent in the model's forward, all-reduces included
    # int32 disk slots of this step's kv_transfers that hold no valid copy on this rank: a read
    # whose checksum failed (its host destination is then empty too) or a write that failed.
    failed_disk_slots: bytes = b""
    # One entry per prompt token this step scored for a request that asked for prompt_logprobs
    # (worker/sampling/prompt_logprobs.py), in `handles` order then position order; each entry
    # is that token then its request's top-N, as for `logprobs` (raw distribution).
    prompt_logprobs: bytes = b""  # float32
    prompt_logprob_token_ids: bytes = b""  # int32, aligned with prompt_logprobs
    prompt_logprob_ranks: bytes = b""  # int32 per entry: the prompt token's rank
    # P/D pulls (KVPull.pull_id) that ended on this rank since its previous reply, each reported
    # once; a pull runs beside the steps, from the step that ordered it
    finished_kv_pulls: list[int] = []
    failed_kv_pulls: list[int] = []  # those of finished_kv_pulls that failed
    kv_pull_bytes: int = 0  # bytes those pulls moved to this rank
    # pulls of this rank's pinned blocks it refused since its previous reply (a forged, stale or
    # foreign handle, another layout, a peer with other CURVE keys)
    num_refused_kv_pulls: int = 0


class WorkerFailed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    rank: int
    step_id: int | None  # the step being executed, or None during startup
    error: str
    generation: int | None = None  # the rank's generation, or None before its KVCacheConfig


class StepGrammarBitmask(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The grammar bitmask of a step sent with `grammar_bitmask_follows` (asynchronous scheduling).

    Step N+1 is broadcast while the ranks run step N, before the engine knows step N's tokens;
    a constrained request's next bitmask depends on them. The engine sends this right after it
    applies step N's reply, and before step N+2, so each rank reads it after step N+1 and before
    N+2 on the same channel (ring or DEALER). It names the step and its generation; a rank checks
    both against the step it is about to sample.
    """

    step_id: int
    generation: int
    grammar_bitmask: GrammarBitmask


class Shutdown(msgspec.Struct, frozen=True, tag=True, array_like=True):
    reason: str
    is_failure: bool = False  # the deployment failed (a rank died): workers exit non-zero
    generation: int | None = None  # the generation told to exit; None: whoever receives it


EngineToWorker = KVCacheConfig | SchedulerOutput | StepGrammarBitmask | Shutdown
WorkerToEngine = WorkerHello | WorkerReady | ModelRunnerOutput | WorkerFailed
