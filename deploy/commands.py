"""The subcommands of `kvserve`: launch, serve, demo, bench, stats and reset-prefix-cache.

Each adds its flags to a subparser and names a handler that returns the process exit code.
The engine flags and model check live here, as `kvserve-core` (cli.py) imports them too.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from deploy.flags import (
    ENGINE_FLAGS,
    KV_EVENTS_FLAG,
    WORKER_FLAGS,
    UsageError,
    add_flags,
    build_config,
    check_kv_offload,
    parse_kv_events_config,
)
from deploy.keys import KEYS_FLAG, add_keys_flag, keygen_command, keys_from
from deploy.logs import LOG_LEVELS
from protocol.config import EngineConfig, WorkerConfig

if TYPE_CHECKING:  # imported at run time only by `serve`: other commands never load HTTP
    from api_server.app import ApiSettings

DEFAULT_CLIENT_ADDRESS = EngineConfig().client_address
LAUNCH_WORKER_FIELDS = (  # worker settings `kvserve launch` takes; the rest follow the engine
    "model",
    "dtype",
    "device",
    "master_addr",
    "master_port",
    "dist_timeout_s",
    "engine_timeout_s",
    "shutdown_grace_s",
    "distributed_backend",
    "seed",
    "model_step_ms",
    "model_prefill_token_us",
    "kv_cache_dtype",
    "attention_backend",
    "cpu_threads",
    "enforce_eager",
)
LAUNCH_WORKER_FLAGS = [flag for flag in WORKER_FLAGS if flag.path[0] in LAUNCH_WORKER_FIELDS]
DEFAULT_HTTP_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="default INFO")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ENGINE_FLAGS, EngineConfig)
    parser.add_argument(
        "--host", help="serve clients on tcp://HOST:PORT instead of --client-address"
    )
    parser.add_argument("--port", type=int, help="TCP port of the client socket (with --host)")
    parser.add_argument(KV_EVENTS_FLAG, help="JSON of the KV events publisher config")
    add_keys_flag(parser, "engine")


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    extra: dict = {}
    if args.host is not None or args.port is not None:
        if args.port is None or not 1 <= args.port <= 65535:
            raise UsageError(f"--port {args.port}: expected a TCP port in [1, 65535] with --host")
        extra["client_address"] = f"tcp://{args.host or '*'}:{args.port}"
    kv_events = parse_kv_events_config(getattr(args, "kv_events_config", None))
    if kv_events is not None:
        extra["kv_events"] = msgspec.to_builtins(kv_events)
    curve = keys_from(args, "engine")
    if curve is not None:
        extra["curve"] = msgspec.to_builtins(curve)
    config = build_config(args, ENGINE_FLAGS, EngineConfig, **extra)
    check_kv_offload(config.cache)
    return config


FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def check_model_name(config: WorkerConfig, tp_size: int | None = None) -> WorkerConfig:
    """A built-in model name, or a checkpoint folder this worker can serve at `tp_size` (the
    config's when None): its config.json and safetensors headers are read here, so a bad one
    exits 2 before any process starts."""
    from worker.models.hf.checkpoint import check_checkpoint
    from worker.models.hf.config import CheckpointError, is_checkpoint
    from worker.models.names import MODEL_NAMES

    if is_checkpoint(config.model):
        try:
            check_checkpoint(config.model, config.tp_size if tp_size is None else tp_size)
        except CheckpointError as exc:
            raise UsageError(f"--model {config.model}: {exc}") from None
    elif config.model not in MODEL_NAMES:
        raise UsageError(
            f"--model {config.model}: expected one of {list(MODEL_NAMES)} or a folder holding "
            "config.json"
        )
    if config.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        if not is_checkpoint(config.model):
            raise UsageError(
                f"--kv-cache-dtype {config.kv_cache_dtype} with --model {config.model}: expected "
                "a checkpoint (the built-in models' tokens need their KV exact)"
            )
        if config.attention_backend == "triton":
            raise UsageError(
                f"--kv-cache-dtype {config.kv_cache_dtype} with --attention-backend triton: "
                "expected --attention-backend auto, native, blocks or reference (the Triton "
                "kernels read 16- and 32-bit caches only)"
            )
    return config


def check_kv_budget(engine_config: EngineConfig, base_worker: WorkerConfig) -> None:
    """The built-in models need --kv-cache-memory-bytes on the CPU; a checkpoint takes a share of
    the host's available memory by default (worker/profiling.py)."""
    from worker.models.hf.config import is_checkpoint

    has_no_kv_budget = engine_config.cache.kv_cache_memory_bytes is None
    if has_no_kv_budget and base_worker.device == "cpu" and not is_checkpoint(base_worker.model):
        raise UsageError("--kv-cache-memory-bytes None: expected a byte count with --device cpu")


def add_subcommands(commands: argparse._SubParsersAction) -> None:
    launch = commands.add_parser("launch", help="start and supervise an engine and N workers")
    add_engine_flags(launch)
    add_flags(launch, LAUNCH_WORKER_FLAGS, WorkerConfig)
    add_common(launch)
    launch.set_defaults(handler=launch_command)

    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server over engines it connects to or launches"
    )
    add_serve_flags(serve)
    serve.set_defaults(handler=serve_command)

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
        add_keys_flag(sub, "client")
        if name == "stats":
            sub.add_argument(
                "--url",
                help="a running `kvserve serve` front end (http://HOST:PORT): print its router's "
                "policy and, per engine, the KV-event index size and decisions, not an engine's "
                "statistics",
            )
            sub.add_argument("--api-key", help="the front end's --api-key, with --url")
        sub.set_defaults(handler=stats_command if name == "stats" else reset_command)

    keygen = commands.add_parser("keygen", help="write CURVE keys for the engine, workers, clients")
    keygen.add_argument("dir", help="folder to write the keys to (made owner-only)")
    keygen.add_argument("--force", action="store_true", help="replace existing secret keys")
    keygen.set_defaults(handler=keygen_command)

    from deploy.bench_cmd import add_bench_parser

    add_bench_parser(commands)


def launch_command(args: argparse.Namespace) -> int:
    from deploy.launch import run_launch
    from deploy.logs import setup_logging

    engine_config = engine_config_from(args)
    curve = keys_from(args, "worker")
    worker_extra = {} if curve is None else {"curve": msgspec.to_builtins(curve)}
    base_worker = build_config(args, LAUNCH_WORKER_FLAGS, WorkerConfig, **worker_extra)
    check_model_name(base_worker, engine_config.tp_size)
    check_kv_budget(engine_config, base_worker)
    setup_logging("launcher", args.log_level)
    return run_launch(engine_config, base_worker, args.log_level)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """`kvserve launch`'s flags (used when no --engine-address is given) and the HTTP ones;
    --host and --port name the HTTP socket here, as in `vllm serve`."""
    add_flags(parser, ENGINE_FLAGS, EngineConfig)
    add_flags(parser, LAUNCH_WORKER_FLAGS, WorkerConfig)
    parser.add_argument(KV_EVENTS_FLAG, help="JSON of the KV events publisher config")
    parser.add_argument(
        "--engine-address",
        action="append",
        default=[],
        help="client socket of a running engine; repeat it to spread requests over several "
        "engines. Without it, serve launches one engine and its workers like `kvserve launch`",
    )
    parser.add_argument(
        "--host", default=DEFAULT_HTTP_HOST, help="HTTP interface; default %(default)s"
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP TCP port; default %(default)s"
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="names clients may send as `model` (the first is reported); default --model",
    )
    parser.add_argument(
        KEYS_FLAG,
        metavar="DIR",
        help="folder written by `kvserve keygen`: CURVE on; the front end uses the client keys, "
        "and a launched engine and its workers theirs; default off",
    )
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ routes")
    add_router_flags(parser)
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="checkpoint or tokenizer folder holding tokenizer.json (and tokenizer_config.json) "
        "to tokenize with; default --model's own (the shipped byte-level one for a built-in "
        "model). Its vocabulary must fit the model's",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template to render chats with, replacing the tokenizer's own: a file, "
        "or the template itself; default the tokenizer's (the byte format for a built-in model)",
    )
    parser.add_argument(
        "--generation-config",
        metavar="auto|vllm|DIR",
        default="auto",
        help="sampling defaults for the fields a request leaves unset: auto reads the "
        "checkpoint's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens as max_tokens), vllm ignores it, DIR reads that "
        "folder's; default %(default)s",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a request's own `chat_template`; default off: such a request gets a 400",
    )
    add_chat_parsing_flags(parser)
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="bytes; a larger request body is refused with 413; default %(default)s",
    )
    add_common(parser)


def add_chat_parsing_flags(parser: argparse.ArgumentParser) -> None:
    """How chat replies are parsed for tool calls and reasoning, as vLLM's flags say."""
    from api_server.openai.reasoning_parser import REASONING_PARSERS
    from api_server.openai.tool_parsers import TOOL_PARSERS

    parser.add_argument(
        "--tool-call-parser",
        choices=list(TOOL_PARSERS),
        help="the format of the model's tool calls, parsed into `tool_calls`: hermes "
        "(<tool_call>JSON</tool_call>, Qwen2.5/Qwen3), llama3_json or mistral; default none",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="serve tool_choice 'auto' (the default when a request brings tools) with "
        "--tool-call-parser; without it 'auto' is a 400 and tools alone are only rendered",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=list(REASONING_PARSERS),
        help="split the <think>...</think> text of a thinking model into `reasoning_content`: "
        "qwen3 or deepseek_r1; default none",
    )


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    """How the front end spreads requests over several --engine-address engines."""
    from api_server.routing.kv_event_subscriber import DEFAULT_SILENT_LIMIT_S
    from api_server.routing.kv_scorer import DEFAULT_DECODE_WEIGHT, DEFAULT_PREFILL_WEIGHT
    from api_server.routing.router import DEFAULT_ROUTING_POLICY, ROUTING_POLICIES

    parser.add_argument(
        "--router-policy",
        choices=ROUTING_POLICIES,
        default=DEFAULT_ROUTING_POLICY.value,
        help="kv: the engine whose KV events show the longest cached prefix, weighed against "
        "its outstanding work; first-block: the engine that last served the prompt's first "
        "block; least-loaded: fewest outstanding tokens; round-robin. Default %(default)s",
    )
    parser.add_argument(
        "--router-prefill-weight",
        type=float,
        default=DEFAULT_PREFILL_WEIGHT,
        help="kv policy: cost per prompt token an engine must still compute; default %(default)s",
    )
    parser.add_argument(
        "--router-decode-weight",
        type=float,
        default=DEFAULT_DECODE_WEIGHT,
        help="kv policy: cost per request an engine is decoding, in prompt tokens; "
        "default %(default)s",
    )
    parser.add_argument(
        "--router-silent-limit-s",
        type=float,
        default=DEFAULT_SILENT_LIMIT_S,
        help="seconds an engine's KV-event stream may answer nothing before the kv policy "
        "routes to it by load alone; default %(default)s",
    )


def serve_command(args: argparse.Namespace) -> int:
    from deploy.logs import setup_logging
    from deploy.serve_cmd import serve_http, serve_with_deployment

    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: expected a TCP port in [1, 65535]")
    if args.max_request_body_bytes < 1:
        raise UsageError(f"--max-request-body-bytes {args.max_request_body_bytes}: expected >= 1")
    for flag in ("router_prefill_weight", "router_decode_weight"):
        if not getattr(args, flag) >= 0:  # NaN too
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected >= 0")
    if not args.router_silent_limit_s > 0:
        raise UsageError(f"--router-silent-limit-s {args.router_silent_limit_s}: expected > 0")
    # --host and --port are the HTTP socket's here, not the engine's client socket
    engine_config = engine_config_from(
        argparse.Namespace(**{**vars(args), "host": None, "port": None})
    )
    worker_curve = keys_from(args, "worker")
    worker_extra = {} if worker_curve is None else {"curve": msgspec.to_builtins(worker_curve)}
    base_worker = build_config(args, LAUNCH_WORKER_FLAGS, WorkerConfig, **worker_extra)
    check_model_name(base_worker, engine_config.tp_size)
    engine_config = with_structured_outputs_vocabulary(
        engine_config, args.tokenizer, base_worker.model
    )
    is_launching = not args.engine_address
    if is_launching:
        check_kv_budget(engine_config, base_worker)
    settings = _api_settings(args, engine_config, base_worker)
    setup_logging("api-server", args.log_level)
    if not is_launching:
        return serve_http(settings, args.host, args.port)
    return serve_with_deployment(
        settings, args.host, args.port, engine_config, base_worker, args.log_level
    )


def _api_settings(
    args: argparse.Namespace, engine_config: EngineConfig, base_worker: WorkerConfig
) -> "ApiSettings":
    from api_server.app import ApiSettings
    from api_server.routing.kv_scorer import KVScoreWeights
    from api_server.routing.router import RoutingPolicy

    extra: dict = {
        "api_key": args.api_key,
        "max_body_bytes": args.max_request_body_bytes,
        "engine_curve": keys_from(args, "client"),
        "router_policy": RoutingPolicy(args.router_policy),
        "router_weights": KVScoreWeights(args.router_prefill_weight, args.router_decode_weight),
        "kv_events_silent_limit_s": args.router_silent_limit_s,
    }
    if args.tokenizer is not None and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        raise UsageError(f"--tokenizer {args.tokenizer}: expected a folder holding tokenizer.json")
    model_folder = Path(base_worker.model)
    has_no_tokenizer = not (model_folder / "tokenizer.json").is_file()
    if args.tokenizer is None and model_folder.is_dir() and has_no_tokenizer:
        raise UsageError(
            f"--model {base_worker.model}: no tokenizer.json in the checkpoint: expected one, "
            "or --tokenizer DIR naming a folder that holds one"
        )
    if args.tokenizer is None and model_folder.suffix == ".gguf" and model_folder.is_file():
        from api_server.tokenizer.gguf_tokenizer import gguf_tokenizer

        try:
            gguf_tokenizer(str(model_folder))
        except ValueError as exc:
            raise UsageError(f"--model {base_worker.model}: {exc}") from None
    if args.chat_template is not None:
        extra["chat_template"] = _chat_template_source(args.chat_template)
    extra["is_request_chat_template_trusted"] = args.trust_request_chat_template
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UsageError("--enable-auto-tool-choice needs --tool-call-parser: expected one")
    extra["tool_call_parser"] = args.tool_call_parser
    extra["is_auto_tool_choice_enabled"] = args.enable_auto_tool_choice
    extra["reasoning_parser"] = args.reasoning_parser
    extra["generation_config"] = _generation_config(args.generation_config, base_worker.model)
    return ApiSettings(
        engine_addresses=tuple(args.engine_address or [engine_config.client_address]),
        model=base_worker.model,
        block_size=engine_config.cache.block_size,
        served_model_names=tuple(args.served_model_name or ()),
        tokenizer=args.tokenizer,
        **extra,
    )


def _generation_config(value: str, model: str) -> str:
    """--generation-config, checked now so that a bad one is a usage error (exit 2)."""
    from api_server.openai.generation_config import load_generation_defaults

    try:
        load_generation_defaults(value, model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return value


def with_structured_outputs_vocabulary(
    engine_config: EngineConfig, tokenizer: str | None, model: str
) -> EngineConfig:
    """The engine's config naming the tokenizer whose vocabulary structured outputs compile
    against: the front end's --tokenizer, the shipped byte-level one for a built-in model, the
    tokenizer a GGUF file's metadata describes (rebuilt as the front end builds it, written once
    to a folder of its own), or (left None) the checkpoint folder's own, which the engine finds
    by the model's name."""
    from api_server.tokenizer.build_tokenizer import TOKENIZER_DIR
    from worker.models.names import MODEL_NAMES

    if tokenizer is None and model in MODEL_NAMES:
        tokenizer = str(TOKENIZER_DIR)
    elif tokenizer is None and model.endswith(".gguf") and Path(model).is_file():
        tokenizer = str(_gguf_tokenizer_folder(model))
    return msgspec.structs.replace(engine_config, tokenizer=tokenizer)


def _gguf_tokenizer_folder(model: str) -> Path:
    """A folder holding the tokenizer.json of GGUF file `model`, under ~/.cache/kvserve, named by
    the file's path, size and modification time."""
    import hashlib

    from api_server.tokenizer.gguf_tokenizer import gguf_tokenizer

    stat = Path(model).stat()
    key = f"{Path(model).resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    folder = (
        Path.home()
        / ".cache"
        / "kvserve"
        / "gguf-tokenizers"
        / hashlib.sha256(key).hexdigest()[:20]
    )
    if not (folder / "tokenizer.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer, _ = gguf_tokenizer(model)
        temporary = folder / f"tokenizer.json.{os.getpid()}"
        tokenizer.save(str(temporary))
        os.replace(temporary, folder / "tokenizer.json")
    return folder


def _chat_template_source(value: str) -> str:
    """--chat-template's text: the file it names or, as vLLM also takes, a template itself."""
    from api_server.tokenizer.chat_template import ChatTemplate, ChatTemplateError

    path = Path(value)
    if path.is_file():
        source = path.read_text()
    elif "{" in value:
        source = value
    else:
        raise UsageError(f"--chat-template {value}: expected a template file or a Jinja template")
    try:
        ChatTemplate(source, {})
    except ChatTemplateError as exc:
        raise UsageError(f"--chat-template {value}: {exc}") from None
    return source


def demo_command(args: argparse.Namespace) -> int:
    from deploy.demo import DemoSettings, run_demo
    from deploy.logs import setup_logging
    from worker.models.names import ENCODER_DECODER_MODEL_NAMES, MODEL_NAMES

    if not 1 <= args.tensor_parallel_size <= 8:
        raise UsageError(f"-tp {args.tensor_parallel_size}: expected a rank count in [1, 8]")
    if args.model not in MODEL_NAMES:
        raise UsageError(f"--model {args.model}: expected one of {list(MODEL_NAMES)}")
    if args.model in ENCODER_DECODER_MODEL_NAMES:
        raise UsageError(
            f"--model {args.model}: its requests need encoder input, which the demo does not "
            "send; serve it with kvserve launch"
        )
    setup_logging("demo", args.log_level)
    return run_demo(
        DemoSettings(tp_size=args.tensor_parallel_size, model=args.model), args.log_level
    )


def front_end_stats(url: str, timeout_s: float, api_key: str | None) -> dict:
    """GET /router of a front end; OSError or ValueError saying what failed."""
    import urllib.request

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url {url}: expected http://HOST:PORT")
    request = urllib.request.Request(url.rstrip("/") + "/router")
    if api_key is not None:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def stats_command(args: argparse.Namespace) -> int:
    from engine_client.errors import EngineDeadError

    if getattr(args, "url", None) is not None:
        try:
            stats = front_end_stats(args.url, args.timeout_s, args.api_key)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        except OSError as exc:
            print(f"kvserve stats: {args.url}: {exc}", file=sys.stderr)
            return 1
        for idx, engine in enumerate(stats["engines"]):
            print(
                f"engine {idx} {engine['address']}: {engine.get('index_blocks', 0)} blocks "
                f"indexed, {engine['decisions']} requests routed, kv role "
                f"{engine.get('kv_role', 'both')}"
            )
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    from engine_client.sync_client import EngineClient

    with EngineClient(args.address, args.timeout_s, keys_from(args, "client")) as client:
        try:
            stats = client.get_stats()
        except (TimeoutError, EngineDeadError) as exc:
            print(f"kvserve stats: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


def reset_command(args: argparse.Namespace) -> int:
    from engine_client.errors import EngineDeadError, UtilityCallError
    from engine_client.sync_client import EngineClient

    with EngineClient(args.address, args.timeout_s, keys_from(args, "client")) as client:
        try:
            client.reset_prefix_cache()
        except (UtilityCallError, TimeoutError, EngineDeadError) as exc:
            print(f"kvserve reset-prefix-cache: {exc}", file=sys.stderr)
            return 1
    print("prefix cache reset")
    return 0
