"""Options shared by commands that build an engine (``fw generate``, ``fw bench``, ``fw serve``)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

Model = Annotated[str | None, typer.Option("--m", "--model", help="Hugging Face repo id, local directory or .gguf file.")]
Weights = Annotated[str | None, typer.Option("--w", "--weights", help="Local weight directory (overrides --m's files).")]
File = Annotated[str | None, typer.Option("--f", "--file", help="A file or subfolder of GGUFs inside --m.")]
Revision = Annotated[str | None, typer.Option("--revision", help="Hub revision (branch, tag or commit).")]
Dtype = Annotated[str, typer.Option("--dtype", help="bf16, f16, f32 or auto (CPU: f32; GPU: the checkpoint's 16-bit type).")]
Devices = Annotated[str | None, typer.Option("--d", help="GPU ordinal(s) of this node: 0, or 0,1 for tensor parallelism over both (one worker process per device).")]
TensorParallel = Annotated[int | None, typer.Option("--tp", "--tensor-parallel-size", help="Tensor-parallel ranks in all (a power of two; default: the --d count times --num-nodes). On CPU: that many gloo processes.")]
NumNodes = Annotated[int, typer.Option("--num-nodes", help="Machines sharing the model (each runs --tp / --num-nodes ranks).")]
NodeRank = Annotated[int, typer.Option("--node-rank", help="This machine's index; only node 0 serves HTTP, the others run workers.")]
MasterAddr = Annotated[str, typer.Option("--master-addr", help="Address of node 0 for the tensor-parallel rendezvous.")]
MasterPort = Annotated[int | None, typer.Option("--master-port", help="Rendezvous port on node 0 (default 29500 with several nodes; any free port on one).")]
RendezvousTimeout = Annotated[float, typer.Option("--rendezvous-timeout", help="Seconds to wait for every rank to join.")]
DistributedTimeout = Annotated[float, typer.Option("--distributed-timeout", help="Seconds a collective may take before a hung rank fails the engine.")]
YarnFactor = Annotated[float | None, typer.Option("--yarn-scaling-factor", help="Extend the context with YaRN rope scaling by this factor.")]
Device = Annotated[str | None, typer.Option("--device", help="cpu, cuda or cuda:N (default: cuda if available).")]
MaxModelLen = Annotated[int | None, typer.Option("--max-model-len", help="Context length (default: the model's).")]
KvFraction = Annotated[float, typer.Option("--kv-fraction", help="Fraction of free device memory for the KV cache.")]
Mem = Annotated[int | None, typer.Option("--mem", help="KV-cache budget in MB (fw serve: overrides --kv-fraction).")]
MaxNumSeqs = Annotated[int, typer.Option("--max-num-seqs", help="Most requests in one step.")]
PrefillChunk = Annotated[int, typer.Option("--prefill-chunk-size", help="Most prompt tokens of one request per step.")]
NoPrefixCache = Annotated[bool, typer.Option("--disable-prefix-cache", help="Do not reuse KV blocks across requests.")]
PrefixCacheMax = Annotated[int | None, typer.Option("--prefix-cache-max-tokens", help="Cap on tokens kept in the prefix cache.")]
NoCudaGraph = Annotated[bool, typer.Option("--disable-cuda-graph", help="Run decode steps eagerly (no CUDA graphs).")]
AsyncScheduling = Annotated[bool | None, typer.Option(
    "--async-scheduling/--no-async-scheduling",
    help="Prepare each step on the host while the device runs the previous one (default: on for CUDA devices).")]
AllReduce = Annotated[str, typer.Option("--all-reduce", help="Tensor-parallel all-reduce: auto (flashinfer for bf16 models where "
                                        "FlashInfer's fused kernel is built already, else symm_mem where every GPU is Hopper or newer, on "
                                        "one host with peer access, else nccl), symm_mem (one-shot over NVLink peer memory for "
                                        "decode-sized tensors; an error where it cannot run), nccl, or flashinfer (symm_mem plus "
                                        "FlashInfer's fused all-reduce + residual add + RMS norm in decode steps; builds the kernel "
                                        "on first use, about 7 minutes).")]
LoadFormat = Annotated[str, typer.Option("--load-format", help="auto (detect), or a weight format by name: safetensors, gguf, dummy (random weights for a config.json).")]
AttentionBackend = Annotated[str, typer.Option("--attention-backend", help="auto or a registered backend name (fw plugins check).")]


def engine_kwargs(**values: Any) -> dict[str, Any]:
    """Map CLI option values to :class:`framework.engine.builder.EngineBuilder` keyword arguments."""
    names = {"m": "model", "w": "weights", "f": "file", "no_prefix_cache": None, "no_cuda_graph": None, "d": None}
    kwargs = {names.get(key, key): value for key, value in values.items() if names.get(key, key)}
    if "no_prefix_cache" in values:
        kwargs["enable_prefix_caching"] = not values["no_prefix_cache"]
    if values.get("d") is not None:
        ordinals = parse_ordinals(values["d"])
        if len(ordinals) == 1 and (values.get("tensor_parallel_size") or 1) == 1 and (values.get("num_nodes") or 1) == 1:
            kwargs["device"] = device_from_ordinals(values["d"], kwargs.get("device"))
        else:
            kwargs["device_ids"] = ordinals
    if "no_cuda_graph" in values:
        kwargs["enable_cuda_graphs"] = not values["no_cuda_graph"]
    if "all_reduce" in values:  # before any process starts (the engine checks again)
        from framework.distributed.config import ParallelConfig
        from framework.distributed.fast_all_reduce import resolve_all_reduce

        # the device as EngineBuilder decides it (ParallelConfig.device), so the two checks agree
        parallel = ParallelConfig(kwargs.get("tensor_parallel_size"), kwargs.get("num_nodes", 1),
                                  kwargs.get("node_rank", 0), kwargs.get("device_ids"))
        resolve_all_reduce(values["all_reduce"], parallel.device(kwargs.get("device")))
    return kwargs


def parallel_kwargs(tp: int | None, num_nodes: int, node_rank: int, master_addr: str, master_port: int | None,
                    rendezvous_timeout: float, distributed_timeout: float) -> dict[str, Any]:
    """The tensor-parallel / multi-node flags as :class:`EngineBuilder` keyword arguments (validated)."""
    from framework.distributed.config import ParallelConfig

    # validates sizes and ranks now, so a bad flag fails before any process starts
    ParallelConfig(tp or None, num_nodes, node_rank, None, master_addr, master_port, rendezvous_timeout, distributed_timeout)
    return dict(tensor_parallel_size=tp, num_nodes=num_nodes, node_rank=node_rank, master_addr=master_addr,
                master_port=master_port, rendezvous_timeout=rendezvous_timeout, distributed_timeout=distributed_timeout)


def parse_ordinals(ordinals: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``; anything but comma-separated GPU ordinals is an error."""
    from framework.errors import ConfigError

    parts = [p.strip() for p in ordinals.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--d takes GPU ordinals like 0 or 0,1; got {ordinals!r}")
    return [int(p) for p in parts]


def device_from_ordinals(ordinals: str, device: str | None) -> str:
    """``--d 0`` -> ``cuda:0``; a conflicting ``--device`` is an error (several ordinals: tensor parallelism)."""
    from framework.errors import ConfigError

    parts = [str(p) for p in parse_ordinals(ordinals)]
    if len(parts) > 1:
        raise ConfigError(f"--d {ordinals}: several devices mean tensor parallelism; the engine takes them as device_ids")
    if device and device != f"cuda:{parts[0]}":
        raise ConfigError(f"--d {ordinals} and --device {device} disagree; give one of them")
    return f"cuda:{parts[0]}"


def fail(message: str) -> typer.Exit:
    """Print a user-facing error and return the exit to raise."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)
