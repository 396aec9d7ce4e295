"""The settings of every FP8 checkpoint format, as one :class:`Fp8Scheme`.

Each format's ``QuantConfig`` parses ``config.json``'s ``quantization_config`` and refuses, with a
:class:`~framework.errors.ConfigError` naming what is valid, what fw does not build (other block
sizes, FP8 formats other than E4M3, static activation scales on block weights) before any weight
is read::

    fp8                     Hugging Face / DeepSeek / Qwen3-FP8: weight_block_size [128, 128] (weight_scale_inv
                            per block, dynamic 1x128 activation groups), or per-tensor (weight_scale, input_scale);
                            with no checkpoint settings (``--quantization fp8`` on a 16-bit model): quantize at load
    compressed-tensors-fp8  llm-compressor float-quantized: tensor / channel / block weights, static or dynamic inputs
    fbgemm_fp8              per-channel weights, dynamic per-token inputs
    modelopt                NVIDIA ModelOpt FP8: per-tensor weights and static per-tensor inputs

Which layers are quantized: every linear layer of the decoder, MoE experts included; never the
token embedding, the LM head, the MoE routers (``*.gate``, ``*.shared_expert_gate``: FP8 checkpoints
keep them in 16 bits) or the modules the checkpoint lists as unconverted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from framework.errors import ConfigError
from framework.quantization import QuantConfig, QuantMethodBase, is_module_listed

#: Block shapes ``[rows, cols]`` of block-scaled weights the kernels take.
SUPPORTED_BLOCK_SIZES = ((128, 128),)
ROUTER_LEAVES = ("gate", "shared_expert_gate")
ACT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
WEIGHT_GRANULARITIES = ("block", "channel", "tensor")


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How one checkpoint stores its FP8 (E4M3) weights.

    ``weights``: ``block`` (a float32 scale per ``block_size`` tile, checkpoint name ``scale_name``),
    ``channel`` (one per output feature) or ``tensor`` (one per checkpoint tensor: per fused shard);
    ``static_input_scale``: the checkpoint has a per-tensor ``input_scale`` for the activations
    (else they are scaled dynamically); ``serialized``: False for a 16-bit checkpoint quantized at load.
    """

    weights: str
    block_size: tuple[int, int] = (128, 128)
    static_input_scale: bool = False
    serialized: bool = True
    scale_name: str = "weight_scale"

    def __post_init__(self) -> None:
        assert self.weights in WEIGHT_GRANULARITIES, self.weights


def check_block_size(method: str, block: Any) -> tuple[int, int]:
    """``block`` as ``(rows, cols)`` when the kernels take it, else a ConfigError listing those they do."""
    shape = tuple(int(v) for v in block) if isinstance(block, list | tuple) else None
    if shape not in SUPPORTED_BLOCK_SIZES:
        names = ", ".join(str(list(b)) for b in SUPPORTED_BLOCK_SIZES)
        raise ConfigError(f"{method}: weight block size {block!r} is not supported; supported: {names}")
    return shape


class Fp8QuantConfig(QuantConfig):
    """What the FP8 formats share: a scheme and the modules left unquantized."""

    method_name: ClassVar[str] = ""
    supported_act_dtypes = ACT_DTYPES

    def __init__(self, scheme: Fp8Scheme, skipped: list[str] | None = None) -> None:
        self.scheme, self.skipped = scheme, list(skipped or [])

    @classmethod
    def get_name(cls) -> str:
        return cls.method_name

    def verify(self, model_config: Any, device: torch.device) -> None:
        from .kernels.dispatch import check_requested_kernel

        super().verify(model_config, device)
        check_requested_kernel(torch.device(device))

    def is_skipped(self, prefix: str) -> bool:
        if prefix.rpartition(".")[2] in ROUTER_LEAVES:
            return True
        return is_module_listed(prefix, self.skipped)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethodBase | None:
        from framework.layers.fused_moe import FusedMoE
        from framework.layers.linear import LinearBase

        if self.is_skipped(prefix):
            return None
        if isinstance(layer, FusedMoE):
            from .moe import Fp8FusedMoEMethod

            return Fp8FusedMoEMethod(self.scheme)
        if isinstance(layer, LinearBase):  # VocabEmbedding and LMHead are not LinearBase: they stay 16-bit
            from .method import Fp8LinearMethod

            return Fp8LinearMethod(self.scheme)
        return None


def _skipped(config: dict[str, Any], *keys: str) -> list[str]:
    return [name for key in keys for name in (config.get(key) or [])]


class Fp8Config(Fp8QuantConfig):
    """``quant_method: fp8`` (transformers' FineGrainedFP8 / vLLM's fp8), or ``--quantization fp8``
    on a 16-bit checkpoint (no settings: every weight is quantized to 128x128 blocks at load)."""

    method_name = "fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> Fp8Config:
        if not config.get("quant_method"):  # --quantization fp8 on an unquantized checkpoint
            return cls(Fp8Scheme("block", serialized=False))
        fmt = str(config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ConfigError(f"fp8: fmt {fmt!r} is not supported; supported: e4m3")
        activations = str(config.get("activation_scheme", "dynamic")).lower()
        if activations not in ("dynamic", "static"):
            raise ConfigError(f"fp8: activation_scheme {activations!r} is not supported; supported: dynamic, static")
        skipped = _skipped(config, "modules_to_not_convert", "ignored_layers")
        block = config.get("weight_block_size")
        if block is None:
            return cls(Fp8Scheme("tensor", static_input_scale=activations == "static"), skipped)
        if activations == "static":
            raise ConfigError(
                "fp8: activation_scheme 'static' with weight_block_size is not supported; "
                "supported with block weights: dynamic (per-token groups of 128)"
            )
        return cls(Fp8Scheme("block", check_block_size("fp8", block), scale_name="weight_scale_inv"), skipped)

    @classmethod
    def for_isq(cls, isq_type: str, model_config: Any, weight_shapes: dict[str, tuple[int, ...]]) -> Fp8Config:
        """``--isq fp8``: the config of a [128, 128] block-FP8 checkpoint (what ``quantize_weight`` makes)."""
        if isq_type != "fp8":
            raise ConfigError(f"fw_fp8 offers --isq fp8; got {isq_type!r}")
        return cls.from_config({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"})

    def quantize_weight(self, name: str, weight: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """``weight`` + ``weight_scale_inv`` of a decoder linear layer (MoE experts too), else None."""
        stem = name.removesuffix(".weight")
        if stem == name or ".layers." not in f".{stem}" or self.is_skipped(stem):
            return None
        from .quantize import quantize_weight_fp8

        qweight, scale_inv = quantize_weight_fp8(weight, self.scheme.block_size)
        return [(name, qweight), (f"{stem}.weight_scale_inv", scale_inv)]


class CompressedTensorsFp8Config(Fp8QuantConfig):
    """``quant_method: compressed-tensors`` with FP8 weights (``format: float-quantized`` or
    ``naive-quantized``): tensor, channel or block strategy; inputs static per tensor, dynamic, or 16-bit."""

    method_name = "compressed-tensors-fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> CompressedTensorsFp8Config:
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ConfigError(f"compressed-tensors: {len(groups)} config_groups; fw supports one scheme per checkpoint")
        weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ConfigError(
                f"compressed-tensors-fp8: weights of type {weights.get('type')!r} with "
                f"{weights.get('num_bits')} bits are not FP8; supported: type float, num_bits 8"
            )
        strategy = weights.get("strategy", "tensor")
        if strategy not in WEIGHT_GRANULARITIES:
            raise ConfigError(
                f"compressed-tensors-fp8: weight strategy {strategy!r} is not supported; supported: "
                f"{', '.join(WEIGHT_GRANULARITIES)}"
            )
        block = (
            check_block_size("compressed-tensors-fp8", weights.get("block_structure"))
            if strategy == "block"
            else (128, 128)
        )
        static = False
        if inputs is not None:
            if inputs.get("type", "float") != "float" or inputs.get("num_bits", 8) != 8:
                raise ConfigError(
                    "compressed-tensors-fp8: input activations must be FP8 (type float, num_bits 8) "
                    "or absent (weight-only)"
                )
            static = not inputs.get("dynamic", False)
            if static and inputs.get("strategy", "tensor") != "tensor":
                raise ConfigError(
                    f"compressed-tensors-fp8: static input scales with strategy "
                    f"{inputs.get('strategy')!r} are not supported; supported: tensor"
                )
            if static and strategy == "block":
                raise ConfigError("compressed-tensors-fp8: static input scales with block weights are not supported")
        return cls(Fp8Scheme(strategy, block, static_input_scale=static), _skipped(config, "ignore"))


class FbgemmFp8Config(Fp8QuantConfig):
    """``quant_method: fbgemm_fp8``: per-channel FP8 weights, dynamic per-token FP8 activations."""

    method_name = "fbgemm_fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> FbgemmFp8Config:
        return cls(Fp8Scheme("channel"), _skipped(config, "modules_to_not_convert"))


class ModelOptFp8Config(Fp8QuantConfig):
    """``quant_method: modelopt`` with ``quant_algo: FP8``: per-tensor weights and static input scales."""

    method_name = "modelopt"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> ModelOptFp8Config:
        quantization = config.get("quantization", config)  # hf_quant_config.json nests it
        algo = str(quantization.get("quant_algo", "")).upper()
        if algo != "FP8":
            raise ConfigError(f"modelopt: quant_algo {algo or None!r} is not supported; supported: FP8")
        if quantization.get("kv_cache_quant_algo"):
            raise ConfigError(
                f"modelopt: kv_cache_quant_algo {quantization['kv_cache_quant_algo']!r} (an FP8 KV "
                "cache) is not supported; supported: none (16-bit KV cache)"
            )
        return cls(Fp8Scheme("tensor", static_input_scale=True), _skipped(quantization, "exclude_modules"))
