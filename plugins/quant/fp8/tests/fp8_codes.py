"""How far two 1x128-group FP8 activation quantizations of the same activations may differ, and the
product a quantization stands for.

Quantizing ``x`` divides by ``s = amax / 448`` and rounds to the nearest e4m3 code. The torch
reference divides exactly; a GPU kernel's fp32 division (Triton's ``/``: ``div.full.f32``) may be a
couple of ulps off, and so may its scale. That moves a ratio lying (almost) on the midpoint between
two codes to the other side: about 1.4 % of bf16 activations lie within an fp32 ulp of a midpoint
(their 8-bit mantissas make exact ties common), so a kernel may pick the neighbouring code there and
nowhere else. :func:`assert_same_quantization` allows exactly that:

* the scales agree within :data:`SCALE_RTOL` (a few fp32 ulps);
* a differing code is the neighbour of the reference code (magnitudes one e4m3 step apart) and the
  exact ratio ``x / s_ref`` lies within :data:`TIE_RTOL` of the midpoint between the two codes;
* at most :data:`MAX_FLIP_FRACTION` of the codes differ.

A scale a part in 4096 off moves ratios by far more than ``TIE_RTOL`` and fails (the tests show it).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GROUP = 128
#: Scales may differ by this relative amount (4 ulps of fp32: an approximate division of the amax).
SCALE_RTOL = 2.0**-21
#: A differing code's exact ratio lies this close (relative) to the midpoint between the codes:
#: the scale's and the division's few ulps, with a margin of 4.
TIE_RTOL = 2.0**-19
#: At most this fraction of the codes may differ (near-ties are ~1.4 % of bf16 activations).
MAX_FLIP_FRACTION = 1 / 32


def _per_input(scale: torch.Tensor, k: int) -> torch.Tensor:
    return scale.double().repeat_interleave(GROUP, -1)[..., :k]


def assert_same_quantization(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, q_ref: torch.Tensor, s_ref: torch.Tensor
) -> int:
    """Check ``(q, s)`` against ``(q_ref, s_ref)``, both quantizations of ``x [M, K]`` (codes ``[M, K]``
    float8_e4m3fn, scales ``[M, ceil(K / 128)]``), as the module docstring says; returns how many codes
    differ. Raises AssertionError naming the first violation."""
    x, q, s, q_ref, s_ref = (t.detach().cpu() for t in (x, q, s, q_ref, s_ref))
    torch.testing.assert_close(s.float(), s_ref.float(), rtol=SCALE_RTOL, atol=0, msg="activation scales")
    values, ref_values = q.float(), q_ref.float()
    flips = values != ref_values  # -0 == +0
    count = int(flips.sum())
    assert count <= MAX_FLIP_FRACTION * q.numel(), f"{count} of {q.numel()} codes differ"
    if not count:
        return 0
    bits, ref_bits = q.view(torch.uint8)[flips].int(), q_ref.view(torch.uint8)[flips].int()
    magnitude, ref_magnitude = bits & 0x7F, ref_bits & 0x7F
    same_sign = ((bits ^ ref_bits) & 0x80 == 0) | (torch.minimum(magnitude, ref_magnitude) == 0)
    neighbours = same_sign & ((magnitude - ref_magnitude).abs() == 1)
    assert bool(neighbours.all()), f"codes more than one step apart: {values[flips][~neighbours][:8].tolist()}"
    ratio = (x.double() / _per_input(s_ref, x.shape[1]))[flips]
    midpoint = (values[flips].double() + ref_values[flips].double()) / 2
    off = (ratio - midpoint).abs() / midpoint.abs()
    worst = int(off.argmax())
    assert float(off[worst]) <= TIE_RTOL, (
        f"a code differs away from a tie: x / s = {float(ratio[worst])!r}, codes {float(values[flips][worst])} "
        f"and {float(ref_values[flips][worst])} (relative distance {float(off[worst]):.3g} > {TIE_RTOL:.3g})"
    )
    return count


def product(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q @ w.T, |x_q| @ |w|.T)`` in float64 on the CPU for the activations ``q * s`` and the
    dequantized weight ``w [N, K]``: what a kernel multiplying those codes computes, and the sum of
    its terms' magnitudes (the scale of its fp32 summation error)."""
    values = q.cpu().double() * _per_input(s.cpu(), q.shape[1])
    w = w.cpu().double()
    return values @ w.t(), values.abs() @ w.abs().t()


def assert_sums_the_product(out: torch.Tensor, expected: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    """``out`` (a kernel's output, any float dtype) equals ``expected`` (:func:`product` of the codes it
    multiplied) within its dtype's rounding of the result plus an fp32 summation error of 2^-14 of the
    terms' magnitudes: any order of fp32 sums passes; a missing or repeated group or split does not."""
    exact, magnitude = expected
    rounding = torch.finfo(out.dtype).eps if out.dtype != torch.float64 else 0.0  # 2^-mantissa bits
    error = (out.cpu().double() - exact).abs()
    bound = rounding * exact.abs() + 2.0**-14 * magnitude
    worst = int((error - bound).argmax())
    assert bool((error <= bound).all()), (
        f"{what}: |out - product| = {float(error.flatten()[worst]):.4g} > {float(bound.flatten()[worst]):.4g} "
        f"at flat index {worst}"
    )


def fused_quantization(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales the W8A8 GEMM quantizes ``x`` (bf16) to inside its loop (``FUSED_QUANT``),
    read back through an identity weight of unit scale: from fp32 activations holding the same values
    (the kernel widens its tile to fp32 before quantizing either way) it writes ``fl(code * scale)``
    in fp32. Each group's largest entry is +-448 * scale; the codes are the outputs over that scale."""
    from fw_fp8.kernels.layout import Fp8Weight  # Triton: imported where kernels run
    from fw_fp8.kernels.w8a8_block import w8a8_block_matmul

    m, k = x.shape
    eye = Fp8Weight(torch.eye(k, device=x.device).to(E4M3), torch.ones(k, 1, device=x.device), 1, k)
    config = {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 1, "FUSED_QUANT": True, "num_warps": 4, "num_stages": 4}
    values = w8a8_block_matmul(x.float(), eye, config=config).double().cpu()
    groups = -(-k // GROUP)
    padded = torch.zeros(m, groups * GROUP, dtype=torch.float64)
    padded[:, :k] = values
    s = (padded.view(m, groups, GROUP).abs().amax(-1) / E4M3_MAX).float()
    q = (values / s.double().repeat_interleave(GROUP, 1)[:, :k]).float().to(E4M3)
    return q, s
