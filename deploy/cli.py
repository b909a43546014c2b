"""The console scripts: `kvserve-core`, `kvserve-worker` and `kvserve` (launch, demo, bench,
stats, reset-prefix-cache).

All argument and environment parsing lives here. Bad flags are usage errors (exit 2); a process
that failed exits 1. Each entry sets up logging, then calls the engine's or the worker's `run`.
"""

import argparse
import os
import sys
from collections.abc import Mapping

import msgspec

from deploy.flags import (
    ENGINE_FLAGS,
    KV_EVENTS_FLAG,
    WORKER_FLAGS,
    UsageError,
    add_flags,
    build_config,
    parse_kv_events_config,
)
from deploy.logs import LOG_LEVELS, setup_logging
from protocol.config import EngineConfig, WorkerConfig

EXIT_USAGE = 2
TORCHRUN_ENV = {
    "RANK": "rank",
    "WORLD_SIZE": "tp_size",
    "MASTER_ADDR": "master_addr",
    "MASTER_PORT": "master_port",
}
LAUNCH_WORKER_FIELDS = (  # worker settings `kvserve launch` takes; the rest follow the engine
    "model",
    "dtype",
    "device",
    "master_addr",
    "master_port",
    "dist_timeout_s",
    "engine_timeout_s",
    "seed",
)
LAUNCH_WORKER_FLAGS = [flag for flag in WORKER_FLAGS if flag.path[0] in LAUNCH_WORKER_FIELDS]


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="default INFO")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ENGINE_FLAGS, EngineConfig)
    parser.add_argument(
        "--host", help="serve clients on tcp://HOST:PORT instead of --client-address"
    )
    parser.add_argument("--port", type=int, help="TCP port of the client socket (with --host)")
    parser.add_argument(KV_EVENTS_FLAG, help="JSON of the KV events publisher config")


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    extra: dict = {}
    if args.host is not None or args.port is not None:
        if args.port is None or not 1 <= args.port <= 65535:
            raise UsageError(f"--port {args.port}: expected a TCP port in [1, 65535] with --host")
        extra["client_address"] = f"tcp://{args.host or '*'}:{args.port}"
    kv_events = parse_kv_events_config(getattr(args, "kv_events_config", None))
    if kv_events is not None:
        extra["kv_events"] = msgspec.to_builtins(kv_events)
    return build_config(args, ENGINE_FLAGS, EngineConfig, **extra)


def worker_config_from(args: argparse.Namespace, environ: Mapping[str, str]) -> WorkerConfig:
    """Flags first, then torchrun's environment variables, then the config's defaults."""
    extra = {field: environ[name] for name, field in TORCHRUN_ENV.items() if name in environ}
    for field in ("rank", "tp_size", "master_port"):
        if field in extra:
            try:
                extra[field] = int(extra[field])
            except ValueError:
                raise UsageError(
                    f"${field.upper()} {extra[field]!r}: expected an integer"
                ) from None
    return check_model_name(build_config(args, WORKER_FLAGS, WorkerConfig, **extra))


def check_model_name(config: WorkerConfig) -> WorkerConfig:
    from worker.models.registry import MODEL_NAMES

    if config.model not in MODEL_NAMES:
        raise UsageError(f"--model {config.model}: expected one of {list(MODEL_NAMES)}")
    return config


def core_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve-core", description="Run the kvserve engine.")
    add_engine_flags(parser)
    add_common(parser)
    return parser


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve-worker",
        description="Run one kvserve worker rank; also reads torchrun's RANK, WORLD_SIZE, "
        "LOCAL_RANK, MASTER_ADDR and MASTER_PORT.",
    )
    add_flags(parser, WORKER_FLAGS, WorkerConfig)
    add_common(parser)
    return parser


def core_main(argv: list[str] | None = None) -> None:
    parser = core_parser()
    args = parser.parse_args(argv)
    try:
        config = engine_config_from(args)
    except UsageError as exc:
        parser.error(str(exc))
    setup_logging("engine", args.log_level)
    from engine_core.server import run

    sys.exit(run(config))


def worker_main(argv: list[str] | None = None) -> None:
    parser = worker_parser()
    args = parser.parse_args(argv)
    try:
        config = worker_config_from(args, os.environ)
    except UsageError as exc:
        parser.error(str(exc))
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = local_rank  # one device per local rank, as cuda:0
    setup_logging(f"worker-{config.rank}", args.log_level)
    local_world_size = os.environ.get("LOCAL_WORLD_SIZE")  # set by torchrun
    if local_world_size is not None and local_world_size.isdigit() and int(local_world_size) > 0:
        from deploy.launch import share_cpu_threads

        share_cpu_threads(int(local_world_size))
    from worker.worker import run

    sys.exit(run(config))


def kvserve_main(argv: list[str] | None = None) -> None:
    from deploy.commands import add_subcommands

    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: launch, demo, bench.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_subcommands(commands)
    args = parser.parse_args(argv)
    try:
        code = args.handler(args)
    except UsageError as exc:
        parser.exit(EXIT_USAGE, f"kvserve {args.command}: error: {exc}\n")
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
