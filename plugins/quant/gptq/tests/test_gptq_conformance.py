"""Every format through framework.testing's conformance kits (every linear layer kind, FusedMoE;
TP 1/2/4; bf16 and fp16) against the values its independent writer encoded: dequantized at load
(the CPU's path) and kept in the kernel layout (the GPU's path, its torch reference here)."""

from __future__ import annotations

import pytest
import torch
from schemes import SCHEMES, FormatScheme

from framework.testing import check_linear_method, check_moe_method


@pytest.mark.parametrize("keep_packed", ["0", "1"], ids=["dequantized-at-load", "kernel-layout"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=repr)
def test_linear_method_passes_the_conformance_kit(scheme, keep_packed, monkeypatch):
    monkeypatch.setenv("FW_GPTQ_KEEP_PACKED", keep_packed)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernel itself: test_gptq_kernels
    # Marlin tiles of 64 outputs: the kit's 32 per rank do not split; fp16 and TP=2 repeat TP=4's code (CPU minutes)
    tp_sizes = (1,) if scheme.fmt == "marlin" else (1, 4)
    dtype = torch.float16 if keep_packed == "1" else torch.bfloat16
    cases = check_linear_method(scheme, num_rows=(1, 7), tp_sizes=tp_sizes, dtypes=(dtype,))
    assert f"qkv_proj tp={tp_sizes[-1]} rank={tp_sizes[-1] - 1} {str(dtype).removeprefix('torch.')}" in cases


@pytest.mark.parametrize(
    "scheme",
    [
        FormatScheme("gptq", 4, 128),
        FormatScheme("awq", 4, 128, symmetric=False),
        FormatScheme("compressed", 8, 32, symmetric=False),
        FormatScheme("gptq", 4, 32, act_order=True),
    ],
    ids=repr,
)
def test_experts_kept_packed_equal_dequantize_then_moe(scheme, monkeypatch):
    monkeypatch.setenv("FW_GPTQ_KEEP_PACKED", "1")
    from fw_gptq.moe import WNA16FusedMoEMethod

    cases = check_moe_method(scheme, num_experts=8, num_tokens=(1, 4, 40), tp_sizes=(1, 2), dtypes=(torch.bfloat16,))
    assert "experts tp=2 rank=1 bfloat16" in cases
    from framework.layers.fused_moe import FusedMoE

    layer = FusedMoE(
        8,
        2,
        scheme.block_size,
        4 * scheme.block_size,
        renormalize=True,
        quant_config=scheme.quant_config({}),
        prefix="layer.experts",
        tp_size=1,
        tp_rank=0,
    )
    assert isinstance(layer.quant_method, WNA16FusedMoEMethod)
