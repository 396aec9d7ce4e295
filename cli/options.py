"""Options shared by commands that build an engine (``fw generate``, ``fw bench``, ``fw serve``)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

Model = Annotated[str | None, typer.Option("--m", "--model", help="Hugging Face repo id, local directory or .gguf file.")]
Weights = Annotated[str | None, typer.Option("--w", "--weights", help="Local weight directory (overrides --m's files).")]
File = Annotated[str | None, typer.Option("--f", "--file", help="A file or subfolder of GGUFs inside --m.")]
Revision = Annotated[str | None, typer.Option("--revision", help="Hub revision (branch, tag or commit).")]
Dtype = Annotated[str, typer.Option("--dtype", help="bf16, f16, f32 or auto (CPU: f32; GPU: the checkpoint's 16-bit type).")]
Devices = Annotated[str | None, typer.Option("--d", help="GPU ordinal to run on (e.g. 0); several devices (0,1) need tensor parallelism, not available yet.")]
YarnFactor = Annotated[float | None, typer.Option("--yarn-scaling-factor", help="Extend the context with YaRN rope scaling by this factor.")]
Device = Annotated[str | None, typer.Option("--device", help="cpu, cuda or cuda:N (default: cuda if available).")]
MaxModelLen = Annotated[int | None, typer.Option("--max-model-len", help="Context length (default: the model's).")]
KvFraction = Annotated[float, typer.Option("--kv-fraction", help="Fraction of free device memory for the KV cache.")]
Mem = Annotated[int | None, typer.Option("--mem", help="KV-cache budget in MB (overrides --kv-fraction).")]
MaxNumSeqs = Annotated[int, typer.Option("--max-num-seqs", help="Most requests in one step.")]
PrefillChunk = Annotated[int, typer.Option("--prefill-chunk-size", help="Most prompt tokens of one request per step.")]
NoPrefixCache = Annotated[bool, typer.Option("--disable-prefix-cache", help="Do not reuse KV blocks across requests.")]
PrefixCacheMax = Annotated[int | None, typer.Option("--prefix-cache-max-tokens", help="Cap on tokens kept in the prefix cache.")]
NoCudaGraph = Annotated[bool, typer.Option("--disable-cuda-graph", help="Run decode steps eagerly (no CUDA graphs).")]
LoadFormat = Annotated[str, typer.Option("--load-format", help="auto (detect), or a weight format by name: safetensors, gguf, dummy (random weights for a config.json).")]
AttentionBackend = Annotated[str, typer.Option("--attention-backend", help="auto or a registered backend name (fw plugins check).")]


def engine_kwargs(**values: Any) -> dict[str, Any]:
    """Map CLI option values to :class:`framework.engine.builder.EngineBuilder` keyword arguments."""
    names = {"m": "model", "w": "weights", "f": "file", "no_prefix_cache": None, "no_cuda_graph": None, "d": None}
    kwargs = {names.get(key, key): value for key, value in values.items() if names.get(key, key)}
    if "no_prefix_cache" in values:
        kwargs["enable_prefix_caching"] = not values["no_prefix_cache"]
    if values.get("d") is not None:
        kwargs["device"] = device_from_ordinals(values["d"], kwargs.get("device"))
    if "no_cuda_graph" in values:
        kwargs["enable_cuda_graphs"] = not values["no_cuda_graph"]
    return kwargs


def device_from_ordinals(ordinals: str, device: str | None) -> str:
    """``--d 0`` -> ``cuda:0``; several ordinals or a conflicting ``--device`` is an error."""
    from framework.errors import ConfigError

    parts = [p.strip() for p in ordinals.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--d takes GPU ordinals like 0 or 0,1; got {ordinals!r}")
    if len(parts) > 1:
        raise ConfigError(f"--d {ordinals}: running one model on several devices (tensor parallelism) is not "
                          "available yet; pass one device, e.g. --d 0")
    if device and device != f"cuda:{parts[0]}":
        raise ConfigError(f"--d {ordinals} and --device {device} disagree; give one of them")
    return f"cuda:{parts[0]}"


def fail(message: str) -> typer.Exit:
    """Print a user-facing error and return the exit to raise."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)
