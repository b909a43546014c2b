"""The Starlette app of `kvserve serve`: OpenAI routes over an EnginePool, the API key check, body
limits, and every error in OpenAI's shape. No route blocks the event loop or waits undeadlined.
"""

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from importlib.metadata import PackageNotFoundError, version

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from api_server.metrics import ApiMetrics, MetricsMiddleware
from api_server.openai.chat_output import ChatParsing
from api_server.openai.engine_requests import EngineJob, chat_jobs, completion_jobs, new_response_id
from api_server.openai.errors import ApiError
from api_server.openai.generation_config import load_generation_defaults, log_generation_defaults
from api_server.openai.ignored_fields import IgnoredFields
from api_server.openai.protocol import (
    CHAT_DECODER,
    COMPLETION_DECODER,
    ChatCompletionRequest,
    CompletionRequest,
    check_model,
    parse_body,
)
from api_server.openai.serving import JSON, ResponseShape, Serving
from api_server.openai.tokenization import (
    DETOKENIZE_DECODER,
    TOKENIZE_DECODER,
    detokenize,
    tokenize,
)
from api_server.routing.engine_pool import EnginePool
from api_server.routing.kv_event_subscriber import DEFAULT_SILENT_LIMIT_S
from api_server.routing.kv_scorer import KVScoreWeights
from api_server.routing.router import DEFAULT_ROUTING_POLICY, RoutingPolicy
from api_server.tokenizer.prompt_tokenizer import load_tokenizer
from engine_client.connection import DEFAULT_TIMEOUT_S
from protocol.config import CurveKeys

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
HEALTH_CHECK_TIMEOUT_S = 5.0  # /health waits at most this long for every engine
# A body this large is tokenized in a worker thread (the tokenizer releases the GIL on long
# texts): a 1.4 MB prompt takes about a second to tokenize, which the event loop, serving
# every other stream, must not wait out. Smaller ones stay on the loop, where they cost less.
THREAD_TOKENIZE_BODY_BYTES = 64 * 1024
ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/router",
    "/version",
    "/tokenize",
    "/detokenize",
)


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """Configuration of one front end; deploy/serve_cmd.py builds it from flags."""

    engine_addresses: tuple[str, ...]
    model: str  # --model: a built-in name or a checkpoint folder (/v1/models' root)
    block_size: int  # tokens per KV block: prefix affinity hashes the first block
    # --served-model-name: clients may send any of these as `model`; the first is reported
    served_model_names: tuple[str, ...] = ()  # () means the --model value
    tokenizer: str | None = None  # --tokenizer: a folder; None means the model's own
    api_key: str | None = None  # when set, /v1/ routes need `Authorization: Bearer KEY`
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    engine_timeout_s: float = DEFAULT_TIMEOUT_S  # longest wait for a request's next output
    engine_curve: CurveKeys | None = None  # client keypair for engines that are CURVE servers
    router_policy: RoutingPolicy = DEFAULT_ROUTING_POLICY  # --router-policy
    router_weights: KVScoreWeights | None = None  # --router-*-weight; None: the defaults
    kv_events_silent_limit_s: float = DEFAULT_SILENT_LIMIT_S  # --router-silent-limit-s
    chat_template: str | None = None  # --chat-template's text: replaces the tokenizer's own
    # --trust-request-chat-template: a request may bring its own chat_template (Jinja run in the
    # sandbox, but able to spend the front end's CPU), as vLLM allows only when told
    is_request_chat_template_trusted: bool = False
    tool_call_parser: str | None = None  # --tool-call-parser: hermes, llama3_json or mistral
    is_auto_tool_choice_enabled: bool = False  # --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser: qwen3 or deepseek_r1
    generation_config: str = "auto"  # --generation-config: auto, vllm or a folder


class ApiState:
    """What the routes share: settings, tokenizer, and (while the app runs) pool and metrics."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings
        self.served_names = settings.served_model_names or (settings.model,)
        self.tokenizer = load_tokenizer(settings.model, settings.tokenizer, settings.chat_template)
        mode = settings.generation_config
        self.generation_defaults = load_generation_defaults(mode, settings.model)
        log_generation_defaults(self.generation_defaults, mode)
        self.created = int(time.time())
        self.ignored_fields = IgnoredFields()  # unknown body fields, each logged once
        self.chat_parsing = ChatParsing(
            settings.tool_call_parser,
            settings.is_auto_tool_choice_enabled,
            settings.reasoning_parser,
        )
        self.serving: Serving | None = None
        self.metrics: ApiMetrics | None = None

    def running(self) -> tuple[Serving, ApiMetrics]:
        if self.serving is None or self.metrics is None:
            raise ApiError(503, "the server is starting or stopping", code="engine_unavailable")
        return self.serving, self.metrics


class EventStreamResponse(StreamingResponse):
    """A stream that is closed however it ends, so leaving it aborts its engine requests now
    rather than when the garbage collector finalizes it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with contextlib.aclosing(self.body_iterator):  # type: ignore[type-var]
            await super().__call__(scope, receive, send)


def _check_api_key(request: Request, state: ApiState) -> None:
    expected = state.settings.api_key
    if expected is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), expected.encode()):
        raise ApiError(401, "missing or wrong API key: expected 'Authorization: Bearer KEY'")


async def _read_body(request: Request, limit_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise ApiError(413, f"body of {declared} bytes: expected at most {limit_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise ApiError(413, f"body over {limit_bytes} bytes: expected at most {limit_bytes}")
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(
    request: Request, state: ApiState, decoder: msgspec.json.Decoder
) -> tuple[CompletionRequest | ChatCompletionRequest, int]:
    """The decoded body and its size in bytes."""
    _check_api_key(request, state)
    body = await _read_body(request, state.settings.max_body_bytes)
    parsed = parse_body(body, decoder, state.ignored_fields)
    check_model(parsed.model, state.served_names)
    return parsed, len(body)


def _check_request_template(chat_template: str | None, state: ApiState) -> None:
    if chat_template is not None and not state.settings.is_request_chat_template_trusted:
        raise ApiError(
            400,
            "chat_template: a request's own template is not accepted: expected none, or a "
            "server started with --trust-request-chat-template",
            param="chat_template",
        )


async def _build_jobs(num_body_bytes: int, build: Callable[[], list[EngineJob]]) -> list[EngineJob]:
    if num_body_bytes < THREAD_TOKENIZE_BODY_BYTES:
        return build()
    return await asyncio.to_thread(build)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Coroutine[object, object, dict]) -> dict:
    """The result of `work`, run in this task; a watcher cancels it (aborting its engine
    requests) when the client leaves. One task per request: the watcher."""
    handler = asyncio.current_task()
    assert handler is not None  # a route always runs inside the server's task
    is_answered = False

    def on_disconnect(watcher: asyncio.Future[None]) -> None:
        if not is_answered and not watcher.cancelled():
            handler.cancel()

    watcher = asyncio.ensure_future(_until_disconnect(request))
    watcher.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if not watcher.done() or watcher.cancelled():
            raise  # this handler itself was cancelled
        handler.uncancel()  # the cancel was ours: what follows may await again
        raise ApiError(499, "the client disconnected", code="client_closed_request") from None
    finally:
        is_answered = True
        watcher.cancel()


async def completions(state: ApiState, request: Request) -> Response:
    body, num_body_bytes = await _parse(request, state, COMPLETION_DECODER)
    assert isinstance(body, CompletionRequest)  # what COMPLETION_DECODER decodes
    serving, _ = state.running()
    shape = ResponseShape(
        new_response_id("cmpl"), serving.model, False, has_usage_per_chunk=body.has_usage_per_chunk
    )
    max_model_len, vocab_size = serving.pool.max_model_len, serving.pool.vocab_size
    jobs = await _build_jobs(
        num_body_bytes,
        partial(
            completion_jobs,
            body,
            serving.tokenizer,
            shape.response_id,
            max_model_len,
            vocab_size,
            serving.generation_defaults,
        ),
    )
    return await _respond(request, serving, jobs, shape, body.stream, body.include_usage)


async def chat_completions(state: ApiState, request: Request) -> Response:
    body, num_body_bytes = await _parse(request, state, CHAT_DECODER)
    assert isinstance(body, ChatCompletionRequest)  # what CHAT_DECODER decodes
    _check_request_template(body.chat_template, state)
    serving, _ = state.running()
    response_id = new_response_id("chatcmpl")
    shape = ResponseShape(
        response_id, serving.model, True, has_usage_per_chunk=body.has_usage_per_chunk
    )
    max_model_len, vocab_size = serving.pool.max_model_len, serving.pool.vocab_size

    def build() -> list[EngineJob]:
        return chat_jobs(
            body,
            serving.tokenizer,
            shape.response_id,
            max_model_len,
            state.chat_parsing,
            vocab_size=vocab_size,
            defaults=serving.generation_defaults,
        )

    jobs = await _build_jobs(num_body_bytes, build)
    return await _respond(request, serving, jobs, shape, body.stream, body.include_usage)


async def _respond(
    request: Request,
    serving: Serving,
    jobs: list[EngineJob],
    shape: ResponseShape,
    is_stream: bool,
    include_usage: bool,
) -> Response:
    if not is_stream:
        body = await _unless_disconnected(request, serving.complete(jobs, shape))
        return Response(JSON.encode(body), media_type="application/json")
    started = await serving.first_outputs(jobs)
    events = serving.stream(started, shape, include_usage)
    return EventStreamResponse(events, media_type="text/event-stream")


async def models(state: ApiState, request: Request) -> Response:
    """One card per served name, as vLLM lists them: the model path as root, and max_model_len
    once an engine has told it."""
    _check_api_key(request, state)
    max_model_len = state.serving.pool.max_model_len if state.serving is not None else None
    cards = [
        {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "kvserve",
            "root": state.settings.model,
            "parent": None,
            "max_model_len": max_model_len,
        }
        for name in state.served_names
    ]
    return JSONResponse({"object": "list", "data": cards})


async def health(state: ApiState, request: Request) -> Response:
    serving, _ = state.running()
    async with asyncio.timeout(HEALTH_CHECK_TIMEOUT_S):
        await serving.pool.check_health()
    engines = {record.address: record.is_healthy for record in serving.pool.records}
    return JSONResponse({"engines": engines}, status_code=200 if any(engines.values()) else 503)


async def metrics(state: ApiState, request: Request) -> Response:
    _, api_metrics = state.running()
    text = await api_metrics.render()
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def router_stats(state: ApiState, request: Request) -> Response:
    """The router's policy and, per engine, its index size and decision counts; with
    `?include_keys=true`, the index's keys too."""
    _check_api_key(request, state)
    serving, _ = state.running()
    include_keys = request.query_params.get("include_keys", "false").lower() == "true"
    return JSONResponse(serving.pool.router_stats(include_keys))


async def tokenize_route(state: ApiState, request: Request) -> Response:
    """vLLM's /tokenize: a prompt's or a chat's ids, with the tokenizer alone (no engine)."""
    _check_api_key(request, state)
    body = await _read_body(request, state.settings.max_body_bytes)
    parsed = parse_body(body, TOKENIZE_DECODER, state.ignored_fields)
    check_model(parsed.model, state.served_names)
    _check_request_template(parsed.chat_template, state)
    max_model_len = state.serving.pool.max_model_len if state.serving is not None else None
    work = partial(tokenize, parsed, state.tokenizer, max_model_len)
    response = work() if len(body) < THREAD_TOKENIZE_BODY_BYTES else await asyncio.to_thread(work)
    return Response(JSON.encode(response), media_type="application/json")


async def detokenize_route(state: ApiState, request: Request) -> Response:
    """vLLM's /detokenize: the text of a list of ids."""
    _check_api_key(request, state)
    body = await _read_body(request, state.settings.max_body_bytes)
    parsed = parse_body(body, DETOKENIZE_DECODER, state.ignored_fields)
    check_model(parsed.model, state.served_names)
    work = partial(detokenize, parsed, state.tokenizer)
    response = work() if len(body) < THREAD_TOKENIZE_BODY_BYTES else await asyncio.to_thread(work)
    return Response(JSON.encode(response), media_type="application/json")


async def version_info(request: Request) -> Response:
    try:
        kvserve_version = version("kvserve")
    except PackageNotFoundError:
        kvserve_version = "unknown"
    return JSONResponse({"version": kvserve_version})


def _error_response(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if exc.status >= 500:
        logger.warning("%s %s answered %d: %s", request.method, request.url.path, exc.status, exc)
    return _error_response(exc.status, exc.body())


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    message = f"{request.method} {request.url.path}: {str(exc.detail).lower()}"
    return _error_response(exc.status_code, ApiError(exc.status_code, message).body())


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("%s %s failed", request.method, request.url.path)
    return _error_response(500, ApiError(500, f"internal error: {exc}").body())


def create_app(settings: ApiSettings) -> Starlette:
    """The app; its lifespan connects to the engines and closes the connections."""
    state = ApiState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        pool = EnginePool(
            list(settings.engine_addresses),
            settings.block_size,
            settings.engine_timeout_s,
            settings.engine_curve,
            settings.router_policy,
            settings.router_weights,
            settings.kv_events_silent_limit_s,
        )
        pool.start()
        state.metrics = ApiMetrics(pool, set(ROUTES))
        served = state.served_names[0]
        state.serving = Serving(
            pool, state.tokenizer, served, state.metrics.token_latency, state.generation_defaults
        )
        logger.info(
            "serving %s from %d engine(s), routed by %s",
            served,
            len(pool.handles),
            settings.router_policy.value,
        )
        try:
            yield
        finally:
            state.serving = None
            await pool.close()

    # Starlette rather than FastAPI: each endpoint parses its own body, and FastAPI's extra
    # middleware (telemetry, body limit, exit stack) only added latency to every request
    routes = [
        Route("/v1/completions", partial(completions, state), methods=["POST"]),
        Route("/v1/chat/completions", partial(chat_completions, state), methods=["POST"]),
        Route("/v1/models", partial(models, state), methods=["GET"]),
        Route("/health", partial(health, state), methods=["GET"]),
        Route("/metrics", partial(metrics, state), methods=["GET"]),
        Route("/router", partial(router_stats, state), methods=["GET"]),
        Route("/version", version_info, methods=["GET"]),
        Route("/tokenize", partial(tokenize_route, state), methods=["POST"]),
        Route("/detokenize", partial(detokenize_route, state), methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(MetricsMiddleware, metrics=lambda: state.metrics)],
        exception_handlers={
            ApiError: _on_api_error,
            StarletteHTTPException: _on_http_error,
            Exception: _on_unexpected,
        },
        lifespan=lifespan,
    )
    app.state.kvserve = state
    return app
