"""``EngineArgs``: the one declaration of every engine option (default, help text, validation).

The ``fw serve`` / ``generate`` / ``bench`` options are generated from these fields
(:mod:`cli.options`), :class:`~framework.engine.builder.EngineBuilder` and ``LLM(...)`` take them
as keyword arguments, and the engine process and tensor-parallel workers receive them as JSON.
Each field's ``msgspec.Meta`` holds its help text (``description``), its numeric bounds, and in
``extra`` the CLI spelling: ``flags`` (first one is the canonical name), ``negate`` (a
``--disable-x`` flag for an ``enable_x`` field), ``hidden``.

Validation happens in two steps, both before anything is downloaded or loaded:
:meth:`EngineArgs.from_options` checks types, bounds and cross-field rules (no torch, no
plugins); :meth:`EngineArgs.check_names` checks the names plugins register (attention backends,
weight formats, quantization methods) and the parallel layout.

This module must not import torch: ``fw --help`` builds its options from it.
"""

from __future__ import annotations

import functools
import operator
import re
import types
import typing
from typing import Annotated, Any

import msgspec

from framework.errors import ConfigError, UnknownNameError

#: ``--dtype`` names (framework.config.DTYPES maps them to torch dtypes).
DTYPE_NAMES = ("auto", "bf16", "bfloat16", "f16", "fp16", "float16", "half", "f32", "fp32", "float32", "float")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _opt(help: str, *flags: str, negate: bool = False, hidden: bool = False, **bounds: Any) -> msgspec.Meta:
    return msgspec.Meta(description=help, extra={"flags": flags, "negate": negate, "hidden": hidden}, **bounds)


_ALL_REDUCE_HELP = (
    "Tensor-parallel all-reduce: auto (flashinfer for bf16 models where FlashInfer's fused kernel is built "
    "already, else symm_mem where every GPU is Hopper or newer, on one host with peer access, else nccl), "
    "symm_mem (one-shot over NVLink peer memory for decode-sized tensors; an error where it cannot run), nccl, "
    "or flashinfer (symm_mem plus FlashInfer's fused all-reduce + residual add + RMS norm in decode steps; "
    "builds the kernel on first use, about 7 minutes)."
)


class EngineArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every option of one engine. Build it with :meth:`from_options` (which validates)."""

    # --- the model ---------------------------------------------------------------------
    model: Annotated[str | None, _opt("Hugging Face repo id, local directory or .gguf file.", "--m", "--model")] = None
    weights: Annotated[str | None, _opt("Local weight directory (overrides --m's files).", "--w", "--weights")] = None
    file: Annotated[str | None, _opt("A file or subfolder of GGUFs inside --m.", "--f", "--file")] = None
    mmproj: Annotated[
        str | None,
        _opt(
            "llama.cpp vision projector (mmproj*.gguf) of a Qwen2.5-VL / Qwen3-VL / Gemma 3 GGUF: a local file or a file of "
            "the --m Hub repo; default: the mmproj*.gguf beside the model file; none: text only.",
            "--mmproj",
        ),
    ] = None
    revision: Annotated[str | None, _opt("Hub revision (branch, tag or commit).", "--revision")] = None
    load_format: Annotated[
        str,
        _opt(
            "auto (detect), or a weight format by name: safetensors, gguf, dummy (random weights for a config.json).",
            "--load-format",
        ),
    ] = "auto"
    quantization: Annotated[
        str | None,
        _opt(
            "Quantization method of the checkpoint (gguf, gptq, awq, fp8, mxfp4, ...: fw plugins list); default: what "
            "the checkpoint declares. A method the checkpoint does not use is an error; fp8 on a 16-bit checkpoint "
            "quantizes it at load.",
            "--quantization",
            "-q",
        ),
    ] = None
    isq: Annotated[
        str | None,
        _opt(
            "In-situ quantization: quantize a bf16/fp16 checkpoint's weight matrices at load, on the device, "
            "as they stream in. Types: q4_0 q4_1 q5_0 q5_1 q8_0 q2k q3k q4k q5k q6k (GGUF; q4k is llama.cpp's "
            "Q4_K_M recipe), int4 int8 (W4A16/W8A16, group 128), fp8 (128x128 blocks), and what other plugins offer.",
            "--isq",
        ),
    ] = None
    dtype: Annotated[str, _opt("bf16, f16, f32 or auto (CPU: f32; GPU: the checkpoint's 16-bit type).", "--dtype")] = (
        "auto"
    )
    max_model_len: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None, _opt("Context length (default: the model's).", "--max-model-len")
    ] = None
    yarn_scaling_factor: Annotated[
        Annotated[float, msgspec.Meta(gt=1.0)] | None,
        _opt("Extend the context with YaRN rope scaling by this factor.", "--yarn-scaling-factor"),
    ] = None
    seed: Annotated[int, _opt("Engine seed (weights a format leaves uninitialized).", "--seed")] = 0
    # --- the device --------------------------------------------------------------------
    device: Annotated[str | None, _opt("cpu, cuda or cuda:N (default: cuda if available).", "--device")] = None
    device_ids: Annotated[
        list[int] | None,
        _opt(
            "GPU ordinal(s) of this node: 0, or 0,1 for tensor parallelism over both (one worker process per device).",
            "--d",
        ),
    ] = None
    attention_backend: Annotated[
        str, _opt("auto or a registered backend name (fw plugins check).", "--attention-backend")
    ] = "auto"
    enable_cuda_graphs: Annotated[
        bool, _opt("Run decode steps eagerly (no CUDA graphs).", "--disable-cuda-graph", negate=True)
    ] = True
    async_scheduling: Annotated[
        bool | None,
        _opt(
            "Prepare each step on the host while the device runs the previous one (default: on for CUDA devices).",
            "--async-scheduling/--no-async-scheduling",
        ),
    ] = None
    # --- the KV cache ------------------------------------------------------------------
    block_size: Annotated[int, _opt("Tokens per KV-cache block (a power of two).", "--block-size", ge=1)] = 16
    kv_fraction: Annotated[
        float,
        _opt("Fraction of free device memory (after the weights) for the KV cache.", "--kv-fraction", gt=0.0, le=1.0),
    ] = 0.7
    gpu_memory_utilization: Annotated[
        Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None,
        _opt(
            "vLLM's budget: the fraction of the GPU's total memory this engine may use in all (weights, activations "
            "and KV cache); the KV cache gets what is left of it. Replaces --kv-fraction; CUDA only.",
            "--gpu-memory-utilization",
        ),
    ] = None
    mem_mb: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        _opt("KV-cache budget in MB (overrides --kv-fraction and --gpu-memory-utilization).", "--mem"),
    ] = None
    num_blocks: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        _opt("KV-cache blocks exactly (overrides every budget; for tests).", "--num-blocks"),
    ] = None
    kv_cache_dtype: Annotated[
        str,
        _opt(
            "How the KV cache stores keys and values: auto (the model dtype), fp8 (e4m3, scale per token and head), "
            "turbo8 (rotated FP8 keys + 4-bit values), turbo4 (rotated 4-bit keys + 4-bit values) or turbo3 "
            "(rotated 3-bit keys + 4-bit values); about 2x, 2.6x, 3.9x and 4.5x the tokens of auto. MLA models "
            "keep their latent cache.",
            "--kv-cache-dtype",
            "--kvcache-dtype",
        ),
    ] = "auto"
    enable_prefix_caching: Annotated[
        bool, _opt("Do not reuse KV blocks across requests.", "--disable-prefix-cache", negate=True)
    ] = True
    prefix_cache_max_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | None,
        _opt("Cap on tokens kept in the prefix cache.", "--prefix-cache-max-tokens"),
    ] = None
    # --- the scheduler -----------------------------------------------------------------
    max_num_seqs: Annotated[int, _opt("Most requests in one step.", "--max-num-seqs", ge=1)] = 256
    max_num_batched_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        _opt(
            "Most tokens in one step, all requests together (default: the larger of --prefill-chunk-size and "
            "--max-num-seqs; with chunking off, the context length).",
            "--max-num-batched-tokens",
        ),
    ] = None
    prefill_chunk_size: Annotated[
        int,
        _opt(
            "Most prompt tokens of one request per step; 0 turns chunking off (a prompt is computed in one step).",
            "--prefill-chunk-size",
            ge=0,
        ),
    ] = 8192
    # --- tensor parallelism ------------------------------------------------------------
    tensor_parallel_size: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        _opt(
            "Tensor-parallel ranks in all (a power of two; default: the --d count times --num-nodes). On CPU: that "
            "many gloo processes.",
            "--tp",
            "--tensor-parallel-size",
        ),
    ] = None
    num_nodes: Annotated[
        int, _opt("Machines sharing the model (each runs --tp / --num-nodes ranks).", "--num-nodes", ge=1)
    ] = 1
    node_rank: Annotated[
        int, _opt("This machine's index; only node 0 serves HTTP, the others run workers.", "--node-rank", ge=0)
    ] = 0
    master_addr: Annotated[str, _opt("Address of node 0 for the tensor-parallel rendezvous.", "--master-addr")] = (
        "127.0.0.1"
    )
    master_port: Annotated[
        Annotated[int, msgspec.Meta(ge=0, le=65535)] | None,
        _opt("Rendezvous port on node 0 (default 29500 with several nodes; any free port on one).", "--master-port"),
    ] = None
    rendezvous_timeout: Annotated[
        float, _opt("Seconds to wait for every rank to join.", "--rendezvous-timeout", gt=0.0)
    ] = 300.0
    distributed_timeout: Annotated[
        float,
        _opt("Seconds a collective may take before a hung rank fails the engine.", "--distributed-timeout", gt=0.0),
    ] = 600.0
    all_reduce: Annotated[str, _opt(_ALL_REDUCE_HELP, "--all-reduce")] = "auto"

    def __post_init__(self) -> None:
        if self.dtype.lower() not in DTYPE_NAMES:
            raise ConfigError(f"--dtype {self.dtype!r} is unknown; valid: bf16, f16, f32 (or auto)")
        if self.device is not None and not _DEVICE.match(self.device):
            raise ConfigError(f"--device {self.device!r} is not a device; valid: cpu, cuda, cuda:N")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two (8, 16, 32, ...); got {self.block_size}")
        size = self.tensor_parallel_size
        if size is not None and size & (size - 1):
            raise ConfigError(f"the tensor-parallel size must be a power of two (1, 2, 4, 8, ...); got {size}")
        if not self.node_rank < self.num_nodes:
            raise ConfigError(
                f"--node-rank must be in [0, {self.num_nodes - 1}] for --num-nodes {self.num_nodes}; "
                f"got {self.node_rank}"
            )
        if self.device_ids is not None and (not self.device_ids or min(self.device_ids) < 0):
            raise ConfigError(f"--d takes GPU ordinals like 0 or 0,1; got {self.device_ids}")

    # --- construction ------------------------------------------------------------------
    @classmethod
    def from_options(cls, **options: Any) -> EngineArgs:
        """Validated args from keyword options (``dtype`` may be a ``torch.dtype``); a bad value or
        an unknown name raises :class:`ConfigError` naming the flag and what is valid."""
        if "dtype" in options and options["dtype"] is not None and not isinstance(options["dtype"], str):
            options["dtype"] = str(options["dtype"]).removeprefix("torch.")
        unknown = sorted(set(options) - set(cls.__struct_fields__))
        if unknown:
            raise ConfigError(
                f"unknown engine option(s) {', '.join(map(repr, unknown))}; valid: {', '.join(cls.__struct_fields__)}"
            )
        try:
            return msgspec.convert(options, cls)
        except msgspec.ValidationError as error:
            raise ConfigError(_explain(error, options)) from None

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> EngineArgs:
        try:
            return msgspec.json.decode(data, type=cls)
        except msgspec.ValidationError as error:
            raise ConfigError(_explain(error)) from None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    def replace(self, **changes: Any) -> EngineArgs:
        """A validated copy with ``changes``."""
        return EngineArgs.from_options(**{**self.to_dict(), **changes})

    # --- checks that need the plugins (still before any download) ------------------------
    def check_names(self) -> None:
        """Refuse names no plugin registers and a parallel layout that cannot exist; loads the plugins."""
        from framework import plugins, registries
        from framework.distributed.config import ParallelConfig
        from framework.distributed.fast_all_reduce import resolve_all_reduce
        from framework.platform import platform_for_device

        plugins.load_plugins()
        parallel = ParallelConfig(
            self.tensor_parallel_size,
            self.num_nodes,
            self.node_rank,
            self.device_ids,
            self.master_addr,
            self.master_port,
            self.rendezvous_timeout,
            self.distributed_timeout,
        )
        device = parallel.device(self.device)
        resolve_all_reduce(self.all_reduce, device)
        platform = platform_for_device(device.type)
        if self.attention_backend != "auto":
            _check_name("--attention-backend", self.attention_backend, registries.attention_backends(platform))
        if self.load_format != "auto":
            _check_name("--load-format", self.load_format, registries.weight_formats(platform))
        if self.kv_cache_dtype != "auto":
            _check_name("--kv-cache-dtype", self.kv_cache_dtype, registries.kv_cache_dtypes(platform))
        if self.quantization is not None:
            _check_name("--quantization", self.quantization, registries.quantization_methods(platform))
        if self.isq is not None:
            from framework.isq import isq_method

            isq_method(self.isq, platform)
            if self.quantization is not None:
                raise ConfigError(
                    f"--isq {self.isq} chooses the quantization itself; leave --quantization {self.quantization} out"
                )
        if self.gpu_memory_utilization is not None and device.type != "cuda":
            raise ConfigError(
                f"--gpu-memory-utilization sizes GPU memory; this engine runs on {device.type}: "
                "use --mem MB or --kv-fraction for a CPU KV cache"
            )


def flag_of(field: str) -> str:
    """The canonical CLI flag of an :class:`EngineArgs` field (``max_num_seqs`` -> ``--max-num-seqs``)."""
    return field_meta(field).extra["flags"][0].split("/")[0]


def field_meta(field: str) -> msgspec.Meta:
    """The ``msgspec.Meta`` of one field (help, bounds, CLI spelling)."""
    return engine_fields()[field][1]


def engine_fields() -> dict[str, tuple[Any, msgspec.Meta, Any]]:
    """Each field of :class:`EngineArgs` as ``name -> (type without its Meta, Meta, default)``, in order."""
    global _FIELDS
    if _FIELDS is None:
        hints = typing.get_type_hints(EngineArgs, include_extras=True)
        defaults = dict(
            zip(EngineArgs.__struct_fields__[-len(EngineArgs.__struct_defaults__) :], EngineArgs.__struct_defaults__)
        )
        _FIELDS = {}
        for name in EngineArgs.__struct_fields__:
            base, *metadata = typing.get_args(hints[name])
            meta = next(m for m in metadata if isinstance(m, msgspec.Meta))
            _FIELDS[name] = (_without_meta(base), meta, defaults[name])
    return _FIELDS


_FIELDS: dict[str, tuple[Any, msgspec.Meta, Any]] | None = None


def _without_meta(hint: Any) -> Any:
    """``Annotated[int, Meta(ge=1)] | None`` -> ``int | None``."""
    if typing.get_origin(hint) is Annotated:
        return _without_meta(typing.get_args(hint)[0])
    args = typing.get_args(hint)
    if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, [_without_meta(arg) for arg in args])
    return hint


def _explain(error: msgspec.ValidationError, options: dict[str, Any] | None = None) -> str:
    """msgspec's ``Expected `int` >= 1, got 0 - at `$.max_num_seqs``` as ``--max-num-seqs must be >= 1, got 0``."""
    text = str(error)
    found = re.search(r" - at `\$\.(\w+)", text)
    if found is None:
        return text  # __post_init__'s own message
    field = found.group(1)
    expected = re.sub(r", got .*$", "", text[: found.start()])
    wanted = re.match(r"Expected `([^`]+)`(?: (.+))?$", expected)
    if wanted is not None:  # "Expected `float` > 1.0" -> "must be > 1.0"; "Expected `int`" -> "must be an int"
        kind, bound = wanted.groups()
        expected = f"must be {bound}" if bound else f"must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
    given = f", got {options[field]!r}" if options and field in options else ""
    return f"{flag_of(field)} {expected}{given}"


def _check_name(flag: str, name: str, registry: Any) -> None:
    """A name the registry lacks is an error naming the flag and the valid names (``auto`` too where it is one)."""
    if name not in registry:
        auto = "auto (the default), " if flag != "--quantization" else ""
        valid = ", ".join(n for n in registry.names() if n != "auto") or "(none registered)"
        raise UnknownNameError(f"{flag}: unknown {registry.kind} {name!r}; valid: {auto}{valid}")
