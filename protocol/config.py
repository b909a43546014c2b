"""Typed configuration: the single source of defaults and bounds for the engine and the workers.

deploy/ builds these from flags; engine_core/ and worker/ receive them and never read argv or the
environment. `checked()` validates bounds, since msgspec checks them only on decode.
"""

import enum
from typing import Annotated, Literal, Self, get_args

import msgspec

from protocol.bounds import checked_copy

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=1024)]
TPSize = Annotated[int, msgspec.Meta(ge=1, le=64)]
HashAlgo = Literal["sha256", "xxhash"]  # the prefix-caching block hash algorithms
HASH_ALGOS: tuple[HashAlgo, ...] = get_args(HashAlgo)
# An engine's part in disaggregated prefill and decode (DESIGN.md §12): a prefill engine holds a
# request's blocks for a decode engine once its prompt is computed; a decode engine pulls them.
KVRole = Literal["prefill", "decode", "both"]
KV_ROLES: tuple[KVRole, ...] = get_args(KVRole)
# How P/D pages move between ranks: builtin (ZeroMQ: a /dev/shm segment over ipc://, frames over
# tcp://), nixl (READs through NIXL, which must be installed), or auto (nixl where it imports and
# the peer rank has it too, else builtin)
KVTransport = Literal["auto", "builtin", "nixl"]
DEFAULT_HASH_SEED = "kvserve"


class SchedulingPolicy(enum.StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class _Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    def checked(self) -> Self:
        """Return a copy whose bounds were checked, or raise ValueError naming the field."""
        try:
            return checked_copy(self)
        except msgspec.ValidationError as exc:
            raise ValueError(f"bad {type(self).__name__}: {exc}") from None


class CacheConfig(_Config, frozen=True):
    block_size: BlockSize = 16  # tokens per block
    gpu_memory_utilization: Fraction = 0.9  # share of the device
    kv_cache_memory_bytes: PositiveInt | None = None  # KV bytes per rank; None: profiling.py
    num_gpu_blocks_override: Annotated[int, msgspec.Meta(ge=2)] | None = None  # forces num_blocks
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: HashAlgo = "sha256"
    hash_seed: str = DEFAULT_HASH_SEED  # NONE_HASH derives from it; a fleet's engines must agree
    kv_cache_metrics: bool = False  # time sampled blocks: lifetime, idle before eviction, reuse
    kv_cache_metrics_sample: Fraction = 0.01  # share of block allocations timed
    # Tokens between the boundaries where a sliding-window group keeps its blocks indexed for
    # prefix hits (each interval's end, plus each prompt's replay boundary); None keeps all.
    prefix_cache_retention_interval: PositiveInt | None = None
    # Tiers below the pool (DESIGN.md §3.5), as vLLM's --kv-offloading-size: bytes over all
    # ranks together; 0 turns a tier off. A disk tier needs a host tier above it.
    kv_offload_host_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    kv_offload_disk_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    kv_offload_disk_dir: str | None = None  # one preallocated file per rank in this folder

    def __post_init__(self) -> None:
        interval = self.prefix_cache_retention_interval
        if interval is not None and interval % self.block_size:
            raise ValueError(
                f"prefix_cache_retention_interval {interval}: expected a positive multiple of "
                f"block_size {self.block_size}"
            )


class SchedulerConfig(_Config, frozen=True):
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 256  # running requests at most
    max_num_batched_tokens: PositiveInt = 2048  # tokens per step at most
    max_model_len: PositiveInt | None = None  # tokens per sequence; None takes the model's own
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: PositiveInt | None = None  # cap on one prefill's tokens per step
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    reserve_full_prompt: bool = True  # admit a request only when its whole prompt fits
    # Past either bound a new request is refused at once with a "busy, retry" reason.
    max_num_waiting_requests: PositiveInt = 4096  # queued, not yet running, over all clients
    max_num_requests_per_client: PositiveInt = 1024  # live (waiting or running) per client
    # Schedule and send step N+1 while the ranks run step N (DESIGN.md §1): the engine's own
    # time per step hides behind the model's. Tokens are those of the synchronous loop.
    async_scheduling: bool = True


class KVEventsConfig(_Config, frozen=True):
    enable_kv_cache_events: bool = False
    endpoint: str = "tcp://*:5557"  # PUB socket
    replay_endpoint: str | None = None  # ROUTER socket answering replays of recent batches
    topic: str = ""
    buffer_steps: PositiveInt = 10000  # batches kept for replay


class CurveKeys(_Config, frozen=True):
    """One process's CURVE keys, as Z85 text (40 characters each); deploy/ loads them from the
    folder `kvserve keygen` writes, so engine_core/ and worker/ never read key files."""

    public_key: str  # this process's own
    secret_key: str  # this process's own
    server_public_key: str  # the engine's; on the engine, its own public key
    authorized_keys: list[str] = []  # the engine only: the client and worker keys it admits


class EngineConfig(_Config, frozen=True):
    tp_size: TPSize = 1
    client_address: str = "ipc:///tmp/kvserve-client.sock"  # ROUTER the clients connect to
    worker_address: str = "ipc:///tmp/kvserve-worker.sock"  # ROUTER the workers connect to
    handshake_timeout_s: Seconds = 60.0  # all ranks must be Ready by then
    step_timeout_s: Seconds = 30.0  # each rank replies to a step by then
    heartbeat_interval_s: Seconds = 1.0  # ZMQ heartbeats to remote ranks
    heartbeat_timeout_s: Seconds = 10.0
    check_invariants: bool = False  # walk the block pool after every step (slow; for debugging)
    log_stats_interval_s: Seconds = 5.0
    metrics_port: Port | None = None  # HTTP /metrics and /health
    shutdown_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0  # drain time on SIGTERM
    # A client that reads its outputs slower than they come gets a backlog of encoded outputs;
    # past this many bytes its requests are aborted (it sees why) rather than memory growing.
    max_client_backlog_bytes: PositiveInt = 64 * 1024 * 1024
    max_client_frames_per_step: PositiveInt = 256  # client frames read between two steps
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    # Host bytes the block pool's bookkeeping may take (about 120 per block); a larger pool is
    # refused at startup. None: deploy/ fills in a quarter of physical memory; left None, no limit.
    max_pool_host_memory_bytes: PositiveInt | None = None
    curve: CurveKeys | None = None  # None: no CURVE, allowed only on loopback and ipc://
    allow_insecure: bool = False  # bind a non-loopback tcp address without CURVE anyway
    metrics_host: str = "127.0.0.1"  # interface of HTTP /metrics and /health
    # Rank recovery (DESIGN.md §8): how many times a failed worker generation is replaced by a
    # new one over the engine's life; 0 is fail-stop, every request failing with the rank.
    max_worker_restarts: Annotated[int, msgspec.Meta(ge=0)] = 3
    worker_rejoin_timeout_s: Seconds = 120.0  # for a new generation to be Ready after a fault
    # Same-host ranks take each step over a shared-memory ring rather than ZMQ (DESIGN.md §1).
    enable_shm_ring: bool = True
    # The folder of the tokenizer.json whose vocabulary structured outputs compile against (read
    # once at start-up); None: the checkpoint folder's, and none for a built-in model
    tokenizer: str | None = None
    kv_role: KVRole = "both"  # both: serves requests whole, and neither holds nor pulls blocks
    # A prefill engine holds a request's blocks for its decode engine at most this long
    kv_transfer_timeout_s: Seconds = 30.0
    # Where a prefill engine's ranks serve pulls: "ipc://FOLDER" or "tcp://HOST" (each rank takes
    # a free port); None: ipc in a fresh private folder (decode ranks on this host only)
    kv_transfer_address: str | None = None
    kv_transport: KVTransport = "auto"  # how a prefill or decode engine's ranks move pages


class WorkerConfig(_Config, frozen=True):
    rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    tp_size: TPSize = 1
    engine_address: str = "ipc:///tmp/kvserve-worker.sock"  # the engine's worker ROUTER
    model: str = "tiny-llama"  # a name from worker/models, or a Hugging Face checkpoint folder
    # compute dtype; auto: a checkpoint's own dtype on CUDA, float32 on the CPU and for the
    # built-in models (whose dtype is their KV-cache dtype)
    dtype: Literal["auto", "float32", "float64", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    block_size: BlockSize = 16  # must equal the engine's
    gpu_memory_utilization: Fraction = 0.9
    kv_cache_memory_bytes: PositiveInt | None = None  # KV bytes per rank; None: profiling.py
    master_addr: str = "127.0.0.1"  # torch.distributed rendezvous, as torchrun names it
    master_port: Port = 29500
    dist_timeout_s: Seconds = 60.0  # for the group to form, and for each collective to finish
    engine_timeout_s: Seconds = 60.0  # exit when the engine is silent so long
    shutdown_grace_s: Seconds = 30.0  # after SIGTERM, wait so long for the engine's Shutdown
    seed: int = 0  # model weights
    max_num_batched_tokens: PositiveInt = 2048  # the engine's; the profiling step runs this many
    # The engine's, with its max_model_len (None: the model's): a checkpoint's default KV pool
    # on the CPU holds no more than this many sequences at full length could ever use.
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 256
    max_model_len: PositiveInt | None = None
    # auto: gloo when ranks share a device or run on the CPU, nccl when each has a device of its own
    distributed_backend: Literal["auto", "nccl", "gloo"] = "auto"
    # this rank's CUDA device; None: local_rank modulo the visible devices (0 without local_rank)
    device_index: Annotated[int, msgspec.Meta(ge=0)] | None = None
    local_rank: Annotated[int, msgspec.Meta(ge=0)] | None = None  # index on this host (LOCAL_RANK)
    curve: CurveKeys | None = None  # the worker keypair and the engine's public key
    # the fixed-time model's device time per forward, in ms: its stand-in for a GPU's step time
    model_step_ms: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # dtype of the KV cache; auto follows the compute dtype. fp8 (vLLM's spelling; fp8_e4m3 the
    # same) stores K and V as float8 e4m3 with scale 1, clamped to its +-448 range: half the
    # bytes of bfloat16. Checkpoints only, with the blocks or reference attention backend.
    kv_cache_dtype: Literal[
        "auto", "float32", "float64", "float16", "bfloat16", "fp8", "fp8_e4m3"
    ] = "auto"
    # the fixed-time model's extra device time per prompt token a forward computes, in us: a
    # prefill's cost grows with its tokens, as on a GPU; decodes are charged the step alone
    model_prefill_token_us: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # how a checkpoint's layers read the paged cache (worker/attention_backends/backend.py):
    # auto and blocks gather whole blocks; reference one row per token; triton (CUDA) reads
    # the block table in place
    attention_backend: Literal["auto", "reference", "blocks", "native", "triton"] = "auto"
    # torch threads of a CPU rank; None: the host's cores shared out over its ranks
    cpu_threads: PositiveInt | None = None
    # run every step eagerly: no CUDA graphs of decode steps (worker/graph_runner.py), as vLLM's
    enforce_eager: bool = False
