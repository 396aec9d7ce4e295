"""``fw serve``: the OpenAI-compatible server (the engine runs in its own process)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from cli import options as o


@o.with_engine_options()
def serve(
    engine: o.EngineOptions,
    model_arg: Annotated[
        str | None,
        typer.Argument(
            metavar="[MODEL]",
            help="The model, as --m gives it: Hugging Face repo id, local directory or .gguf file.",
            show_default=False,
        ),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            "--h",
            "--host",
            help="Bind address: host, host:port, \\[ipv6]:port, tcp://host[:port] or unix:///path (default 127.0.0.1; --h 0.0.0.0 serves the network).",
        ),
    ] = None,
    port: Annotated[int, typer.Option("--p", "--port", help="TCP port when --h gives none.")] = 2000,
    max_gen_tokens: Annotated[
        int | None, typer.Option("--max-gen-tokens", help="Default max_tokens of requests that give none.")
    ] = None,
    frequency_penalty: Annotated[
        float, typer.Option("--frequency-penalty", help="Default frequency penalty (-2 to 2).")
    ] = 0.0,
    presence_penalty: Annotated[
        float, typer.Option("--presence-penalty", help="Default presence penalty (-2 to 2).")
    ] = 0.0,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            "--api-key",
            help="Require this bearer key (repeat for several); FW_API_KEY or --api-key-file keep it off the command line.",
        ),
    ] = None,
    api_key_file: Annotated[
        str | None, typer.Option("--api-key-file", help="File with accepted bearer keys, one a line.")
    ] = None,
    allowed_origins: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-origins",
            help="Web origins that may call the API from a browser (CORS), e.g. http://localhost:5173; repeat or separate with commas; * allows any. Default: none.",
        ),
    ] = None,
    allowed_hosts: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-hosts",
            help="Host names the server answers to beyond loopback names, IP addresses and the bind address (DNS-rebinding guard); repeat or separate with commas; * allows any.",
        ),
    ] = None,
    served_model_name: Annotated[
        list[str] | None, typer.Option("--served-model-name", help="Model name(s) clients use (default: --m).")
    ] = None,
    max_queued_requests: Annotated[
        int,
        typer.Option(
            "--max-queued-requests", help="Sequences allowed to wait beyond --max-num-seqs before answering 429."
        ),
    ] = 1024,
    max_queued_tokens: Annotated[
        int, typer.Option("--max-queued-tokens", help="Prompt tokens in flight at which new requests get 429.")
    ] = 1 << 20,
    max_request_bytes: Annotated[
        int, typer.Option("--max-request-bytes", help="Largest request body accepted (413 above).")
    ] = 8 << 20,
    allowed_local_media_path: Annotated[
        str | None,
        typer.Option(
            "--allowed-local-media-path",
            help="Directory whose files image_url parts may name (local paths, file: URLs); default: none.",
        ),
    ] = None,
    allowed_media_domains: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-media-domains",
            help="Hosts whose http(s) image URLs are fetched (repeat or separate with commas; * any); default: none.",
        ),
    ] = None,
    media_fetch_timeout: Annotated[
        float, typer.Option("--media-fetch-timeout", help="Seconds one image download may take.")
    ] = 10.0,
    max_n: Annotated[
        int, typer.Option("--max-n", help="Largest n (choices per prompt) of a request (400 above).")
    ] = 128,
    max_prompts: Annotated[
        int, typer.Option("--max-prompts", help="Most prompts in one completions request (400 above).")
    ] = 128,
    max_embedding_inputs: Annotated[
        int, typer.Option("--max-embedding-inputs", help="Most inputs in one embeddings request (400 above).")
    ] = 256,
    request_body_timeout: Annotated[
        float,
        typer.Option("--request-body-timeout", help="Seconds a client may take to send its request body (408 after)."),
    ] = 30.0,
    limit_concurrency: Annotated[
        int,
        typer.Option("--limit-concurrency", help="Most connections and requests at once; beyond it new ones get 503."),
    ] = 1024,
    shutdown_timeout: Annotated[
        float, typer.Option("--shutdown-timeout", help="Seconds in-flight requests may take to finish after SIGTERM.")
    ] = 30.0,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "warning",
    ui_server: Annotated[
        bool,
        typer.Option(
            "--ui-server", help="Also serve the chat web UI, on the API port minus one (--p 2000: http://host:1999)."
        ),
    ] = False,
    enforce_parser: Annotated[
        str | None,
        typer.Option(
            "--enforce-parser",
            "--tool-call-parser",
            help="Tool-call parser (qwen, hermes, qwen_coder, json, mistral, llama3, none); default: picked from the chat template.",
        ),
    ] = None,
    reasoning_parser: Annotated[
        str | None,
        typer.Option(
            "--reasoning-parser",
            help="Reasoning parser (qwen3, deepseek_r1, none); default: picked from the chat template.",
        ),
    ] = None,
    vllm_metrics: Annotated[
        bool,
        typer.Option(
            "--vllm-metrics",
            help="Also export every /metrics series under its vLLM name (vllm:...), for dashboards made for vLLM.",
        ),
    ] = False,
    log_stats_interval: Annotated[
        float,
        typer.Option(
            "--log-stats-interval",
            help="Seconds between two stats lines (throughput, running, waiting, KV-cache use) in the log while the engine works; 0 turns them off.",
        ),
    ] = 10.0,
    max_stored_responses: Annotated[
        int,
        typer.Option(
            "--max-stored-responses",
            help="Responses API: most responses kept in memory for previous_response_id and GET (the oldest go first).",
        ),
    ] = 1000,
    stored_response_ttl: Annotated[
        float, typer.Option("--stored-response-ttl", help="Responses API: seconds a stored response is kept.")
    ] = 3600.0,
    chat_template: Annotated[
        str | None,
        typer.Option(
            "--chat-template",
            help="A Jinja chat template (a file, or the template text itself) that replaces the model's.",
        ),
    ] = None,
    mcp_config: Annotated[
        str | None,
        typer.Option(
            "--mcp-config",
            help="JSON file of MCP servers in the mcpServers format (command/args/env for stdio, url for streamable HTTP).",
        ),
    ] = None,
    mcp_command: Annotated[
        str | None, typer.Option("--mcp-command", help="Command of one stdio MCP server (named 'mcp').")
    ] = None,
    mcp_args: Annotated[
        str | None, typer.Option("--mcp-args", help="Arguments of --mcp-command, as one shell-quoted string.")
    ] = None,
    mcp_execute: Annotated[
        bool,
        typer.Option(
            "--mcp-execute",
            help='Let clients ask the server to run MCP tools (mcp_execute: true) on every MCP server; without it only servers with "execute": true in --mcp-config run tools.',
        ),
    ] = False,
    mcp_max_calls_per_round: Annotated[
        int,
        typer.Option(
            "--mcp-max-calls-per-round",
            help="MCP tool calls the server runs in one round of a request; further calls get an error result.",
        ),
    ] = 8,
    mcp_max_result_bytes: Annotated[
        int,
        typer.Option(
            "--mcp-max-result-bytes",
            help="Bytes of one MCP tool result passed to the model; a longer result is truncated with a note.",
        ),
    ] = 64 << 10,
    mcp_max_time: Annotated[
        float,
        typer.Option(
            "--mcp-max-time",
            help="Seconds of MCP tool calls one request may spend in all; then calls get an error result and no further round runs.",
        ),
    ] = 300.0,
    no_engine_restart: Annotated[
        bool,
        typer.Option("--no-engine-restart", help="Do not restart the engine process when it dies (/health stays 503)."),
    ] = False,
    engine_heartbeat_timeout: Annotated[
        float,
        typer.Option(
            "--engine-heartbeat-timeout",
            help="Seconds without a sign of life from the engine loop after which /health answers 503.",
        ),
    ] = 60.0,
) -> None:
    """Serve a model with an OpenAI-compatible API (without --m: the embedded default model)."""
    from framework.errors import ConfigError, FwError

    try:
        from framework.server.launcher import exposure_warning, parse_bind, run_server
        from framework.server.origins import check_origins
        from framework.server.state import ServerConfig

        bind = parse_bind(host, port)
        keys = api_keys(api_key, api_key_file)
        origins = check_origins(_split(allowed_origins))
        for name, value in (
            ("--mcp-max-calls-per-round", mcp_max_calls_per_round),
            ("--mcp-max-result-bytes", mcp_max_result_bytes),
            ("--mcp-max-time", mcp_max_time),
        ):
            if value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        for name, value in (("--frequency-penalty", frequency_penalty), ("--presence-penalty", presence_penalty)):
            if not -2.0 <= value <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {value}")
        if not engine_heartbeat_timeout > 0:
            raise ConfigError(f"--engine-heartbeat-timeout must be > 0 seconds, got {engine_heartbeat_timeout}")
        if max_gen_tokens is not None and max_gen_tokens < 1:
            raise ConfigError(f"--max-gen-tokens must be >= 1, got {max_gen_tokens}")
        for name, value, low in (
            ("--max-queued-requests", max_queued_requests, 0),
            ("--max-queued-tokens", max_queued_tokens, 1),
            ("--max-n", max_n, 1),
            ("--max-prompts", max_prompts, 1),
            ("--max-embedding-inputs", max_embedding_inputs, 1),
            ("--limit-concurrency", limit_concurrency, 1),
        ):
            if value < low:
                raise ConfigError(f"{name} must be >= {low}, got {value}")
        if not request_body_timeout > 0:
            raise ConfigError(f"--request-body-timeout must be > 0 seconds, got {request_body_timeout}")
        if log_stats_interval < 0:
            raise ConfigError(f"--log-stats-interval must be >= 0 seconds, got {log_stats_interval}")
        if max_stored_responses < 0 or not stored_response_ttl > 0:
            raise ConfigError(
                "--max-stored-responses must be >= 0 and --stored-response-ttl > 0 seconds; got "
                f"{max_stored_responses} and {stored_response_ttl}"
            )
        from framework.server.chat_tools import check_parser_names
        from framework.server.mcp_client import load_mcp_config

        check_parser_names(enforce_parser, reasoning_parser)
        template = read_chat_template(chat_template)
        mcp_servers = load_mcp_config(mcp_config, mcp_command, mcp_args)
        if model_arg is not None and engine.get("model") not in (None, model_arg):
            raise ConfigError(f"MODEL {model_arg!r} and --m {engine.get('model')!r} disagree; give one of them")
        args = engine.args(**({"model": model_arg} if model_arg is not None else {}))
        engine_kwargs = args.to_dict()
        root = args.model or args.weights
        if root is None:  # the embedded default model
            from framework.loader.source import DEFAULT_MODEL_FILE

            default_name = DEFAULT_MODEL_FILE.removesuffix(".gguf")
        config = ServerConfig(
            served_model_names=list(served_model_name or []) or [root or default_name],
            model_root=root,
            api_keys=keys,
            max_num_seqs=args.max_num_seqs,
            max_queued_requests=max_queued_requests,
            max_queued_tokens=max_queued_tokens,
            max_request_bytes=max_request_bytes,
            media_sources=media_sources(allowed_local_media_path, allowed_media_domains, media_fetch_timeout),
            max_n=max_n,
            max_prompts=max_prompts,
            max_embedding_inputs=max_embedding_inputs,
            request_body_timeout_s=request_body_timeout,
            max_gen_tokens=max_gen_tokens,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            tool_parser=enforce_parser,
            reasoning_parser=reasoning_parser,
            chat_template=template,
            vllm_metrics=vllm_metrics,
            log_stats_interval_s=log_stats_interval,
            max_stored_responses=max_stored_responses,
            stored_response_ttl_s=stored_response_ttl,
            mcp_servers=mcp_servers,
            mcp_execute=mcp_execute,
            mcp_max_calls_per_round=mcp_max_calls_per_round,
            mcp_max_result_bytes=mcp_max_result_bytes,
            mcp_max_time_s=mcp_max_time,
            allowed_hosts=_split(allowed_hosts),
            allowed_origins=origins,
            engine_restart=not no_engine_restart,
            engine_heartbeat_timeout_s=engine_heartbeat_timeout,
        )
        warning = exposure_warning(bind, keys)
        if warning is not None and args.node_rank == 0:
            typer.echo(warning, err=True)
        if args.node_rank > 0:  # only node 0 serves HTTP; this node runs its tensor-parallel workers
            from framework.engine.tp_worker import run_node

            code = run_node(args)
            if code:
                raise typer.Exit(code)
            return
    except FwError as error:
        raise o.fail(str(error)) from None
    try:
        code = run_server(
            engine_kwargs,
            config,
            bind,
            shutdown_timeout=shutdown_timeout,
            log_level=log_level,
            ui_server=ui_server,
            limit_concurrency=limit_concurrency,
        )
    except ConfigError as error:
        raise o.fail(str(error)) from None
    if code:
        raise typer.Exit(code)


def api_keys(flags: list[str] | None, key_file: str | None) -> list[str]:
    """The accepted keys: ``--api-key`` values, the ``FW_API_KEY`` variable and ``--api-key-file`` lines.

    An empty key (``--api-key ""``, ``FW_API_KEY=""``, an empty file) is an error, not "no key"."""
    from framework.errors import ConfigError

    keys = []
    for key in flags or []:
        if not key.strip():
            raise ConfigError("--api-key is empty; give a non-empty key (or leave the flag out to serve without one)")
        keys.append(key.strip())
    if "FW_API_KEY" in os.environ:
        key = os.environ["FW_API_KEY"].strip()
        if not key:
            raise ConfigError("FW_API_KEY is set but empty; set it to a key, or unset it to serve without one")
        keys.append(key)
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as handle:
                from_file = [line.strip() for line in handle if line.strip() and not line.startswith("#")]
        except OSError as error:
            raise ConfigError(f"--api-key-file {key_file!r}: {error.strerror}") from None
        if not from_file:
            raise ConfigError(f"--api-key-file {key_file!r} holds no keys")
        keys += from_file
    return keys


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the value itself when it is no file; it must parse as Jinja."""
    if value is None:
        return None
    from framework.errors import ConfigError
    from framework.tokenizer import compile_chat_template

    text = value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as handle:
            text = handle.read()
    elif "{" not in value:
        raise ConfigError(f"--chat-template {value!r}: no such file, and not a Jinja template either")
    try:
        compile_chat_template(text)
    except Exception as error:  # jinja2.TemplateSyntaxError, with its line
        raise ConfigError(f"--chat-template: the template does not parse: {error}") from None
    return text


def _split(values: list[str] | None) -> list[str]:
    """Repeated and comma-separated flag values, as one list."""
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]


def media_sources(local_path: str | None, domains: list[str] | None, fetch_timeout: float):
    """The image sources ``--allowed-local-media-path`` / ``--allowed-media-domains`` open (a
    :class:`~framework.errors.ConfigError` for a directory that does not exist or a bad timeout)."""
    from framework.errors import ConfigError
    from framework.multimodal.sources import MediaSources

    try:
        return MediaSources.from_flags(local_path, _split(domains), fetch_timeout)
    except ValueError as error:
        raise ConfigError(str(error)) from None
