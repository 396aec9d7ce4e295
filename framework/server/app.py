"""The Litestar app: ``create_app(engine_client, config)``.

Routes are grouped by resource (OpenAI API under ``/v1``, service endpoints at the root); the
shared :class:`ServerState` is injected. The lifespan starts the engine process in the
background, so ``/health`` answers 503 while the model loads, and stops it on shutdown. Plugins
add routes (``register_routes``) and adjust the app config (``app_init``) when the app is built,
and hear ``startup`` once the engine is ready and ``shutdown`` before it stops.
Every request first passes :class:`~framework.server.origins.OriginGuard` (Host, Origin, CORS,
JSON bodies), then the API key check (keys compared in constant time).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from litestar import Controller, Litestar, Request, Response, delete, get, post
from litestar.config.app import AppConfig
from litestar.di import NamedDependency, Provide
from litestar.exceptions import HTTPException
from litestar.middleware import DefineMiddleware
from litestar.params import FromPath
from prometheus_client import CONTENT_TYPE_LATEST

import framework
from framework import plugins
from framework.engine.messages import Ready
from framework.multimodal.images import FORMATS, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from framework.server.chat_images import chat_prompt_with_images, prepare_images_off_loop
from framework.server.chat_prompt import chat_prompt_ids, template_messages
from framework.server.engine_client import AsyncEngineClient
from framework.server.errors import (
    APIError,
    api_error_handler,
    bad_request,
    decode_body,
    http_exception_handler,
    internal_error_handler,
)
from framework.server.limits import read_body
from framework.server.metrics import stats_line
from framework.server.origins import OriginGuard, OriginPolicy
from framework.server.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VisionInfo,
)
from framework.server.serving_chat import create_chat_completion
from framework.server.serving_completion import create_completion
from framework.server.serving_embedding import create_embedding
from framework.server.serving_messages import count_tokens, create_message
from framework.server.serving_responses import (
    cancel_response,
    create_response,
    delete_response,
    get_response,
    list_input_items,
)
from framework.server.state import ServerConfig, ServerState

log = logging.getLogger("fw.server")

#: The injected per-app state (``Provide`` under the name ``server``).
Server = NamedDependency[ServerState]

#: Paths that answer without an API key and while the model loads.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


class OpenAIController(Controller):
    path = "/v1"

    @post("/chat/completions", status_code=200)
    async def chat_completions(self, server: Server, request: Request) -> Response:
        return await create_chat_completion(server, request)

    @post("/completions", status_code=200)
    async def completions(self, server: Server, request: Request) -> Response:
        return await create_completion(server, request)

    @post("/responses", status_code=200)
    async def responses(self, server: Server, request: Request) -> Response:
        return await create_response(server, request)

    @get("/responses/{response_id:str}")
    async def response(self, server: Server, response_id: FromPath[str]) -> dict[str, Any]:
        return get_response(server, response_id)

    @get("/responses/{response_id:str}/input_items")
    async def response_input_items(self, server: Server, response_id: FromPath[str]) -> dict[str, Any]:
        return list_input_items(server, response_id)

    @delete("/responses/{response_id:str}", status_code=200)
    async def delete_response(self, server: Server, response_id: FromPath[str]) -> dict[str, Any]:
        return delete_response(server, response_id)

    @post("/responses/{response_id:str}/cancel", status_code=200)
    async def cancel_response(self, server: Server, response_id: FromPath[str]) -> dict[str, Any]:
        return await cancel_response(server, response_id)

    @post("/messages", status_code=200)
    async def messages(self, server: Server, request: Request) -> Response:
        return await create_message(server, request)

    @post("/messages/count_tokens", status_code=200)
    async def count_message_tokens(self, server: Server, request: Request) -> dict[str, int]:
        return await count_tokens(server, request)

    @post("/embeddings", status_code=200)
    async def embeddings(self, server: Server, request: Request) -> EmbeddingResponse:
        return await create_embedding(server, request)

    @get("/models")
    async def models(self, server: Server) -> ModelList:
        return ModelList(
            data=[_model_card(server, name) for name in server.config.served_model_names or [server.model_name]]
        )

    @get("/mcp/servers")
    async def mcp_servers(self, server: Server) -> dict[str, Any]:
        """fw extension: the configured MCP servers, each with its status (and error) and tools."""
        return {"object": "list", "data": server.mcp.status() if server.mcp is not None else []}

    @get("/models/{model_id:path}")
    async def model(self, server: Server, model_id: FromPath[str]) -> ModelCard:
        model_id = model_id.lstrip("/")
        server.check_model(model_id)
        return _model_card(server, model_id)


class ServiceController(Controller):
    path = "/"

    @get("/health")
    async def health(self, server: Server) -> Response:
        client = server.client
        if server.is_draining:
            return Response({"status": "draining"}, status_code=503)
        restarts = {"engine_restarts": client.num_restarts}
        if client.is_restarting:
            return Response({"status": "restarting", "message": client.dead_reason, **restarts}, status_code=503)
        if client.dead_reason is not None:
            return Response({"status": "error", "message": client.dead_reason, **restarts}, status_code=503)
        if not client.is_ready:
            return Response({"status": "loading"}, status_code=503)
        if client.is_unresponsive:
            return Response(
                {
                    "status": "unresponsive",
                    **restarts,
                    "message": f"the engine loop has sent nothing for over {client.heartbeat_timeout_s:g} s",
                },
                status_code=503,
            )
        return Response({"status": "ok", **restarts}, status_code=200)

    @get("/version")
    async def version(self) -> dict[str, str]:
        return {"version": framework.__version__}

    @get("/metrics")
    async def metrics(self, server: Server) -> Response:
        stats = None
        if server.client.is_healthy:
            with contextlib.suppress(Exception):
                stats = await server.client.stats(timeout_s=5.0)
        return Response(server.metrics.render(stats, server.client.num_restarts), media_type=CONTENT_TYPE_LATEST)

    @post("/tokenize", status_code=200)
    async def tokenize(self, server: Server, request: Request) -> TokenizeResponse:
        body = decode_body(await read_body(request, server.config.request_body_timeout_s), TokenizeRequest)
        server.check_model(body.model)
        tokenizer = server.client.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        if body.prompt is not None:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            chat = ChatCompletionRequest(
                messages=body.messages,
                chat_template_kwargs=body.chat_template_kwargs,
                add_generation_prompt=body.add_generation_prompt,
            )
            processed = await prepare_images_off_loop(server, chat)
            if processed is None:
                tokens = chat_prompt_ids(tokenizer, chat)
            else:  # a vision model's images, each image token repeated per embedding as generation sees it
                messages = template_messages(chat.messages, allow_images=True)
                tokens = chat_prompt_with_images(server, chat, None, messages, processed)[1]
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=server.max_model_len)

    @get("/tokenizer_info")
    async def tokenizer_info(self, server: Server) -> dict[str, Any]:
        """The tokenizer's special tokens and chat template (vLLM's endpoint, which lm-eval's
        ``local-completions`` probes to tokenize through ``/tokenize`` instead of the Hub)."""
        tokenizer = server.client.tokenizer
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "chat_template": tokenizer.chat_template,
            "model_max_length": server.max_model_len,
            "vocab_size": tokenizer.vocab_size,
        }

    @post("/detokenize", status_code=200)
    async def detokenize(self, server: Server, request: Request) -> DetokenizeResponse:
        body = decode_body(await read_body(request, server.config.request_body_timeout_s), DetokenizeRequest)
        server.check_model(body.model)
        vocab = server.client.ready.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return DetokenizeResponse(prompt=server.client.tokenizer.decode(body.tokens))


def is_known_key(key: str | None, keys: list[str]) -> bool:
    """Whether ``key`` is one of ``keys``, compared in constant time (every key, every byte)."""
    if key is None:
        return False
    offered = key.encode()
    found = False
    for known in keys:
        found |= hmac.compare_digest(offered, known.encode())
    return found


async def _log_stats(state: ServerState) -> None:
    """Every ``--log-stats-interval`` seconds, while the engine has work or did some since the last
    line, log :func:`stats_line` (throughput over the time since the previous sample).

    A sample the engine is too busy to answer is skipped, not lost: the next one counts the tokens
    since the last sample that did answer, starting from zero at start-up."""
    interval = state.config.log_stats_interval_s
    previous, previous_at = None, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        if not state.client.is_healthy:
            continue
        try:
            stats = await state.client.stats(timeout_s=max(interval, 5.0))
        except Exception:  # the engine is restarting or busy; the next interval tries again
            continue
        now = time.monotonic()
        before = (previous.prompt_tokens, previous.generation_tokens) if previous is not None else (0, 0)
        if (stats.prompt_tokens, stats.generation_tokens) != before or stats.num_running or stats.num_waiting:
            print(stats_line(previous, stats, now - previous_at), flush=True)
        previous, previous_at = stats, now


def _model_card(state: ServerState, name: str) -> ModelCard:
    try:
        tool_calling = state.served_parsers().info()
    except APIError:  # a parser plugin that fails to load: chat requests say why
        tool_calling = None
    return ModelCard(
        id=name,
        created=state.started,
        max_model_len=state.max_model_len,
        root=state.config.model_root,
        tool_calling=tool_calling,
        vision=_vision_info(state),
    )


def _vision_info(state: ServerState) -> VisionInfo | None:
    """The ``vision`` field of a model card: how many images, of which formats and sizes, it takes."""
    if state.vision is None:
        return None
    return VisionInfo(
        max_images=state.vision.max_images,
        formats=sorted({f"image/{subtype}" for subtype in FORMATS}),
        max_image_bytes=MAX_IMAGE_BYTES,
        max_image_pixels=MAX_IMAGE_PIXELS,
        max_request_bytes=state.config.max_request_bytes,
    )


def create_app(
    engine_client: AsyncEngineClient,
    config: ServerConfig,
    *,
    start_engine: bool = True,
    on_ready: Callable[[Ready], None] | None = None,
    on_load_error: Callable[[str], None] | None = None,
) -> Litestar:
    """Build the app around ``engine_client``.

    With ``start_engine`` the lifespan starts the engine process (``on_ready`` / ``on_load_error``
    are called when it reports) and shuts it down when the app stops; otherwise the caller has
    started it already.
    """
    state = ServerState(engine_client, config)

    async def guard(request: Request) -> None:
        path = request.url.path
        if path in OPEN_PATHS:
            return
        if config.api_keys:
            header = request.headers.get("authorization", "")
            # OpenAI clients send a bearer token, Anthropic clients an x-api-key header
            key = header[7:].strip() if header[:7].lower() == "bearer " else request.headers.get("x-api-key")
            if not is_known_key(key, config.api_keys):
                raise APIError(
                    401,
                    "Incorrect API key provided"
                    if key
                    else "Missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    code="invalid_api_key",
                )
        if state.is_draining:
            raise APIError(503, "the server is shutting down", code="server_draining")
        client = state.client
        if client.is_restarting:
            raise APIError(
                503,
                f"the engine is restarting: {client.dead_reason}",
                code="engine_restarting",
                headers={"Retry-After": "1"},
            )
        if client.dead_reason is not None:
            raise APIError(503, f"the engine is not running: {client.dead_reason}", code="engine_dead")
        if not client.is_ready:
            raise APIError(
                503, "the model is still loading; retry shortly", code="model_loading", headers={"Retry-After": "1"}
            )

    started = asyncio.Event()  # the plugins' startup hooks ran: their shutdown hooks run at the end

    async def plugins_startup() -> None:
        await plugins.call_lifecycle("startup", engine=engine_client)
        started.set()

    async def start_then_plugins() -> Ready:
        ready = await engine_client.start()
        await plugins_startup()
        return ready

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        task = None
        if start_engine:
            task = asyncio.create_task(start_then_plugins())
            task.add_done_callback(_report)
        else:  # the caller started the engine already
            await plugins_startup()
        if config.mcp_servers:
            from framework.server.mcp_client import MCPManager

            state.mcp = MCPManager(config.mcp_servers, execute_all=config.mcp_execute)
            await state.mcp.start()
        stats_task = asyncio.create_task(_log_stats(state)) if config.log_stats_interval_s > 0 else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            if task is not None and not task.done():
                task.cancel()
            if state.mcp is not None:
                await state.mcp.close()
            if started.is_set():
                await plugins.call_lifecycle("shutdown", engine=engine_client)
            await engine_client.shutdown()

    def _report(task: asyncio.Task) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            if on_ready is not None:
                on_ready(task.result())
        elif on_load_error is not None:
            on_load_error(str(error))
        else:
            log.error("the engine failed to start: %s", error)

    policy = OriginPolicy.for_server(
        config.bind_host, config.is_unix_socket, config.allowed_hosts, config.allowed_origins, config.ui_port
    )
    handlers: dict[Any, Callable] = {
        APIError: api_error_handler,
        HTTPException: http_exception_handler,
        Exception: internal_error_handler,
    }
    plugin_routes = [handler for routes in plugins.call_all("register_routes") for handler in routes]

    def plugins_app_init(app_config: AppConfig) -> AppConfig:
        plugins.call_all("app_init", app_config=app_config)
        return app_config

    app = Litestar(
        route_handlers=[OpenAIController, ServiceController, *plugin_routes],
        on_app_init=[plugins_app_init],
        dependencies={"server": Provide(lambda: state, use_cache=True, sync_to_thread=False)},
        before_request=guard,
        middleware=[DefineMiddleware(OriginGuard, policy=policy)],
        exception_handlers=handlers,
        lifespan=[lifespan],
        request_max_body_size=config.max_request_bytes,
        openapi_config=None,
    )
    app.state.server = state
    return app
