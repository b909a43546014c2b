"""The subcommands of `kvserve`: launch, demo, bench, stats and reset-prefix-cache.

Each adds its flags to a subparser and names a handler that returns the process exit code.
"""

import argparse
import json
import sys

from deploy.flags import UsageError, build_config
from deploy.logs import LOG_LEVELS
from protocol.config import EngineConfig, WorkerConfig

DEFAULT_CLIENT_ADDRESS = EngineConfig().client_address


def add_subcommands(commands: argparse._SubParsersAction) -> None:
    from deploy.cli import LAUNCH_WORKER_FLAGS, add_common, add_engine_flags
    from deploy.flags import add_flags

    launch = commands.add_parser("launch", help="start and supervise an engine and N workers")
    add_engine_flags(launch)
    add_flags(launch, LAUNCH_WORKER_FLAGS, WorkerConfig)
    add_common(launch)
    launch.set_defaults(handler=launch_command)

    demo = commands.add_parser("demo", help="serve a built-in workload on CPU, TP=2, tiny-llama")
    demo.add_argument("--tensor-parallel-size", "-tp", type=int, default=2, help="ranks; default 2")
    demo.add_argument("--model", default="tiny-llama", help="model name; default tiny-llama")
    demo.add_argument(
        "--log-level", default="WARNING", choices=LOG_LEVELS, help="of the engine and workers"
    )
    demo.set_defaults(handler=demo_command)

    for name, helptext in (
        ("stats", "print a running engine's statistics"),
        ("reset-prefix-cache", "clear a running engine's prefix cache"),
    ):
        sub = commands.add_parser(name, help=helptext)
        sub.add_argument("--address", default=DEFAULT_CLIENT_ADDRESS, help="engine client socket")
        sub.add_argument("--timeout-s", type=float, default=10.0, help="seconds to wait")
        sub.set_defaults(handler=stats_command if name == "stats" else reset_command)

    from deploy.bench_cmd import add_bench_parser

    add_bench_parser(commands)


def launch_command(args: argparse.Namespace) -> int:
    from deploy.cli import LAUNCH_WORKER_FLAGS, check_model_name, engine_config_from
    from deploy.launch import run_launch
    from deploy.logs import setup_logging

    engine_config = engine_config_from(args)
    base_worker = check_model_name(build_config(args, LAUNCH_WORKER_FLAGS, WorkerConfig))
    if engine_config.cache.kv_cache_memory_bytes is None and base_worker.device == "cpu":
        raise UsageError("--kv-cache-memory-bytes None: expected a byte count with --device cpu")
    setup_logging("launcher", args.log_level)
    return run_launch(engine_config, base_worker, args.log_level)


def demo_command(args: argparse.Namespace) -> int:
    from deploy.demo import DemoSettings, run_demo
    from deploy.logs import setup_logging
    from worker.models.registry import MODEL_NAMES

    if not 1 <= args.tensor_parallel_size <= 8:
        raise UsageError(f"-tp {args.tensor_parallel_size}: expected a rank count in [1, 8]")
    if args.model not in MODEL_NAMES:
        raise UsageError(f"--model {args.model}: expected one of {list(MODEL_NAMES)}")
    setup_logging("demo", args.log_level)
    return run_demo(
        DemoSettings(tp_size=args.tensor_parallel_size, model=args.model), args.log_level
    )


def stats_command(args: argparse.Namespace) -> int:
    from engine_core.client import EngineClient, EngineDeadError

    with EngineClient(args.address, timeout_s=args.timeout_s) as client:
        try:
            stats = client.get_stats()
        except (TimeoutError, EngineDeadError) as exc:
            print(f"kvserve stats: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


def reset_command(args: argparse.Namespace) -> int:
    from engine_core.client import EngineClient, EngineDeadError, UtilityCallError

    with EngineClient(args.address, timeout_s=args.timeout_s) as client:
        try:
            client.reset_prefix_cache()
        except (UtilityCallError, TimeoutError, EngineDeadError) as exc:
            print(f"kvserve reset-prefix-cache: {exc}", file=sys.stderr)
            return 1
    print("prefix cache reset")
    return 0
