"""Configuration of one engine: the model, the KV cache and the scheduler.

``ModelConfig`` wraps a Hugging Face style config dict and derives what the engine needs
(heads, head size, context length, dtype). The others are plain settings with the defaults a
vLLM or candle-vllm user expects; each field is documented where it is declared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from framework.errors import ConfigError

if TYPE_CHECKING:
    from framework.engine.args import EngineArgs

DTYPES = {
    "auto": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "f16": torch.float16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "f32": torch.float32,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def resolve_dtype(
    name: str | torch.dtype | None, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """The compute dtype for ``--dtype name`` on ``device``.

    ``auto`` means: on CPU float32 (bf16 matmuls on CPUs without AMX are slower than fp32 and
    lose precision, and fp32 is what parity tests compare against); on GPU the checkpoint's
    ``torch_dtype`` when it is 16-bit, else bfloat16.
    """
    if isinstance(name, torch.dtype):
        return name
    key = (name or "auto").lower()
    if key not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; valid: bf16, f16, f32 (or auto)")
    if DTYPES[key] is not None:
        return DTYPES[key]
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in ("float16", "bfloat16"):
        return getattr(torch, checkpoint_dtype)
    return torch.bfloat16


@dataclass(slots=True)
class ModelConfig:
    """The served model's architecture settings, derived from its HF config dict.

    ``hf_config`` is the raw dict (``config.json`` or built from GGUF metadata); attribute access
    through :meth:`get` falls back to ``text_config`` for multimodal wrappers.
    """

    hf_config: dict[str, Any]
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    source: str = ""

    @classmethod
    def from_hf_config(
        cls,
        hf_config: dict[str, Any],
        *,
        dtype: torch.dtype,
        max_model_len: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        source: str = "",
    ) -> ModelConfig:
        archs = hf_config.get("architectures") or []
        if not archs:
            raise ConfigError(f"model config of {source or 'the model'} has no 'architectures' entry")
        limit = _context_length(hf_config)
        if max_model_len is None:
            max_model_len = limit
        elif limit and max_model_len > limit:
            raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's context length {limit}")
        return cls(hf_config, archs[0], dtype, max_model_len, eos_token_ids, source)

    def get(self, key: str, default: Any = None) -> Any:
        """A config value, looking inside ``text_config`` when the top level lacks it."""
        if key in self.hf_config:
            return self.hf_config[key]
        return self.hf_config.get("text_config", {}).get(key, default)

    @property
    def num_layers(self) -> int:
        return int(self.get("num_hidden_layers"))

    @property
    def num_heads(self) -> int:
        return int(self.get("num_attention_heads"))

    @property
    def num_kv_heads(self) -> int:
        return int(self.get("num_key_value_heads") or self.num_heads)

    @property
    def hidden_size(self) -> int:
        return int(self.get("hidden_size"))

    @property
    def head_size(self) -> int:
        return int(self.get("head_dim") or self.hidden_size // self.num_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.get("vocab_size"))

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """transformers 5's ``rope_parameters`` for full-attention layers (per-layer-type dicts,
        as Gemma 3 writes them, are resolved to their ``full_attention`` entry)."""
        params = self.get("rope_parameters") or {}
        return params.get("full_attention", params) if isinstance(params.get("full_attention"), dict) else params

    @property
    def rope_theta(self) -> float:
        """The rotary base, from ``rope_theta`` or transformers 5's ``rope_parameters``."""
        return float(self.rope_parameters.get("rope_theta") or self.get("rope_theta") or 10000.0)

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """The rope scaling dict (``rope_type`` / ``factor`` / ...), or None for plain rope."""
        scaling = self.get("rope_scaling") or {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
        kind = scaling.get("rope_type") or scaling.get("type")
        return None if not scaling or kind in (None, "default") else {**scaling, "rope_type": kind}


def _context_length(hf_config: dict[str, Any]) -> int:
    text = hf_config.get("text_config", {})
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = hf_config.get(key, text.get(key))
        if value:
            return int(value)
    return 2048


@dataclass(slots=True)
class CacheConfig:
    """KV-cache settings.

    ``block_size``: tokens per paged block. ``kv_fraction``: fraction of free device memory
    (after weights) given to the cache, used when ``mem_mb`` is not set. ``mem_mb``: a fixed
    budget in MB (over both fractions). ``enable_prefix_caching`` and ``prefix_cache_max_tokens`` (``None`` = as many
    as the cache holds) control reuse of full blocks across requests. ``num_blocks`` overrides
    the sizing entirely (tests).
    """

    block_size: int = 16
    kv_fraction: float = 0.7
    mem_mb: int | None = None
    enable_prefix_caching: bool = True
    prefix_cache_max_tokens: int | None = None
    num_blocks: int | None = None
    cache_dtype: str = "auto"
    #: vLLM's whole-engine budget: this fraction of the GPU's total memory, the KV cache taking
    #: what the weights and everything else on the device leave of it (replaces ``kv_fraction``)
    gpu_memory_utilization: float | None = None

    @classmethod
    def from_args(cls, args: EngineArgs) -> CacheConfig:
        """The KV-cache settings of ``args`` (``--block-size``, ``--kv-fraction``, ``--mem``, ...)."""
        return cls(
            block_size=args.block_size,
            kv_fraction=args.kv_fraction,
            mem_mb=args.mem_mb,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_cache_max_tokens=args.prefix_cache_max_tokens,
            num_blocks=args.num_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cache_dtype=args.kv_cache_dtype,
        )

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block size must be a power of two, got {self.block_size}")
        if not 0 < self.kv_fraction <= 1:
            raise ConfigError(f"--kv-fraction must be in (0, 1], got {self.kv_fraction}")
        if self.mem_mb is not None and self.mem_mb <= 0:
            raise ConfigError(f"--mem must be a positive number of MB, got {self.mem_mb}")


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous-batching limits.

    ``max_num_seqs``: requests in one step. ``max_num_batched_tokens``: tokens in one step (all
    requests together). ``prefill_chunk_size``: most prompt tokens of one request in one step
    (``--prefill-chunk-size``, default 8192).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefill_chunk_size: int = 8192

    @classmethod
    def from_args(cls, args: EngineArgs, max_model_len: int | None) -> SchedulerConfig:
        """The step limits of ``args``: ``--prefill-chunk-size 0`` computes a whole prompt in one
        step, so a step then holds the context length (``max_model_len``; None while unknown)."""
        chunk = args.prefill_chunk_size or max_model_len or 8192  # (8192 only until the context length is known)
        batched = args.max_num_batched_tokens or max(chunk, args.max_num_seqs)
        if args.prefill_chunk_size == 0 and max_model_len is not None and batched < max_model_len:
            raise ConfigError(
                f"--prefill-chunk-size 0 computes each prompt in one step, but --max-num-batched-tokens "
                f"{batched} is below the context length {max_model_len}: raise it, lower "
                "--max-model-len, or turn chunking back on"
            )
        return cls(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched, prefill_chunk_size=chunk)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine core needs, assembled by :class:`framework.engine.builder.EngineBuilder`."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    attention_backend: str = "auto"
    seed: int = 0


def with_yarn_scaling(hf_config: dict[str, Any], factor: float) -> dict[str, Any]:
    """The config with YaRN rope scaling by ``factor`` (``--yarn-scaling-factor``), as candle-vllm does:
    the context grows ``factor`` times from the model's own ``max_position_embeddings``."""
    if factor <= 1.0:
        raise ConfigError(f"--yarn-scaling-factor must be > 1, got {factor}")
    config = dict(hf_config)
    original = int(config.get("max_position_embeddings") or 2048)
    config["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": original,
    }
    params = config.pop("rope_parameters", None) or {}
    if "rope_theta" in params and "rope_theta" not in config:
        config["rope_theta"] = params["rope_theta"]
    config["max_position_embeddings"] = int(original * factor)
    return config
