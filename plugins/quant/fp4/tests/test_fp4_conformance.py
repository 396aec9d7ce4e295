"""The FP4 dense methods through framework.testing's conformance kit (every linear layer kind,
tensor-parallel ranks, fused shards with their own global scales) against the test packer's
table reading: the CPU's torch path (bf16), the Triton kernels interpreted (fp32) and on the GPU
(bf16, fp16, with CUDA-graph replay); and the MoE experts of every layout (gate, up and down of
each expert with their own NVFP4 global scales) through the MoE kit, interpreted and on the GPU
(their CPU path: test_fp4_moe_qwen3)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from tiny_fp4_llama import LAYOUTS, pack, quantization_config

from framework.testing import check_linear_method, check_moe_method, interpreted


@dataclass
class Fp4Scheme:
    """One dense FP4 checkpoint layout (``tiny_fp4_llama.LAYOUTS``) as the conformance kit needs it."""

    layout: str

    @property
    def block_size(self) -> int:
        return 32 if self.layout == "compressed-tensors-mxfp4" else 16

    def make_weight(self, name: str, shape: tuple[int, ...], generator: torch.Generator):
        weight = torch.randn(shape, generator=generator)
        if weight.dim() == 3:  # an expert stack: each expert packed alone (NVFP4: its own global scale),
            # scaled by (1 + e) / E so that the outputs stay within float16
            per_expert = [pack(w * (1 + e) / len(weight), self.layout) for e, w in enumerate(weight)]
            tensors = {key: torch.stack([t[key] for t, _ in per_expert]) for key in per_expert[0][0]}
            values = torch.stack([v for _, v in per_expert])
        else:
            tensors, values = pack(weight, self.layout)
        stem = name.removesuffix(".weight")
        return {f"{stem}.{key}": value for key, value in tensors.items()}, values

    def quant_config(self, tensors):
        from fw_fp4.mxfp4_linear import CompressedTensorsMxfp4Config
        from fw_fp4.nvfp4 import CompressedTensorsNvfp4Config, ModelOptNvfp4Config

        configs = {
            "modelopt": ModelOptNvfp4Config,
            "compressed-tensors": CompressedTensorsNvfp4Config,
            "compressed-tensors-mxfp4": CompressedTensorsMxfp4Config,
        }
        return configs[self.layout].from_config(quantization_config(self.layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_linear_method_passes_the_conformance_kit_on_the_cpu_path(layout, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernels themselves: test_fp4_linear_kernels
    cases = check_linear_method(Fp4Scheme(layout), num_rows=(1, 7), tp_sizes=(1, 4), dtypes=(torch.bfloat16,))
    assert "qkv_proj tp=4 rank=3 bfloat16" in cases


@interpreted
@pytest.mark.parametrize("layout", LAYOUTS)
def test_linear_method_passes_the_conformance_kit_through_the_interpreted_kernels(layout):
    cases = check_linear_method(Fp4Scheme(layout), num_rows=(1, 7), tp_sizes=(2,), dtypes=(torch.float32,))
    assert "qkv_proj tp=2 rank=1 float32" in cases


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_linear_method_passes_the_conformance_kit_on_cuda(layout):
    cases = check_linear_method(Fp4Scheme(layout), device="cuda", num_rows=(1, 2, 7, 64, 200), tp_sizes=(1, 2))
    assert "qkv_proj tp=2 rank=1 float16" in cases


@interpreted
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_method_passes_the_conformance_kit_through_the_interpreted_kernel(layout, monkeypatch):
    monkeypatch.setenv("FW_KERNELS", "quantized_fused_moe=triton_fp4")
    cases = check_moe_method(
        Fp4Scheme(layout), num_experts=8, num_tokens=(1, 4, 40), tp_sizes=(2,), dtypes=(torch.float32, torch.float16)
    )
    assert "experts tp=2 rank=1 float32" in cases


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_method_passes_the_conformance_kit_on_cuda(layout):
    cases = check_moe_method(Fp4Scheme(layout), device="cuda", num_experts=16, tp_sizes=(1, 2))
    assert "experts tp=2 rank=1 float16" in cases


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_experts_get_the_fp4_method_unless_skipped(layout):
    from fw_fp4.experts import Fp4ExpertsMethod

    from framework.layers.fused_moe import FusedMoE

    config = Fp4Scheme(layout).quant_config({})
    experts = FusedMoE(
        8, 2, 64, 128, renormalize=True, quant_config=config, prefix="layer.experts", tp_size=1, tp_rank=0
    )
    assert isinstance(experts.quant_method, Fp4ExpertsMethod)
    config.skipped = ["layer.experts"]  # listed as left unquantized: built as 16-bit experts
    experts = FusedMoE(
        8, 2, 64, 128, renormalize=True, quant_config=config, prefix="layer.experts", tp_size=1, tp_rank=0
    )
    assert type(experts.quant_method).__name__ == "UnquantizedFusedMoEMethod"


def test_experts_whose_width_per_rank_is_not_whole_groups_are_refused():
    from framework.errors import ConfigError
    from framework.layers.fused_moe import FusedMoE

    config = Fp4Scheme("modelopt").quant_config({})
    with pytest.raises(ConfigError, match="intermediate size per rank 24 is not a multiple of NVFP4's group of 16"):
        FusedMoE(8, 2, 64, 48, renormalize=True, quant_config=config, prefix="layer.experts", tp_size=2, tp_rank=0)
