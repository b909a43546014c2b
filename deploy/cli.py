"""The console scripts `kvserve-core`, `kvserve-worker`, `kvserve` (subcommands: commands.py) and
`kvserve-api` (the same as `kvserve serve`).

Each entry parses argv and the environment (the engine flags come from commands.py, shared with
`kvserve launch`), sets up logging, then calls the engine's or the worker's `run`. Bad flags are
usage errors (exit 2); a process that failed exits 1.
"""

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from typing import NoReturn

import msgspec

from deploy.commands import (
    add_common,
    add_engine_flags,
    add_serve_flags,
    add_subcommands,
    check_model_name,
    engine_config_from,
    serve_command,
)
from deploy.flags import WORKER_FLAGS, UsageError, add_flags, build_config
from deploy.keys import add_keys_flag, keys_from
from deploy.logs import setup_logging
from protocol.config import WorkerConfig

EXIT_USAGE = 2
TORCHRUN_ENV = {
    "RANK": "rank",
    "WORLD_SIZE": "tp_size",
    "LOCAL_RANK": "local_rank",  # picks the device, unless --device-index does
    "MASTER_ADDR": "master_addr",
    "MASTER_PORT": "master_port",
}


def exit_with(code: int) -> NoReturn:
    """Exit with the status the process chose. Its stop is done, and Python's finalization puts
    back the default action of a signal it handles: a late SIGTERM would turn 1 into -15."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    sys.exit(code)


def worker_config_from(args: argparse.Namespace, environ: Mapping[str, str]) -> WorkerConfig:
    """Flags first, then torchrun's environment variables, then the config's defaults."""
    extra: dict = {field: environ[name] for name, field in TORCHRUN_ENV.items() if name in environ}
    for field in ("rank", "tp_size", "local_rank", "master_port"):
        if field in extra:
            try:
                extra[field] = int(extra[field])
            except ValueError:
                raise UsageError(
                    f"${field.upper()} {extra[field]!r}: expected an integer"
                ) from None
    curve = keys_from(args, "worker")
    if curve is not None:
        extra["curve"] = msgspec.to_builtins(curve)
    return check_model_name(build_config(args, WORKER_FLAGS, WorkerConfig, **extra))


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
    add_keys_flag(parser, "worker")
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
    from deploy.launch import kv_transfer_address_for, with_pool_host_memory_limit
    from engine_core.service.engine_process import run

    with kv_transfer_address_for(with_pool_host_memory_limit(config)) as engine_config:
        code = run(engine_config)
    exit_with(code)


def worker_main(argv: list[str] | None = None) -> None:
    parser = worker_parser()
    args = parser.parse_args(argv)
    try:
        config = worker_config_from(args, os.environ)
    except UsageError as exc:
        parser.error(str(exc))
    setup_logging(f"worker-{config.rank}", args.log_level)
    from deploy.launch import enable_nccl_async_errors, share_cpu_threads
    from deploy.network import choose_gloo_interface

    # CUDA_VISIBLE_DEVICES is left as the user set it: the device comes from LOCAL_RANK (or
    # --device-index), so local ranks past the device count can share a device
    enable_nccl_async_errors()
    choose_gloo_interface(config.master_addr, config.tp_size, os.environ)
    local_world_size = os.environ.get("LOCAL_WORLD_SIZE")  # set by torchrun
    if local_world_size is not None and local_world_size.isdigit() and int(local_world_size) > 0:
        share_cpu_threads(int(local_world_size), config.cpu_threads)
    elif config.cpu_threads is not None:
        share_cpu_threads(1, config.cpu_threads)
    from worker.worker_process import run

    exit_with(run(config))


def kvserve_main(argv: list[str] | None = None) -> None:
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
    exit_with(code)


def api_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="kvserve-api", description="An OpenAI-compatible HTTP server over kvserve engines."
    )
    add_serve_flags(parser)
    args = parser.parse_args(argv)
    try:
        code = serve_command(args)
    except UsageError as exc:
        parser.exit(EXIT_USAGE, f"kvserve-api: error: {exc}\n")
    exit_with(code)
