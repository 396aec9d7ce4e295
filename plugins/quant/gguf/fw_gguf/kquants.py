"""llama.cpp's reference K-quant quantizers (Q2_K .. Q6_K) in vectorized torch.

Each function takes ``[B, 256]`` float32 super-blocks and returns ``[B, type size]`` uint8 blocks.
They reproduce ``quantize_row_q{2..6}_K_ref`` of ggml-quants.c (what ``llama-quantize`` runs without
an importance matrix): the same searches (``make_qkx2_quants`` for the types with a minimum,
``make_qx_quants`` / ``make_q3_quants`` for the symmetric ones), the same float32 operations in
the same order, sums accumulated element by element as the C loops do (:func:`seq_sum`), every
super-block at once. A loop over the 16 or 32 values of a sub-block runs as that many tensor
operations over all sub-blocks of the matrix, so the quantizer runs on the GPU as well.

Layouts (bytes, in order): Q2_K ``scales[16] qs[64] d dmin``; Q3_K ``hmask[32] qs[64]
scales[12] d``; Q4_K ``d dmin scales[12] qs[128]``; Q5_K ``d dmin scales[12] qh[32] qs[128]``;
Q6_K ``ql[128] qh[64] scales int8[16] d`` (d, dmin: float16).
"""

from __future__ import annotations

import numpy as np
import torch

GROUP_MAX_EPS = 1e-15


def seq_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim left to right in float32, as ``for (i...) s += t[i]`` (torch's
    vectorized sum associates differently and may differ in the last bit)."""
    first, *rest = t.unbind(-1)
    total = first
    for column in rest:
        total = total + column
    return total


def div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """``a / b`` correctly rounded in float32, as C divides: torch computes ``number / tensor`` as
    ``reciprocal(tensor) * number`` and, on CUDA, ``tensor / number`` as ``tensor * (1 / number)``."""
    if not torch.is_tensor(a):
        a = torch.full_like(b, a)
    elif not torch.is_tensor(b):
        b = torch.full_like(a, b)
    return a / b


def _f32(value: float) -> float:
    return float(np.float32(value))


def make_qkx2_quants(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``x [B, n]`` (weights ``w``): ``(scale, minus_min, levels)`` minimising the weighted
    error of ``scale * level - minus_min`` over levels ``0..nmax`` (llama.cpp's search over scales)."""
    low, high = x.amin(-1), x.amax(-1)
    sum_w, sum_x = seq_sum(torch.stack([w, w * x]))
    low = low.clamp(max=0)
    flat = high == low
    span = torch.where(flat, torch.ones_like(high), high - low)

    def error(scale, minimum, levels):
        diff = scale[:, None] * levels + minimum[:, None] - x
        return seq_sum(w * (diff.abs() if use_mad else diff * diff))

    iscale = div(nmax, span)
    scale = div(1.0, iscale)
    levels = torch.round(iscale[:, None] * (x - low[:, None])).clamp(0, nmax)
    best = error(scale, low, levels)
    for step in range(nstep + 1):
        factor = _f32(_f32(_f32(rmin) + _f32(_f32(rdelta) * step)) + nmax)
        iscale = div(factor, high - low)
        trial = torch.round(iscale[:, None] * (x - low[:, None])).clamp(0, nmax)
        wl = w * trial
        sum_l, sum_l2, sum_xl = seq_sum(torch.stack([wl, wl * trial, wl * x]))
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
        current = error(this_scale, this_min, trial)
        better = (det > 0) & (current < best) & ~flat
        levels = torch.where(better[:, None], trial, levels)
        best = torch.where(better, current, best)
        scale = torch.where(better, this_scale, scale)
        low = torch.where(better, this_min, low)
    levels = torch.where(flat[:, None], torch.zeros_like(levels), levels)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, -low, levels


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    return x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)


def make_qx_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric levels ``-nmax..nmax-1`` (stored ``+ nmax``) and their scale per row of ``x``,
    weights ``x * x`` (llama.cpp's ``make_qx_quants`` with ``rmse_type = 1`` and no importance)."""
    peak = _signed_absmax(x)
    zero = peak.abs() < GROUP_MAX_EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)
    w = x * x

    def fit(iscale):
        levels = torch.round(iscale[:, None] * x).clamp(-nmax, nmax - 1)
        sumlx, suml2 = seq_sum(torch.stack([w * x * levels, w * levels * levels]))
        return levels, sumlx, suml2

    iscale = div(-nmax, peak)
    levels, sumlx, suml2 = fit(iscale)
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        trial, sumlx, suml2 = fit(div(-_f32(nmax + _f32(_f32(0.1) * step)), peak))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = torch.where(better[:, None], trial, levels)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
    return torch.where(zero, torch.zeros_like(scale), scale), torch.where(zero[:, None], 0, levels + nmax)


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's ``make_q3_quants(do_rmse=true)``: levels ``-nmax..nmax-1`` refined one value at a
    time (five passes of coordinate descent on the weighted fit), stored ``+ nmax``."""
    peak = _signed_absmax(x)
    zero = peak.abs() < GROUP_MAX_EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)
    levels = torch.round(div(-nmax, peak)[:, None] * x).clamp(-nmax, nmax - 1)
    w = x * x
    sumlx = seq_sum(w * x * levels)
    suml2 = seq_sum(w * levels * levels)
    for _ in range(5):  # a pass that changes nothing leaves the state as it was: running all five is the same
        for i in range(x.shape[1]):
            xi, wi, li = x[:, i], w[:, i], levels[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new = torch.round(xi * sl2 / slx).clamp(-nmax, nmax - 1)
            slx_new = slx + wi * xi * new
            sl2_new = sl2 + wi * new * new
            take = (slx > 0) & (new != li) & (sl2_new > 0) & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            levels[:, i] = torch.where(take, new, li)
            sumlx = torch.where(take, slx_new, sumlx)
            suml2 = torch.where(take, sl2_new, suml2)
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    return torch.where(zero, torch.zeros_like(scale), scale), torch.where(zero[:, None], 0, levels + nmax)


# --- packing helpers ------------------------------------------------------------------------


def _f16(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bytes [B, 2], the float32 value the bytes hold)``."""
    half = value.to(torch.float16)
    return half.contiguous().view(torch.uint8).view(-1, 2), half.float()


def _crumbs(levels: torch.Tensor) -> torch.Tensor:
    """``[B, 256]`` 2-bit values -> ``[B, 64]`` bytes: per 128 values, byte l holds values l, l+32, l+64, l+96."""
    q = levels.view(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64).to(torch.uint8)


def _pack_scale_min_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins -> the 12 bytes of Q4_K/Q5_K (``get_scale_min_k4`` reads them back)."""
    out = torch.zeros(ls.shape[0], 12, dtype=torch.int32, device=ls.device)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out.to(torch.uint8)


def _requantize(
    x: torch.Tensor, d: torch.Tensor, dm: torch.Tensor | None, levels: torch.Tensor, low: int, high: int
) -> torch.Tensor:
    """Levels from the stored (rounded) scales: ``round((x + dm) / d)`` clamped, where ``d != 0``
    (elsewhere the search's levels stay, as llama.cpp's ``if (!d) continue``)."""
    safe = torch.where(d != 0, d, torch.ones_like(d))
    shifted = x if dm is None else x + dm[..., None]
    fresh = torch.round(shifted / safe[..., None]).clamp(low, high)
    return torch.where((d != 0)[..., None], fresh, levels)


def _asymmetric_k(x: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple:
    """Q4_K / Q5_K: eight sub-blocks of 32 with a 6-bit scale and min each; returns
    ``(d bytes, dmin bytes, scale bytes, levels [B, 256] int32)``."""
    blocks = x.shape[0]
    sub = x.reshape(-1, 32)
    av_x = torch.sqrt(div(seq_sum(sub * sub), 32.0))
    weights = av_x[:, None] + sub.abs()
    scales, mins, levels = make_qkx2_quants(sub, weights, nmax, rmin, 0.1, nstep, False)
    scales, mins, levels = scales.view(blocks, 8), mins.view(blocks, 8), levels.view(blocks, 8, 32)
    max_scale = scales.clamp(min=0).amax(-1)
    max_min = mins.clamp(min=0).amax(-1)
    inv_scale = torch.where(max_scale > 0, div(63.0, max_scale), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, div(63.0, max_min), torch.zeros_like(max_min))
    ls = (torch.round(inv_scale[:, None] * scales).to(torch.int32) & 0xFF).clamp(max=63)  # (uint8_t) then MIN(63, .)
    lm = (torch.round(inv_min[:, None] * mins).to(torch.int32) & 0xFF).clamp(max=63)
    d_bytes, d = _f16(div(max_scale, 63.0))
    dmin_bytes, dmin = _f16(div(max_min, 63.0))
    levels = _requantize(x.view(blocks, 8, 32), d[:, None] * ls, dmin[:, None] * lm, levels, 0, nmax)
    return d_bytes, dmin_bytes, _pack_scale_min_k4(ls, lm), levels.reshape(blocks, 256).to(torch.int32)


def q4_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, scales, levels = _asymmetric_k(x, 15, -1.0, 20)
    q = levels.view(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128).to(torch.uint8)
    return torch.cat([d, dmin, scales, qs], dim=1)


def q5_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, scales, levels = _asymmetric_k(x, 31, -0.5, 15)
    q = levels.view(-1, 4, 2, 32)  # chunk c of 64 values: low nibbles of l and l+32 in byte l; bits 4 in qh
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(-1, 128).to(torch.uint8)
    shifts = (2 * torch.arange(4, device=x.device, dtype=torch.int32))[None, :, None]
    qh = ((((q[:, :, 0] >> 4) & 1) << shifts) | (((q[:, :, 1] >> 4) & 1) << (shifts + 1))).sum(1).to(torch.uint8)
    return torch.cat([d, dmin, scales, qh, qs], dim=1)


def q2_k(x: torch.Tensor) -> torch.Tensor:
    blocks = x.shape[0]
    sub = x.reshape(-1, 16)
    scales, mins, levels = make_qkx2_quants(sub, sub.abs(), 3, -0.5, 0.1, 15, True)
    scales, mins, levels = scales.view(blocks, 16), mins.view(blocks, 16), levels.view(blocks, 16, 16)
    max_scale = scales.clamp(min=0).amax(-1)
    max_min = mins.clamp(min=0).amax(-1)
    has_scale, has_min = max_scale > 0, max_min > 0
    ls = torch.round(div(15.0, torch.where(has_scale, max_scale, 1))[:, None] * scales).to(torch.int32)
    ls = torch.where(has_scale[:, None], ls, 0)
    lm = torch.round(div(15.0, torch.where(has_min, max_min, 1))[:, None] * mins).to(torch.int32)
    packed = torch.where(has_min[:, None], ls | (lm << 4), ls) & 0xFF
    d_bytes, d = _f16(torch.where(has_scale, div(max_scale, 15.0), 0))
    dmin_bytes, dmin = _f16(torch.where(has_min, div(max_min, 15.0), 0))
    levels = _requantize(
        x.view(blocks, 16, 16), d[:, None] * (packed & 0xF), dmin[:, None] * (packed >> 4), levels, 0, 3
    )
    qs = _crumbs(levels.reshape(blocks, 256).to(torch.int32))
    return torch.cat([packed.to(torch.uint8), qs, d_bytes, dmin_bytes], dim=1)


def q3_k(x: torch.Tensor) -> torch.Tensor:
    blocks = x.shape[0]
    scales, levels = make_q3_quants(x.reshape(-1, 16), 4)
    scales, levels = scales.view(blocks, 16), levels.view(blocks, 16, 16)
    max_scale = _signed_absmax(scales)
    has = max_scale != 0
    iscale = div(-32.0, torch.where(has, max_scale, 1))
    l6 = torch.round(iscale[:, None] * scales).clamp(-32, 31).to(torch.int32) + 32
    l6 = torch.where(has[:, None], l6, 0)
    packed = torch.zeros(blocks, 12, dtype=torch.int32, device=x.device)
    packed[:, 0:8] = (l6[:, 0:8] & 0xF) | ((l6[:, 8:16] & 0xF) << 4)
    high = (l6 >> 4).view(blocks, 4, 4)  # scale j: bits 4-5 go to byte 8 + j % 4 at bit 2 * (j // 4)
    packed[:, 8:12] = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    d_bytes, d = _f16(torch.where(has, div(1.0, iscale), 0))
    levels = _requantize(x.view(blocks, 16, 16), d[:, None] * (l6 - 32) * has[:, None], None, levels - 4, -4, 3) + 4
    levels = levels.reshape(blocks, 256).to(torch.int32)
    hmask = ((levels > 3).to(torch.int32).view(blocks, 8, 32) << torch.arange(8, device=x.device)[None, :, None]).sum(1)
    qs = _crumbs(torch.where(levels > 3, levels - 4, levels))
    return torch.cat([hmask.to(torch.uint8), qs, packed.to(torch.uint8), d_bytes], dim=1)


def q6_k(x: torch.Tensor) -> torch.Tensor:
    blocks = x.shape[0]
    scales, levels = make_qx_quants(x.reshape(-1, 16), 32)
    scales, levels = scales.view(blocks, 16), levels.view(blocks, 16, 16)
    max_scale = _signed_absmax(scales)
    zero = max_scale.abs() < GROUP_MAX_EPS
    iscale = div(-128.0, torch.where(zero, 1, max_scale))
    d_bytes, d = _f16(torch.where(zero, 0, div(1.0, iscale)))
    sc = torch.round(iscale[:, None] * scales).clamp(max=127).to(torch.int32)
    levels = _requantize(x.view(blocks, 16, 16), d[:, None] * sc, None, levels - 32, -32, 31) + 32
    q = levels.reshape(blocks, 2, 4, 32).to(torch.int32)  # per 128 values: l, l+32, l+64, l+96
    ql = torch.cat(
        [(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4), (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], dim=-1
    ).reshape(blocks, 128)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = torch.cat(
        [ql.to(torch.uint8), qh.reshape(blocks, 64).to(torch.uint8), sc.to(torch.int8).view(torch.uint8), d_bytes],
        dim=1,
    )
    return torch.where(zero[:, None], torch.zeros_like(out), out)
