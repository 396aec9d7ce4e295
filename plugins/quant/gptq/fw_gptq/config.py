"""The checkpoint settings of GPTQ, AWQ and compressed-tensors W4A16/W8A16, as one :class:`WNA16Scheme`.

Each format's ``QuantConfig`` parses ``config.json``'s ``quantization_config`` and refuses, with a
:class:`~framework.errors.ConfigError` naming what is valid, what fw does not build (other bit
widths, group sizes, AWQ's GEMV layout, compressed-tensors' float or activation quantization)
before any weight is read. All three hand the same :class:`~fw_gptq.method.WNA16LinearMethod`
and :class:`~fw_gptq.moe.WNA16FusedMoEMethod` their scheme; the method's
``process_weights_after_loading`` repacks every format into the one kernel layout.

Which layers are quantized: every linear layer of the decoder, MoE experts included; never the
token embedding, the MoE routers (``*.gate``, ``*.shared_expert_gate``: GPTQ/AWQ tools keep them
in 16 bits) or the modules the checkpoint lists as unconverted; the LM head only where the config
says so (GPTQ's ``lm_head: true``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from framework.errors import ConfigError
from framework.quantization import QuantConfig, QuantMethodBase, is_module_listed

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)
#: Router layers the quantizers leave in 16 bits.
ROUTER_LEAVES = ("gate", "shared_expert_gate")
ACT_DTYPES_CUDA = frozenset({torch.float16, torch.bfloat16})
ACT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


@dataclass(frozen=True, slots=True)
class WNA16Scheme:
    """How one checkpoint stores its integer weights (see :mod:`fw_gptq.packing`).

    ``format``: ``gptq`` | ``awq`` | ``compressed`` | ``marlin``; ``zero_offset``: what GPTQ v1 subtracts
    from stored zeros (1) or not (0, gptq_v2); ``desc_act``: the checkpoint has a meaningful ``g_idx``.
    """

    format: str
    bits: int
    group_size: int  # -1: one group per output feature
    symmetric: bool = True
    desc_act: bool = False
    zero_offset: int = 1

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    def groups(self, in_features: int) -> int:
        """Groups along ``in_features`` input features."""
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


def check_bits_and_group(
    method: str, bits: Any, group_size: Any, valid_bits=SUPPORTED_BITS, valid_groups=SUPPORTED_GROUP_SIZES
) -> tuple[int, int]:
    """``(bits, group_size)`` when fw builds them, else a ConfigError listing what it does."""
    if bits not in valid_bits:
        raise ConfigError(
            f"{method}: {bits}-bit weights are not supported; supported bits: {', '.join(map(str, valid_bits))}"
        )
    if group_size not in valid_groups:
        raise ConfigError(
            f"{method}: group size {group_size} is not supported; supported: "
            f"{', '.join(map(str, valid_groups))} (-1: one group per output channel)"
        )
    return int(bits), int(group_size)


class WNA16Config(QuantConfig):
    """What the three formats share: a scheme and the modules left unquantized."""

    method_name: ClassVar[str] = ""

    def __init__(self, scheme: WNA16Scheme, skipped: list[str] | None = None, lm_head: bool = False) -> None:
        self.scheme, self.skipped, self.lm_head = scheme, list(skipped or []), lm_head

    @classmethod
    def get_name(cls) -> str:
        return cls.method_name

    def verify(self, model_config: Any, device: torch.device) -> None:
        device_type = torch.device(device).type
        dtypes = ACT_DTYPES_CUDA if device_type == "cuda" else ACT_DTYPES
        if model_config.dtype not in dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            raise ConfigError(
                f"{self.get_name()} weights run with activations in {names} on {device_type}, not "
                f"{str(model_config.dtype).removeprefix('torch.')} (choose one with --dtype)"
            )

    def is_skipped(self, prefix: str) -> bool:
        leaf = prefix.rpartition(".")[2]
        if leaf in ROUTER_LEAVES:
            return True
        return is_module_listed(prefix, self.skipped)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethodBase | None:
        from framework.layers.embedding import LMHead, VocabEmbedding
        from framework.layers.fused_moe import FusedMoE
        from framework.layers.linear import LinearBase

        if isinstance(layer, FusedMoE):
            from .moe import WNA16FusedMoEMethod

            return None if self.is_skipped(prefix) else WNA16FusedMoEMethod(self.scheme)
        if isinstance(layer, LMHead):
            from .method import WNA16LinearMethod

            return WNA16LinearMethod(self.scheme) if self.lm_head else None
        if isinstance(layer, VocabEmbedding) or not isinstance(layer, LinearBase) or self.is_skipped(prefix):
            return None
        from .method import WNA16LinearMethod

        return WNA16LinearMethod(self.scheme)


class GPTQConfig(WNA16Config):
    """``quant_method: gptq``: AutoGPTQ / GPTQModel checkpoints (``checkpoint_format`` gptq, gptq_v2,
    or marlin / ``is_marlin_format: true``: AutoGPTQ's Marlin serialization, 4-bit symmetric)."""

    method_name = "gptq"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> GPTQConfig:
        bits, group_size = check_bits_and_group("gptq", config.get("bits"), config.get("group_size", -1))
        checkpoint_format = str(
            config.get("checkpoint_format", config.get("format", "gptq"))
        ).lower()  # GPTQModel: either
        if config.get("is_marlin_format"):
            checkpoint_format = "marlin"
        if checkpoint_format not in ("gptq", "gptq_v2", "marlin"):
            raise ConfigError(
                f"gptq: checkpoint_format {checkpoint_format!r} is not supported; supported: gptq, gptq_v2, marlin"
            )
        desc_act, symmetric = bool(config.get("desc_act", False)), bool(config.get("sym", True))
        if checkpoint_format == "marlin":
            if bits != 4 or group_size not in (128, -1) or desc_act or not symmetric:
                raise ConfigError(
                    f"gptq marlin format: only 4-bit symmetric weights, group size 128 or -1, without "
                    f"desc_act are stored in Marlin's layout; got bits={bits} group_size={group_size} "
                    f"desc_act={desc_act} sym={symmetric}"
                )
            scheme = WNA16Scheme("marlin", 4, group_size)
        else:
            scheme = WNA16Scheme(
                "gptq", bits, group_size, symmetric, desc_act, zero_offset=0 if checkpoint_format == "gptq_v2" else 1
            )
        skipped = list(config.get("modules_to_not_convert") or [])
        return cls(scheme, skipped, lm_head=bool(config.get("lm_head", False)))

    @classmethod
    def for_isq(cls, isq_type: str, model_config: Any, weight_shapes: dict[str, tuple[int, ...]]) -> GPTQConfig:
        """``--isq int4`` / ``int8``: symmetric GPTQ-layout weights, group 128, rounded to nearest
        (the layers ``fw quantize --method rtn`` quantizes: the decoder's linear layers)."""
        bits = ISQ_BITS.get(isq_type)
        if bits is None:
            raise ConfigError(f"fw_gptq offers --isq {', '.join(ISQ_BITS)}; got {isq_type!r}")
        return cls.from_config({"bits": bits, "group_size": ISQ_GROUP_SIZE, "sym": True, "desc_act": False})

    def quantize_weight(self, name: str, weight: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """``qweight`` / ``qzeros`` / ``scales`` / ``g_idx`` of a decoder linear layer's ``weight``, else None."""
        stem = name.removesuffix(".weight")
        if stem == name or ".layers." not in f".{stem}" or self.is_skipped(stem):
            return None
        from .packing import pack_gptq
        from .quantize.rtn import round_to_nearest

        packed = pack_gptq(round_to_nearest(weight, self.scheme.bits, self.scheme.group_size, True))
        return [(f"{stem}.{key}", value) for key, value in packed.items()]


#: ``--isq`` names of the W4A16 / W8A16 core, and their group size.
ISQ_BITS = {"int4": 4, "int8": 8}
ISQ_GROUP_SIZE = 128


class AWQConfig(WNA16Config):
    """``quant_method: awq``: AutoAWQ's GEMM layout, 4-bit with zero points."""

    method_name = "awq"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit"))
        group_size = config.get("group_size", config.get("q_group_size", 128))
        bits, group_size = check_bits_and_group("awq", bits, group_size, valid_bits=(4,))
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"awq: version {version!r} (its packing) is not supported; supported: gemm")
        if not config.get("zero_point", True):
            raise ConfigError("awq: zero_point: false is not supported; AWQ GEMM checkpoints carry zero points")
        return cls(WNA16Scheme("awq", bits, group_size, symmetric=False), config.get("modules_to_not_convert"))


class CompressedTensorsConfig(WNA16Config):
    """``quant_method: compressed-tensors`` with ``format: pack-quantized``: llm-compressor's
    W4A16 / W8A16 (integer weights, group or channel strategy, symmetric or not, 16-bit activations)."""

    method_name = "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> CompressedTensorsConfig:
        fmt = config.get("format", "pack-quantized")
        if fmt != "pack-quantized":
            raise ConfigError(
                f"compressed-tensors: format {fmt!r} is not supported; supported: pack-quantized (W4A16 / W8A16)"
            )
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ConfigError(f"compressed-tensors: {len(groups)} config_groups; fw supports one scheme per checkpoint")
        group = groups[0]
        weights = group.get("weights") or {}
        if group.get("input_activations") is not None:
            raise ConfigError(
                "compressed-tensors: quantized input activations are not supported; supported: "
                "weight-only W4A16 / W8A16"
            )
        if weights.get("type", "int") != "int":
            raise ConfigError(
                f"compressed-tensors: weight type {weights.get('type')!r} is not supported; supported: int"
            )
        strategy = weights.get("strategy", "group")
        if strategy not in ("group", "channel"):
            raise ConfigError(f"compressed-tensors: strategy {strategy!r} is not supported; supported: group, channel")
        group_size = -1 if strategy == "channel" else weights.get("group_size")
        bits, group_size = check_bits_and_group("compressed-tensors", weights.get("num_bits"), group_size)
        actorder = weights.get("actorder")
        scheme = WNA16Scheme(
            "compressed", bits, group_size, bool(weights.get("symmetric", True)), desc_act=actorder == "group"
        )  # "weight" order is baked into the weights: no g_idx
        return cls(scheme, config.get("ignore"))
