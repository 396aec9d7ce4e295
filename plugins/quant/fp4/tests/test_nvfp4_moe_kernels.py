"""The FP4 MoE Triton kernel on NVFP4 experts (e4m3 scales per 16, a global scale per expert and
projection in either convention) against the dense reference on the independent packer's exact
values: interpreted on CPU in fp32 (several K steps, ragged groups, the sorted prefill form), and
compiled on CUDA in bf16 at Qwen3-30B-A3B's expert shapes."""

from __future__ import annotations

import pytest
import torch
from fw_fp4.experts import dequantize_nvfp4_rows
from fw_fp4.formats import nvfp4_row_scale
from mxfp4_packer import dequantize_nvfp4_lut, quantize_nvfp4

from framework import ops
from framework.layers.fused_moe import select_experts
from framework.ops import MoEActivation, PackedExperts
from framework.testing import interpreted, require_triton

require_triton()

from fw_fp4.kernels.fp4_moe import quantized_fused_moe  # noqa: E402


def nvfp4_experts(num_experts, hidden_size, width, convention, generator, device="cpu"):
    """Random gate, up, down experts, each packed alone (its own global scale), and their exact values."""
    dense, packed = [], []
    for rows, k in ((width, hidden_size), (width, hidden_size), (hidden_size, width)):
        tensors = [
            quantize_nvfp4(torch.randn(rows, k, generator=generator) * k**-0.5 * (1 + e), convention)
            for e in range(num_experts)
        ]
        dense.append(torch.stack([dequantize_nvfp4_lut(t) for t in tensors]))
        data = torch.stack([t.get("weight", t.get("weight_packed")) for t in tensors])
        scales = torch.stack([t["weight_scale"] for t in tensors]).view(torch.uint8)
        stored = torch.stack([t.get("weight_scale_2", t.get("weight_global_scale")).reshape(()) for t in tensors])
        factors = nvfp4_row_scale(stored, convention)
        packed.append(
            PackedExperts(data.to(device), scales.to(device), "nvfp4", k, dequantize_nvfp4_rows, factors.to(device))
        )
    return packed, dense


def routed_inputs(num_tokens, num_experts, top_k, hidden_size, generator, dtype=torch.float32, device="cpu"):
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(device=device, dtype=dtype)
    logits = torch.randn(num_tokens, num_experts, generator=generator).to(device)
    return hidden, *select_experts(logits, top_k, True)


#: (tokens, experts, top_k, hidden, intermediate), convention: decode with two K steps (H 160) and 3
#: groups of down inputs, a prefill past the sorted-form threshold. The convention only changes the
#: host's factor (the kernel multiplies either way), so each shape takes one.
CPU_CASES = [((1, 8, 2, 160, 48), "multiply"), ((70, 8, 4, 64, 32), "divide")]


@interpreted
@pytest.mark.parametrize(
    ("shape", "convention"), CPU_CASES, ids=lambda c: "T{}_E{}_k{}_H{}_I{}".format(*c) if isinstance(c, tuple) else c
)
def test_interpreted_kernel_matches_the_dense_reference_fp32(shape, convention):
    num_tokens, num_experts, top_k, hidden_size, width = shape
    generator = torch.Generator().manual_seed(sum(shape))
    (w1, w3, w2), (gate, up, down) = nvfp4_experts(num_experts, hidden_size, width, convention, generator)
    hidden, topk_weights, topk_ids = routed_inputs(num_tokens, num_experts, top_k, hidden_size, generator)
    out = quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, MoEActivation())
    expected = ops.fused_moe(hidden, torch.cat([gate, up], 1), down, topk_weights, topk_ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert expected.abs().max() > 0.1
    reference = ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids)  # the CPU engines' path
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_global_scales_on_some_projections_only_are_refused():
    generator = torch.Generator().manual_seed(5)
    (w1, w3, w2), _ = nvfp4_experts(2, 32, 16, "multiply", generator)
    hidden, topk_weights, topk_ids = routed_inputs(1, 2, 1, 32, generator)
    with pytest.raises(ValueError, match="gate, up and down must all have global scales or none"):
        quantized_fused_moe(hidden, w1, w3, w2._replace(global_scales=None), topk_weights, topk_ids)


@pytest.fixture(scope="module")
def qwen3_30b_experts():
    """Qwen3-30B-A3B's expert shapes (hidden 2048, width 768), 32 of its 128 experts, packed once."""
    return nvfp4_experts(32, 2048, 768, "divide", torch.Generator().manual_seed(0), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_compiled_kernel_matches_the_reference_on_cuda_bf16(num_tokens, qwen3_30b_experts):
    (w1, w3, w2), (gate, up, down) = qwen3_30b_experts
    generator = torch.Generator().manual_seed(num_tokens)
    hidden, topk_weights, topk_ids = routed_inputs(num_tokens, 32, 8, 2048, generator, torch.bfloat16, "cuda")
    out = quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids)
    w13 = torch.cat([gate, up], 1).to("cuda", torch.bfloat16)
    expected = ops.fused_moe(hidden, w13, down.to("cuda", torch.bfloat16), topk_weights, topk_ids)
    torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2, atol=3e-2 * expected.abs().max().item())
