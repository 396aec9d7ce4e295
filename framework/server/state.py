"""What every handler shares: the engine client, the server config, metrics and admission."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from litestar import Request
from litestar.background_tasks import BackgroundTask

from framework.errors import ConfigError, RequestFailedError
from framework.multimodal.sources import MediaSources
from framework.server.engine_client import AsyncEngineClient, EngineDeadError
from framework.server.errors import APIError, error_event
from framework.server.metrics import ServerMetrics

T = TypeVar("T")


@dataclass(slots=True)
class ServerConfig:
    """Settings of the HTTP layer (the engine's settings go to the engine process)."""

    served_model_names: list[str] = field(default_factory=list)
    model_root: str | None = None
    api_keys: list[str] = field(default_factory=list)
    max_num_seqs: int = 256
    #: Sequences admitted beyond ``max_num_seqs`` before answering 429; None = unlimited.
    max_queued_requests: int | None = 1024
    #: Prompt tokens in flight at which new requests get 429; None = unlimited.
    max_queued_tokens: int | None = 1 << 20
    max_request_bytes: int = 8 << 20
    #: Where ``image_url`` parts may point beyond data URLs (``--allowed-local-media-path``,
    #: ``--allowed-media-domains``, ``--media-fetch-timeout``).
    media_sources: MediaSources = field(default_factory=MediaSources)
    #: Seconds a client may take to send its request body (408 after); None = no deadline.
    request_body_timeout_s: float | None = 30.0
    #: The largest ``n`` (choices per prompt) of a chat or completions request.
    max_n: int = 128
    #: The most prompts of one completions request, and inputs of one embeddings request.
    max_prompts: int = 128
    max_embedding_inputs: int = 256
    #: Default ``max_tokens`` when a request gives none (None: the room left in the context).
    max_gen_tokens: int | None = None
    #: Defaults for requests that leave the penalties unset.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    retry_after_s: int = 1
    #: ``--enforce-parser`` / ``--reasoning-parser`` (None: picked from the chat template; "none": off).
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    #: ``--chat-template``: Jinja text that replaces the model's chat template (None: the model's).
    chat_template: str | None = None
    #: ``--vllm-metrics``: /metrics exports every metric under its vLLM name too.
    vllm_metrics: bool = False
    #: ``--log-stats-interval``: seconds between two stats lines in the log while the engine works (0: none).
    log_stats_interval_s: float = 10.0
    #: The Responses API's store of responses (``previous_response_id``, GET): most kept, seconds kept.
    max_stored_responses: int = 1000
    stored_response_ttl_s: float = 3600.0
    #: MCP servers in the ``mcpServers`` format (``--mcp-config`` / ``--mcp-command``); None: no MCP.
    mcp_servers: dict[str, Any] | None = None
    #: ``--mcp-execute``: clients may ask the server to run MCP tools (``mcp_execute``) on every
    #: configured server; without it only servers whose config says ``"execute": true`` run tools.
    mcp_execute: bool = False
    #: Caps on one request's MCP execution: calls run per round, bytes of each result, seconds in all.
    mcp_max_calls_per_round: int = 8
    mcp_max_result_bytes: int = 64 << 10
    mcp_max_time_s: float = 300.0
    #: Where the server listens (the Host and Origin checks of :mod:`framework.server.origins`).
    bind_host: str | None = "127.0.0.1"
    is_unix_socket: bool = False
    #: ``--allowed-hosts`` (beyond loopback names, IP addresses and the bind address) and
    #: ``--allowed-origins`` (CORS); ``*`` allows any.
    allowed_hosts: list[str] = field(default_factory=list)
    allowed_origins: list[str] = field(default_factory=list)
    #: The web UI's port (``--ui-server``), whose origin is allowed; None without the UI.
    ui_port: int | None = None
    #: Supervision of the engine process: restart it when it dies (``--no-engine-restart`` turns it
    #: off), and answer 503 on /health when its loop has sent nothing for this many seconds.
    engine_restart: bool = True
    engine_heartbeat_timeout_s: float = 60.0


class ServerState:
    """Per-app state; handlers get it by dependency injection."""

    def __init__(self, client: AsyncEngineClient, config: ServerConfig) -> None:
        self.client = client
        self.config = config
        self.metrics = ServerMetrics(self.model_name, vllm_names=config.vllm_metrics)
        self.num_admitted = 0
        self.num_admitted_tokens = 0
        self.is_draining = False
        self.started = int(time.time())
        self.mcp: Any = None  # framework.server.mcp_client.MCPManager once started
        from framework.server.responses_store import ResponseStore

        #: the Responses API's stored responses (previous_response_id, GET / DELETE, background)
        self.responses = ResponseStore(config.max_stored_responses, config.stored_response_ttl_s)
        self._parsers: Any = None
        self._image_processor: Any = None  # (the VisionSpec, its processor)

    def served_parsers(self) -> Any:
        """The tool and reasoning parsers of this server (resolved once the tokenizer is known)."""
        if self._parsers is None:
            from framework.server.chat_tools import resolve_parsers

            try:
                tokenizer = getattr(self.client, "tokenizer", None)
                if tokenizer is None:  # no engine yet (requests are refused until it is ready): nothing to cache
                    return resolve_parsers(self.config.tool_parser, self.config.reasoning_parser, None)
                self._parsers = resolve_parsers(
                    self.config.tool_parser,
                    self.config.reasoning_parser,
                    tokenizer.chat_template,
                    lambda messages, tools: tokenizer.apply_chat_template(messages, tools=tools),
                )
            except ConfigError as error:
                raise APIError(500, str(error), code="parser_error") from None
        return self._parsers

    @property
    def model_name(self) -> str:
        names = self.config.served_model_names
        if names:
            return names[0]
        return self.config.model_root or "fw"

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The model's sampling defaults (``generation_config.json``) for requests that leave them unset."""
        return getattr(self.client.ready, "sampling_defaults", None) or {}

    @property
    def vision(self) -> Any:
        """How the model takes images (:class:`~framework.multimodal.inputs.VisionSpec`), or None."""
        return getattr(self.client.ready, "vision", None)

    @property
    def text_only_reason(self) -> str | None:
        """Why a model of a vision family takes no images (a GGUF without its vision projector), or None."""
        summary = getattr(self.client.ready, "summary", None) or {}
        return summary.get("text_only_reason")

    def image_processor(self) -> Any:
        """The vision model's image processor, built on first use (for the served engine's spec)."""
        spec = self.vision
        if self._image_processor is None or self._image_processor[0] is not spec:
            from framework.multimodal.inputs import load_processor

            self._image_processor = (spec, load_processor(spec))
        return self._image_processor[1]

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len

    def check_model(self, model: str | None) -> None:
        names = self.config.served_model_names or [self.model_name]
        if model is not None and model not in names:
            raise APIError(
                404,
                f"The model {model!r} does not exist; this server serves {', '.join(map(repr, names))}",
                param="model",
                code="model_not_found",
            )

    def admit(self, num_seqs: int) -> Admission:
        """Admit a request of ``num_seqs`` sequences, or answer 429 with Retry-After.

        Checked before the request is tokenized, against what is already in flight: sequences
        beyond ``max_num_seqs + --max-queued-requests``, or prompt tokens at
        ``--max-queued-tokens``. The returned :class:`Admission` counts the request's tokens once
        they are known and releases everything when called (idempotent).
        """
        config = self.config
        cap, token_cap = config.max_queued_requests, config.max_queued_tokens
        if cap is not None and self.num_admitted + num_seqs > config.max_num_seqs + cap:
            reason = f"{self.num_admitted} sequences in flight, --max-queued-requests {cap}"
        elif token_cap is not None and self.num_admitted_tokens >= token_cap:
            reason = f"{self.num_admitted_tokens} prompt tokens in flight, --max-queued-tokens {token_cap}"
        else:
            self.num_admitted += num_seqs
            return Admission(self, num_seqs)
        self.metrics.rejected.inc()
        raise APIError(
            429,
            f"the server is at capacity ({reason}); retry later",
            code="too_many_requests",
            headers={"Retry-After": str(config.retry_after_s)},
        )


class Admission:
    """One admitted request's share of the queue; call it to release (idempotent)."""

    def __init__(self, state: ServerState, num_seqs: int) -> None:
        self.state, self.num_seqs, self.num_tokens, self.released = state, num_seqs, 0, False

    def add_tokens(self, num_tokens: int) -> None:
        """Count the request's prompt tokens (after tokenizing) toward ``--max-queued-tokens``."""
        if not self.released:
            self.num_tokens += num_tokens
            self.state.num_admitted_tokens += num_tokens

    def __call__(self) -> None:
        if not self.released:
            self.released = True
            self.state.num_admitted -= self.num_seqs
            self.state.num_admitted_tokens -= self.num_tokens


def release_after(release: Callable[[], None], *generators: AsyncGenerator) -> BackgroundTask:
    """After a streamed response: close its generators and release admission.

    Litestar cancels a stream whose client disconnected but does not close its iterator; closing
    ``generators`` (outermost first) runs their ``finally`` blocks now, which aborts the engine
    requests, instead of whenever they are garbage-collected. Also runs when the stream never started.
    """

    async def run() -> None:
        try:
            for generator in generators:
                await generator.aclose()
        finally:
            release()

    return BackgroundTask(run)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_error(error: Exception) -> APIError:
    """Map an engine-side failure to the API error a client sees."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ConfigError):
        return APIError(400, str(error), code="invalid_value")
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), code="engine_dead")
    if isinstance(error, RequestFailedError):
        if error.out_of_memory:
            return APIError(503, str(error), code="out_of_memory", headers={"Retry-After": "1"})
        return APIError(500, str(error), code="engine_step_failed")
    return APIError(500, f"{type(error).__name__}: {error}", code="internal_error")


async def until_disconnect(
    request: Request, work: Awaitable[T], to_api_error: Callable[[Exception], APIError] | None = None
) -> T:
    """Await ``work``; if the client disconnects first, cancel it (which aborts its engine requests).

    Its errors become API errors through ``to_api_error`` (default :func:`engine_error`)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        await asyncio.gather(task, return_exceptions=True)  # let it abort its engine requests
        raise APIError(499, "the client disconnected", code="client_disconnected")
    try:
        return task.result()
    except Exception as error:
        raise (to_api_error or engine_error)(error) from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def sse_stream(events: AsyncIterator[Any], finalize: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """SSE framing: each event as ``data: {json}``, an error as an error event, then ``data: [DONE]``."""
    try:
        async for event in events:
            yield sse(event)
    except Exception as error:
        yield sse(error_event(engine_error(error)))
    finally:
        if finalize is not None:
            finalize()
    yield b"data: [DONE]\n\n"


async def typed_sse_stream(
    events: AsyncIterator[dict[str, Any]], error_event: Callable[[APIError], dict[str, Any]]
) -> AsyncIterator[bytes]:
    """SSE framing of typed events (the Responses and Messages APIs): ``event: <type>`` then
    ``data: {json}``, no ``[DONE]``; an exception the events did not handle is sent as ``error_event``."""
    try:
        async for event in events:
            yield f"event: {event['type']}\n".encode() + sse(event)
    except Exception as error:
        event = error_event(engine_error(error))
        yield f"event: {event['type']}\n".encode() + sse(event)
