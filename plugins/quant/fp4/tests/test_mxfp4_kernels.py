"""The MXFP4 MoE Triton kernel against the torch reference ``framework.ops.quantized_fused_moe``
(interpreted on CPU in fp32; compiled on CUDA in bf16), and the method against dequantize-then-fused_moe."""

from __future__ import annotations

import pytest
import torch
from fw_fp4.formats import fold_scale_bias
from fw_fp4.moe import QUANT_TYPE, dequantize_rows
from mxfp4_packer import dequantize_mxfp4_lut, quantize_mxfp4

from framework import ops
from framework.layers.fused_moe import select_experts
from framework.ops import MoEActivation, PackedExperts
from framework.testing import interpreted, require_triton

require_triton()

from fw_fp4.kernels.fp4_moe import quantized_fused_moe  # noqa: E402


def mxfp4_experts(num_experts, hidden_size, width, generator, device="cpu"):
    """Random gate, up, down experts packed by the independent packer, and their exact dense values."""
    dense, packed = [], []
    for rows, k in ((width, hidden_size), (width, hidden_size), (hidden_size, width)):
        weight = torch.randn(num_experts, rows, k, generator=generator) * k**-0.5
        blocks, scales = quantize_mxfp4(weight)
        dense.append(dequantize_mxfp4_lut(blocks, scales))
        data, folded = blocks.flatten(-2).to(device), fold_scale_bias(scales, "test").to(device)
        packed.append(PackedExperts(data, folded, QUANT_TYPE, k, dequantize_rows))
    return packed, dense


def routed_inputs(num_tokens, num_experts, top_k, hidden_size, generator, dtype=torch.float32, device="cpu"):
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(device=device, dtype=dtype)
    logits = torch.randn(num_tokens, num_experts, generator=generator).to(device)
    return hidden, *select_experts(logits, top_k, True)


def gpt_oss_activation(num_experts, hidden_size, width, generator, device="cpu", dtype=torch.float32):
    return MoEActivation(
        (torch.randn(num_experts, 2 * width, generator=generator) * 0.5).to(device=device, dtype=dtype),
        (torch.randn(num_experts, hidden_size, generator=generator) * 0.5).to(device=device, dtype=dtype),
        swiglu_limit=1.0,
    )


#: (tokens, experts, top_k, hidden, intermediate): decode, ragged, a prefill past the large-tile threshold.
CPU_SHAPES = [(1, 8, 2, 64, 32), (7, 16, 4, 96, 160), (70, 8, 4, 64, 64)]


@interpreted
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "T{}_E{}_k{}_H{}_I{}".format(*s))
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "gpt_oss"])
def test_interpreted_kernel_matches_the_reference_on_the_dense_weights_fp32(shape, gpt_oss):
    num_tokens, num_experts, top_k, hidden_size, width = shape
    generator = torch.Generator().manual_seed(sum(shape))
    (w1, w3, w2), (gate, up, down) = mxfp4_experts(num_experts, hidden_size, width, generator)
    hidden, topk_weights, topk_ids = routed_inputs(num_tokens, num_experts, top_k, hidden_size, generator)
    activation = gpt_oss_activation(num_experts, hidden_size, width, generator) if gpt_oss else MoEActivation()
    out = quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, activation)
    # the oracle: the packer's exact dense weights through the dense reference
    expected = ops.fused_moe(hidden, torch.cat([gate, up], 1), down, topk_weights, topk_ids, activation)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert expected.abs().max() > 0.1
    # and the packed torch reference (what CPU engines run) agrees
    reference = ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, activation)
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5)


def test_other_quant_types_go_to_the_reference(monkeypatch):
    generator = torch.Generator().manual_seed(3)
    (w1, w3, w2), _ = mxfp4_experts(4, 64, 32, generator)
    w1 = w1._replace(quant_type="gguf:Q4_0")
    calls = []
    monkeypatch.setattr(ops, "quantized_fused_moe", lambda *args: calls.append(args) or "reference")
    hidden, topk_weights, topk_ids = routed_inputs(2, 4, 2, 64, generator)
    assert quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids) == "reference"
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_compiled_kernel_matches_the_reference_on_cuda_bf16(num_tokens):
    """gpt-oss-20b's expert shapes (hidden 2880, width 2880, 32 experts, top-4)."""
    generator = torch.Generator().manual_seed(num_tokens)
    num_experts, hidden_size, width = 32, 2880, 2880
    (w1, w3, w2), (gate, up, down) = mxfp4_experts(num_experts, hidden_size, width, generator, "cuda")
    hidden, topk_weights, topk_ids = routed_inputs(
        num_tokens, num_experts, 4, hidden_size, generator, torch.bfloat16, "cuda"
    )
    activation = gpt_oss_activation(num_experts, hidden_size, width, generator, "cuda", torch.bfloat16)
    activation = activation._replace(swiglu_limit=7.0)
    out = quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, activation)
    w13 = torch.cat([gate, up], 1).to("cuda", torch.bfloat16)
    expected = ops.fused_moe(hidden, w13, down.to("cuda", torch.bfloat16), topk_weights, topk_ids, activation)
    torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2, atol=3e-2 * expected.abs().max().item())
