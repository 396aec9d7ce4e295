"""The 1x128-group activation quantizers agree code for code except at near-ties.

On the CPU: :func:`fp8_codes.assert_same_quantization` accepts the torch reference against itself and
against a division one ulp off (neighbouring codes at ties only), and refuses a scale a part in 4096
off, whether reported or only used, and codes two steps apart. On the GPU: the quantizer kernel and
the quantization fused into the W8A8 GEMM (read back through an identity weight) against the torch
reference and against each other; on the CPU under the interpreter, that read-back against the
interpreted quantizer kernel."""

from __future__ import annotations

import pytest
import torch
from fp8_codes import MAX_FLIP_FRACTION, assert_same_quantization, fused_quantization

from framework.testing import interpreted, require_triton

require_triton()

from fw_fp8.kernels.w8a8_block import (  # noqa: E402
    GROUP,
    MIN_AMAX,
    quantize_activations,
    quantize_activations_kernel,
    quantize_activations_reference,
)
from fw_fp8.quantize import FP8_DTYPE, FP8_MAX  # noqa: E402


def activations(rows: int, k: int, device: str = "cpu") -> torch.Tensor:
    """bf16 activations spanning three decades across the inputs (as a layer's input does)."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k)) * torch.logspace(-2, 1, k)
    return x.to(device, torch.bfloat16)


def quantize_with(x: torch.Tensor, s: torch.Tensor, ratio_ulps: int = 0) -> torch.Tensor:
    """``x / s`` rounded to e4m3, the fp32 ratio first moved ``ratio_ulps`` ulps up (a division that
    errs)."""
    ratio = x.float() / s.repeat_interleave(GROUP, 1)[:, : x.shape[1]]
    for _ in range(ratio_ulps):
        ratio = torch.nextafter(ratio, torch.full_like(ratio, float("inf")))
    return ratio.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def test_codes_may_differ_only_at_ties_and_only_by_one_step():
    x = activations(16, 1024)
    q, s = quantize_activations_reference(x)
    assert assert_same_quantization(x, q, s, q, s) == 0
    off_by_an_ulp = quantize_with(x, s, ratio_ulps=1)
    flips = assert_same_quantization(x, off_by_an_ulp, s, q, s)
    assert 0 < flips <= MAX_FLIP_FRACTION * x.numel()  # bf16 activations tie often
    wrong = s * (1 + 2.0**-12)
    with pytest.raises(AssertionError, match="away from a tie"):
        assert_same_quantization(x, quantize_with(x, wrong), s, q, s)  # a wrong scale, used not reported
    with pytest.raises(AssertionError, match="activation scales"):
        assert_same_quantization(x, quantize_with(x, wrong), wrong, q, s)
    two_steps = q.clone()
    two_steps.view(torch.uint8)[0, 0] += 2
    with pytest.raises(AssertionError, match="more than one step"):
        assert_same_quantization(x, two_steps, s, q, s)


@interpreted
def test_the_identity_probe_reads_back_the_codes_the_gemm_quantizes_to():
    """Under the interpreter the fused quantization rounds as the interpreted quantizer kernel does
    (both mis-round into the next binade alike): the probe must give exactly its codes and scales."""
    x = activations(2, 384).float()
    q, s = torch.empty(2, 384, dtype=FP8_DTYPE), torch.empty(2, 3)
    quantize_activations_kernel[(2, 3)](x, q, s, 384, x.stride(0), 3, GROUP=GROUP, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX)
    q_fused, s_fused = fused_quantization(x)
    assert torch.equal(q_fused.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(s_fused, s, rtol=2.0**-23, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336])
def test_gpu_quantizers_agree_with_the_reference_except_at_ties(k):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = activations(16, k, "cuda")
    q_ref, s_ref = quantize_activations_reference(x.cpu())
    q, s = quantize_activations(x)
    assert_same_quantization(x, q, s, q_ref, s_ref)
    q_fused, s_fused = fused_quantization(x)
    assert_same_quantization(x, q_fused, s_fused, q_ref, s_ref)
    assert_same_quantization(x, q_fused, s_fused, q, s)
