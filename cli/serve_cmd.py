"""``fw serve``: the OpenAI-compatible server (the engine runs in its own process)."""

from __future__ import annotations

from typing import Annotated

import typer


def serve(
    model: Annotated[str | None, typer.Option("--m", "--model", help="Model: Hugging Face id, local directory, or .gguf file.")] = None,
    weights: Annotated[str | None, typer.Option("--w", help="Local weight directory (safetensors or GGUF).")] = None,
    file: Annotated[str | None, typer.Option("--f", help="GGUF file or subfolder inside the --m repository.")] = None,
    host: Annotated[str | None, typer.Option("--h", "--host", help="Bind address: host, host:port, \\[ipv6]:port, tcp://host[:port] or unix:///path (default 0.0.0.0).")] = None,
    port: Annotated[int, typer.Option("--p", "--port", help="TCP port when --h gives none.")] = 2000,
    dtype: Annotated[str, typer.Option("--dtype", help="Model dtype: auto, bf16, f16, f32.")] = "auto",
    device: Annotated[str | None, typer.Option("--device", help="torch device (default: cuda if available, else cpu).")] = None,
    kv_fraction: Annotated[float, typer.Option("--kv-fraction", help="KV cache size as a fraction of free GPU memory.")] = 0.7,
    mem: Annotated[int | None, typer.Option("--mem", help="Fixed KV cache budget in MiB.")] = None,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", help="Context length (default: the model's).")] = None,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", help="Most sequences computed together.")] = 256,
    prefill_chunk_size: Annotated[int, typer.Option("--prefill-chunk-size", help="Prompt tokens computed per step and request.")] = 8192,
    disable_prefix_cache: Annotated[bool, typer.Option("--disable-prefix-cache", help="Turn the prefix cache off.")] = False,
    prefix_cache_max_tokens: Annotated[int | None, typer.Option("--prefix-cache-max-tokens", help="Cap on tokens kept in the prefix cache.")] = None,
    api_key: Annotated[list[str] | None, typer.Option("--api-key", help="Require this bearer key (repeat for several).")] = None,
    served_model_name: Annotated[list[str] | None, typer.Option("--served-model-name", help="Model name(s) clients use (default: --m).")] = None,
    max_queued_requests: Annotated[int | None, typer.Option("--max-queued-requests", help="Sequences allowed to wait beyond --max-num-seqs before answering 429.")] = None,
    max_request_bytes: Annotated[int, typer.Option("--max-request-bytes", help="Largest request body accepted (413 above).")] = 8 << 20,
    shutdown_timeout: Annotated[float, typer.Option("--shutdown-timeout", help="Seconds in-flight requests may take to finish after SIGTERM.")] = 30.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed for weight init of unloaded parameters and unseeded sampling.")] = 0,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "warning",
    num_blocks: Annotated[int | None, typer.Option("--num-blocks", hidden=True)] = None,
) -> None:
    """Serve a model with an OpenAI-compatible API."""
    from framework.errors import FwError

    if model is None and weights is None:
        typer.echo("fw serve: error: give a model with --m (a Hugging Face id, a local directory or a .gguf file) "
                   "or a weight directory with --w", err=True)
        raise typer.Exit(2)
    try:
        from framework.server.launcher import parse_bind, run_server
        from framework.server.state import ServerConfig

        bind = parse_bind(host, port)
        names = list(served_model_name or []) or [model or weights]
        config = ServerConfig(served_model_names=names, model_root=model or weights, api_keys=list(api_key or []),
                              max_num_seqs=max_num_seqs, max_queued_requests=max_queued_requests,
                              max_request_bytes=max_request_bytes)
        engine_kwargs = {"model": model, "weights": weights, "file": file, "dtype": dtype, "device": device,
                         "max_model_len": max_model_len, "kv_fraction": kv_fraction, "mem_mb": mem,
                         "num_blocks": num_blocks, "enable_prefix_caching": not disable_prefix_cache,
                         "prefix_cache_max_tokens": prefix_cache_max_tokens, "max_num_seqs": max_num_seqs,
                         "prefill_chunk_size": prefill_chunk_size, "seed": seed}
    except FwError as error:
        typer.echo(f"fw serve: error: {error}", err=True)
        raise typer.Exit(2) from None
    code = run_server(engine_kwargs, config, bind, shutdown_timeout=shutdown_timeout, log_level=log_level)
    if code:
        raise typer.Exit(code)
