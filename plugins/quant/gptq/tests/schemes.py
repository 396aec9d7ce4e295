"""The formats as framework.testing QuantSchemes: random integer weights written by the independent
writers of :mod:`reference_formats`, the float32 values they stand for, and the checkpoint's config."""

from __future__ import annotations

import torch
from fw_gptq.config import AWQConfig, CompressedTensorsConfig, GPTQConfig
from reference_formats import random_int_weight, write_awq, write_compressed, write_gptq, write_marlin


class FormatScheme:
    """One format with one setting; ``block_size`` is a multiple of the group size."""

    def __init__(
        self,
        fmt: str,
        bits: int = 4,
        group_size: int = 128,
        symmetric: bool = True,
        act_order: bool = False,
        v2: bool = False,
    ) -> None:
        self.fmt, self.bits, self.group_size, self.symmetric = fmt, bits, group_size, symmetric
        self.act_order, self.v2 = act_order, v2
        self.block_size = 128 if group_size in (-1, 128) else 2 * group_size

    def __repr__(self) -> str:
        return (
            f"{self.fmt}-{self.bits}bit-g{self.group_size}-{'sym' if self.symmetric else 'asym'}"
            f"{'-act' if self.act_order else ''}{'-v2' if self.v2 else ''}"
        )

    def one_weight(self, n: int, k: int, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, scales, zeros, g_idx, w = random_int_weight(
            n, k, self.bits, self.group_size, self.symmetric, self.act_order, generator
        )
        if self.fmt == "gptq":
            return write_gptq(q, scales, zeros, g_idx, self.bits, v2=self.v2), w
        if self.fmt == "awq":
            return write_awq(q, scales, zeros), w
        if self.fmt == "marlin":
            return write_marlin(q, scales), w
        tensors = write_compressed(q, scales, zeros, self.bits)
        if self.act_order:
            tensors["weight_g_idx"] = g_idx.to(torch.int32)
        # the scales as stored (bf16) are the values the weight stands for
        scale_values = tensors["weight_scale"].float().t()
        z = torch.full_like(scales, 2 ** (self.bits - 1)) if zeros is None else zeros.float()
        w = ((q.float() - z[g_idx]) * scale_values[g_idx]).t().contiguous()
        return tensors, w

    def make_weight(self, name, shape, generator):
        stem = name.removesuffix(".weight")
        if len(shape) == 2:
            tensors, w = self.one_weight(shape[0], shape[1], generator)
            return {f"{stem}.{key}": value for key, value in tensors.items()}, w
        experts = [self.one_weight(shape[1], shape[2], generator) for _ in range(shape[0])]
        stacked = {f"{stem}.{key}": torch.stack([t[key] for t, _ in experts]) for key in experts[0][0]}
        return stacked, torch.stack([w for _, w in experts])

    def config(self) -> dict:
        if self.fmt in ("gptq", "marlin"):
            config = {
                "quant_method": "gptq",
                "bits": self.bits,
                "group_size": self.group_size,
                "desc_act": self.act_order,
                "sym": self.symmetric,
            }
            if self.fmt == "marlin":
                config["is_marlin_format"] = True
            elif self.v2:
                config["checkpoint_format"] = "gptq_v2"
            return config
        if self.fmt == "awq":
            return {
                "quant_method": "awq",
                "bits": 4,
                "group_size": self.group_size,
                "zero_point": True,
                "version": "gemm",
            }
        weights = {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.symmetric,
            "strategy": "channel" if self.group_size == -1 else "group",
            "group_size": None if self.group_size == -1 else self.group_size,
            "actorder": "group" if self.act_order else None,
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"],
        }

    def quant_config(self, tensors):
        cls = {"gptq": GPTQConfig, "marlin": GPTQConfig, "awq": AWQConfig}.get(self.fmt, CompressedTensorsConfig)
        return cls.from_config(self.config())


#: Every format and setting the plugin builds, as the conformance tests run them.
SCHEMES = [
    FormatScheme("gptq", 4, 128),
    FormatScheme("gptq", 4, 32, symmetric=False, act_order=True),
    FormatScheme("gptq", 8, 64, symmetric=False, v2=True),
    FormatScheme("gptq", 4, -1, act_order=True),
    FormatScheme("awq", 4, 128, symmetric=False),
    FormatScheme("awq", 4, 64, symmetric=False),
    FormatScheme("compressed", 4, 128),
    FormatScheme("compressed", 4, 32, symmetric=False),
    FormatScheme("compressed", 8, -1),
    FormatScheme("compressed", 4, 128, act_order=True),
    FormatScheme("marlin", 4, 128),
]
