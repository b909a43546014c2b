"""Command-line flags of the engine and the workers, mapped onto the typed configs.

Types, defaults and bounds come from protocol/config.py (the one source of truth); this table adds
only the flag names (vLLM's where the concept is the same) and a help text with its unit.
"""

import argparse
import enum
import re
import tempfile
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from protocol.config import CacheConfig, EngineConfig, KVEventsConfig, WorkerConfig

C = TypeVar("C", EngineConfig, WorkerConfig)


class UsageError(ValueError):
    """A flag value outside its declared range; the CLI turns it into exit code 2."""


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # the long name first, then aliases
    path: tuple[str, ...]  # field path inside the config, e.g. ("cache", "block_size")
    help: str  # what it sets, with its unit


ENGINE_FLAGS = [
    Flag(("--tensor-parallel-size", "-tp"), ("tp_size",), "number of worker ranks"),
    Flag(
        ("--client-address",),
        ("client_address",),
        "ROUTER the clients connect to (tcp:// or ipc://)",
    ),
    Flag(
        ("--worker-address",),
        ("worker_address",),
        "ROUTER the workers connect to (tcp:// or ipc://)",
    ),
    Flag(
        ("--handshake-timeout-s",), ("handshake_timeout_s",), "seconds for every rank to be ready"
    ),
    Flag(("--step-timeout-s",), ("step_timeout_s",), "seconds for every rank to reply to a step"),
    Flag(("--heartbeat-interval-s",), ("heartbeat_interval_s",), "seconds between ZMQ heartbeats"),
    Flag(
        ("--heartbeat-timeout-s",),
        ("heartbeat_timeout_s",),
        "seconds without heartbeat before a peer is dead",
    ),
    Flag(
        ("--max-worker-restarts",),
        ("max_worker_restarts",),
        "worker generations replaced after a rank fault before the engine fails (0: fail-stop)",
    ),
    Flag(
        ("--worker-rejoin-timeout-s",),
        ("worker_rejoin_timeout_s",),
        "seconds for a new worker generation to be ready after a rank fault",
    ),
    Flag(
        ("--enable-shm-ring",),
        ("enable_shm_ring",),
        "send steps to same-host ranks over a shared-memory ring (--no-enable-shm-ring: ZMQ)",
    ),
    Flag(
        ("--kv-role",),
        ("kv_role",),
        "disaggregated prefill and decode: prefill (compute prompts, hold their KV blocks for "
        "decode engines), decode (pull them, then generate) or both (serve requests whole)",
    ),
    Flag(
        ("--kv-transfer-timeout-s",),
        ("kv_transfer_timeout_s",),
        "seconds a prefill engine holds a request's blocks for its decode engine at most",
    ),
    Flag(
        ("--kv-transfer-address",),
        ("kv_transfer_address",),
        "where a prefill engine's ranks serve their blocks: ipc://FOLDER, or tcp://HOST for "
        "decode engines on other hosts (a free port each; CURVE as the worker socket); "
        "default a private ipc folder",
    ),
    Flag(
        ("--kv-transport",),
        ("kv_transport",),
        "how P/D ranks move pages: builtin (shared memory over ipc, frames over tcp), nixl "
        "(NIXL READs; must be installed) or auto (nixl where both ranks of a pair have it)",
    ),
    Flag(
        ("--check-invariants",),
        ("check_invariants",),
        "walk the block pool after every step (slow)",
    ),
    Flag(("--log-stats-interval-s",), ("log_stats_interval_s",), "seconds between stats log lines"),
    Flag(("--metrics-port",), ("metrics_port",), "TCP port of HTTP /metrics and /health"),
    Flag(
        ("--metrics-host",),
        ("metrics_host",),
        "interface of HTTP /metrics and /health (0.0.0.0: reachable from other hosts)",
    ),
    Flag(
        ("--insecure",),
        ("allow_insecure",),
        "bind non-loopback tcp addresses without --curve-keys-dir (no authentication)",
    ),
    Flag(
        ("--shutdown-timeout-s",),
        ("shutdown_timeout_s",),
        "seconds to finish in-flight requests after SIGTERM before aborting them",
    ),
    Flag(
        ("--max-client-backlog-bytes",),
        ("max_client_backlog_bytes",),
        "bytes of outputs kept for a slow client before its requests are aborted",
    ),
    Flag(
        ("--max-client-frames-per-step",),
        ("max_client_frames_per_step",),
        "client messages read between two steps at most",
    ),
    Flag(("--block-size",), ("cache", "block_size"), "tokens per KV-cache block"),
    Flag(
        ("--gpu-memory-utilization",),
        ("cache", "gpu_memory_utilization"),
        "share of device memory for the model and KV cache, 0..1",
    ),
    Flag(
        ("--kv-cache-memory-bytes",),
        ("cache", "kv_cache_memory_bytes"),
        "KV-cache bytes per rank (required on the CPU for the built-in models; a checkpoint "
        "defaults to half the available memory after its weights, split over the host's ranks)",
    ),
    Flag(
        ("--num-gpu-blocks-override",),
        ("cache", "num_gpu_blocks_override"),
        "blocks in the pool, overriding the measured capacity",
    ),
    Flag(
        ("--enable-prefix-caching",),
        ("cache", "enable_prefix_caching"),
        "reuse cached KV blocks of shared prefixes",
    ),
    Flag(
        ("--prefix-caching-hash-algo",),
        ("cache", "prefix_caching_hash_algo"),
        "block hash algorithm",
    ),
    Flag(("--hash-seed",), ("cache", "hash_seed"), "seed string of the block hashes (fleet-wide)"),
    Flag(
        ("--prefix-cache-retention-interval",),
        ("cache", "prefix_cache_retention_interval"),
        "tokens between the boundaries where sliding-window groups keep blocks for prefix hits, "
        "a multiple of --block-size; unset keeps every block",
    ),
    Flag(
        ("--kv-cache-metrics",),
        ("cache", "kv_cache_metrics"),
        "export KV-cache block lifetime, idle-before-eviction and reuse-gap histograms (s)",
    ),
    Flag(
        ("--kv-cache-metrics-sample",),
        ("cache", "kv_cache_metrics_sample"),
        "share of block allocations timed for --kv-cache-metrics, 0..1",
    ),
    Flag(
        ("--kv-offload-host-bytes",),
        ("cache", "kv_offload_host_bytes"),
        "bytes of the host-memory tier below the KV pool, over all ranks together (pinned on "
        "CUDA); 0: no tiers",
    ),
    Flag(
        ("--kv-offload-disk-dir",),
        ("cache", "kv_offload_disk_dir"),
        "folder of the disk tier below the host tier: one preallocated file per rank, removed "
        "at exit",
    ),
    Flag(
        ("--kv-offload-disk-bytes",),
        ("cache", "kv_offload_disk_bytes"),
        "bytes of the disk tier over all ranks together (needs --kv-offload-host-bytes and "
        "--kv-offload-disk-dir); 0: no disk tier",
    ),
    Flag(("--max-num-seqs",), ("scheduler", "max_num_seqs"), "running requests at most"),
    Flag(
        ("--max-num-batched-tokens",),
        ("scheduler", "max_num_batched_tokens"),
        "tokens per step at most",
    ),
    Flag(
        ("--max-model-len",),
        ("scheduler", "max_model_len"),
        "tokens per sequence at most (default: the model's)",
    ),
    Flag(
        ("--enable-chunked-prefill",),
        ("scheduler", "enable_chunked_prefill"),
        "split long prefills over steps",
    ),
    Flag(
        ("--long-prefill-token-threshold",),
        ("scheduler", "long_prefill_token_threshold"),
        "tokens of one prefill per step at most",
    ),
    Flag(
        ("--scheduling-policy",), ("scheduler", "scheduling_policy"), "order of the waiting queue"
    ),
    Flag(
        ("--async-scheduling",),
        ("scheduler", "async_scheduling"),
        "schedule step N+1 while the ranks run step N (the engine's time hides behind theirs)",
    ),
    Flag(
        ("--reserve-full-prompt",),
        ("scheduler", "reserve_full_prompt"),
        "admit a request only when its whole prompt fits",
    ),
    Flag(
        ("--max-num-waiting-requests",),
        ("scheduler", "max_num_waiting_requests"),
        "queued requests at most; past it new ones are refused as busy",
    ),
    Flag(
        ("--max-num-requests-per-client",),
        ("scheduler", "max_num_requests_per_client"),
        "live requests of one client at most; past it its new ones are refused as busy",
    ),
    Flag(
        ("--max-pool-host-memory-bytes",),
        ("max_pool_host_memory_bytes",),
        "host bytes the block pool's bookkeeping may take (None: a quarter of physical memory)",
    ),
]

WORKER_FLAGS = [
    Flag(("--rank",), ("rank",), "this worker's tensor-parallel rank (default: $RANK)"),
    Flag(("--tensor-parallel-size", "-tp"), ("tp_size",), "number of ranks (default: $WORLD_SIZE)"),
    Flag(
        ("--engine-address",), ("engine_address",), "the engine's worker ROUTER (tcp:// or ipc://)"
    ),
    Flag(
        ("--model",),
        ("model",),
        "model name: checksum, fixed-time, tiny-llama, tiny-llama-hybrid, tiny-llama-hybrid-2x, "
        "tiny-local, tiny-mla, tiny-encdec or tiny-mamba-hybrid (docs/serving.md's model list says "
        "what each exercises), or a Hugging Face checkpoint folder (its Architectures section "
        "lists the families served)",
    ),
    Flag(
        ("--dtype",),
        ("dtype",),
        "compute dtype of a checkpoint (auto: its own on CUDA, float32 on the CPU); the KV-cache "
        "dtype of the built-in models",
    ),
    Flag(
        ("--kv-cache-dtype",),
        ("kv_cache_dtype",),
        "dtype of the KV cache (auto: the compute dtype)",
    ),
    Flag(("--device",), ("device",), "device; auto takes cuda when available"),
    Flag(
        ("--cpu-threads",),
        ("cpu_threads",),
        "torch threads of each CPU rank (default: the host's cores over its local ranks; on a "
        "host whose other processes stay busy, leave them their cores)",
    ),
    Flag(
        ("--attention-backend",),
        ("attention_backend",),
        "how a checkpoint's attention reads the paged KV cache: native (auto on the CPU) "
        "attends decode rows in place with a compiled kernel, blocks (auto elsewhere) gathers "
        "whole blocks, reference one row per token, triton (CUDA) reads the block table in place",
    ),
    Flag(
        ("--enforce-eager",),
        ("enforce_eager",),
        "run every step eagerly: no CUDA graphs of decode steps (captured with "
        "--attention-backend triton on CUDA otherwise)",
    ),
    Flag(("--block-size",), ("block_size",), "tokens per KV-cache block (must equal the engine's)"),
    Flag(
        ("--gpu-memory-utilization",), ("gpu_memory_utilization",), "share of device memory, 0..1"
    ),
    Flag(
        ("--kv-cache-memory-bytes",),
        ("kv_cache_memory_bytes",),
        "KV-cache bytes of this rank (required on the CPU for the built-in models; a checkpoint "
        "defaults to half the available memory after its weights, split over the host's ranks)",
    ),
    Flag(
        ("--master-addr",),
        ("master_addr",),
        "torch.distributed rendezvous host (default: $MASTER_ADDR)",
    ),
    Flag(
        ("--master-port",),
        ("master_port",),
        "torch.distributed rendezvous TCP port (default: $MASTER_PORT)",
    ),
    Flag(("--dist-timeout-s",), ("dist_timeout_s",), "seconds for the process group to form"),
    Flag(
        ("--engine-timeout-s",), ("engine_timeout_s",), "seconds of engine silence before exiting"
    ),
    Flag(
        ("--shutdown-grace-s",),
        ("shutdown_grace_s",),
        "seconds to wait for the engine's Shutdown after SIGTERM",
    ),
    Flag(("--seed",), ("seed",), "seed of the model weights"),
    Flag(
        ("--max-num-batched-tokens",),
        ("max_num_batched_tokens",),
        "tokens of the profiling step (must equal the engine's)",
    ),
    Flag(
        ("--max-num-seqs",),
        ("max_num_seqs",),
        "the engine's running requests at most; bounds a checkpoint's default CPU KV pool",
    ),
    Flag(
        ("--max-model-len",),
        ("max_model_len",),
        "the engine's tokens per sequence (default: the model's); bounds that pool too",
    ),
    Flag(
        ("--distributed-backend",),
        ("distributed_backend",),
        "TP backend; auto takes gloo when ranks share a device or run on the CPU, else nccl",
    ),
    Flag(
        ("--device-index",),
        ("device_index",),
        "CUDA device of this rank (None: the local rank modulo the visible devices)",
    ),
    Flag(
        ("--local-rank",), ("local_rank",), "index of this rank on its host (default: $LOCAL_RANK)"
    ),
    Flag(
        ("--model-step-ms",),
        ("model_step_ms",),
        "milliseconds of device time each forward of the fixed-time model takes (its GPU time)",
    ),
    Flag(
        ("--model-prefill-token-us",),
        ("model_prefill_token_us",),
        "microseconds of device time the fixed-time model adds per prompt token a forward "
        "computes (0: a prefill costs one step whatever its length)",
    ),
]

KV_EVENTS_FLAG = "--kv-events-config"


def dest_of(flag: Flag) -> str:
    return "cfg_" + "__".join(flag.path)


def add_flags(parser: argparse.ArgumentParser, flags: list[Flag], config_type: type) -> None:
    """Add each flag with its type, choices and default read from `config_type`."""
    info = msgspec.inspect.type_info(config_type)
    default_config = config_type()
    for flag in flags:
        field_type, default = _field(info, default_config, flag.path)
        kwargs: dict = {"dest": dest_of(flag), "default": None}
        field_type = _strip_none(field_type)
        if isinstance(field_type, msgspec.inspect.BoolType):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(field_type, msgspec.inspect.LiteralType):
            kwargs["choices"] = list(field_type.values)
        elif isinstance(field_type, msgspec.inspect.EnumType):
            kwargs["choices"] = [member.value for member in field_type.cls]
        else:
            kwargs["type"] = _python_type(field_type)
            kwargs["metavar"] = _metavar(field_type)
        shown = default.value if isinstance(default, enum.Enum) else default
        kwargs["help"] = f"{flag.help}; {_describe_range(field_type)}default {shown}"
        parser.add_argument(*flag.names, **kwargs)


def build_config(args: argparse.Namespace, flags: list[Flag], config_type: type[C], **extra) -> C:
    """The config from the flags given (others keep their defaults), with every bound checked.

    `extra` holds top-level fields set by the caller; flags given explicitly override them.
    """
    values: dict = {name: value for name, value in extra.items() if value is not None}
    for flag in flags:
        value = getattr(args, dest_of(flag))
        if value is None:
            continue
        target = values
        for part in flag.path[:-1]:
            target = target.setdefault(part, {})
        target[flag.path[-1]] = value
    try:
        return msgspec.convert(values, config_type)
    except msgspec.ValidationError as exc:
        raise UsageError(_explain(exc, args, flags)) from None


def check_kv_offload(cache: CacheConfig) -> None:
    """A disk tier sits below a host tier and in a folder this process can write (checked here,
    by making a file there, so a bad one exits 2 before any process starts)."""
    host_bytes, disk_bytes, disk_dir = (
        cache.kv_offload_host_bytes,
        cache.kv_offload_disk_bytes,
        cache.kv_offload_disk_dir,
    )
    if disk_bytes and not host_bytes:
        raise UsageError(
            f"--kv-offload-disk-bytes {disk_bytes}: a disk tier needs a host tier above it, "
            f"expected --kv-offload-host-bytes > 0"
        )
    if disk_bytes and disk_dir is None:
        raise UsageError(f"--kv-offload-disk-bytes {disk_bytes}: expected --kv-offload-disk-dir")
    if disk_dir is None:
        return
    if not disk_bytes:
        raise UsageError(
            f"--kv-offload-disk-dir {disk_dir}: expected --kv-offload-disk-bytes > 0 with it"
        )
    try:
        with tempfile.TemporaryFile(dir=disk_dir, prefix="kvserve-tier-check-"):
            pass
    except OSError as exc:
        raise UsageError(
            f"--kv-offload-disk-dir {disk_dir}: expected a folder this user can write "
            f"({exc.strerror or exc})"
        ) from None


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    if text is None:
        return None
    try:
        return msgspec.json.decode(text, type=KVEventsConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise UsageError(
            f"{KV_EVENTS_FLAG} {text!r} is not a valid KV events config: {exc}"
        ) from None


def _explain(exc: msgspec.ValidationError, args: argparse.Namespace, flags: list[Flag]) -> str:
    """Turn msgspec's `... - at $.cache.block_size` into a message naming the flag and value."""
    match = re.search(r"at `\$\.([\w.]+)`", str(exc))
    problem = str(exc).split(" - at ")[0]
    if match:
        path = tuple(match.group(1).split("."))
        for flag in flags:
            if flag.path == path:
                value = getattr(args, dest_of(flag))
                return f"{flag.names[0]} {value}: {_lower_first(problem)}"
    return f"bad configuration: {_lower_first(problem)}"


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _field(info: msgspec.inspect.StructType, default: object, path: tuple[str, ...]) -> tuple:
    for part in path[:-1]:
        info = next(f.type for f in info.fields if f.name == part)
        default = getattr(default, part)
    field = next(f for f in info.fields if f.name == path[-1])
    return field.type, getattr(default, path[-1])


def _strip_none(field_type: msgspec.inspect.Type) -> msgspec.inspect.Type:
    if isinstance(field_type, msgspec.inspect.UnionType):
        others = [t for t in field_type.types if not isinstance(t, msgspec.inspect.NoneType)]
        if len(others) == 1:
            return others[0]
    return field_type


def _python_type(field_type: msgspec.inspect.Type) -> type:
    match field_type:
        case msgspec.inspect.IntType():
            return int
        case msgspec.inspect.FloatType():
            return float
        case _:
            return str


def _metavar(field_type: msgspec.inspect.Type) -> str:
    return {int: "N", float: "X", str: "S"}[_python_type(field_type)]


def _describe_range(field_type: msgspec.inspect.Type) -> str:
    """`range >= 1 and <= 1024; ` for a bounded number, nothing otherwise."""
    if not isinstance(field_type, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        return ""
    parts = [
        f"{symbol} {bound}"
        for symbol, bound in (
            (">", field_type.gt),
            (">=", field_type.ge),
            ("<", field_type.lt),
            ("<=", field_type.le),
        )
        if bound is not None
    ]
    return f"range {' and '.join(parts)}; " if parts else ""
