"""A line-by-line scalar transliteration of llama.cpp's reference K-quant quantizers
(``quantize_row_q{2..6}_K_ref`` and their searches in ggml-quants.c), in numpy float32 scalars.

It is the test oracle for :mod:`fw_gguf.kquants`: slow (pure Python loops, one super-block of 256
values at a time) and written as the C reads, loop for loop, so that it and the vectorized torch
code are two independent implementations of one algorithm.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32
QK_K = 256
EPS = f32(1e-15)


def nearest_int(value) -> int:
    return int(np.rint(f32(value)))  # llama.cpp's magic-number rounding: to nearest, halves to even


def fp16(value) -> tuple[bytes, np.float32]:
    half = np.float16(f32(value))
    return half.tobytes(), f32(half)


def make_qkx2_quants(n, nmax, x, weights, rmin, rdelta, nstep, use_mad):
    L, Laux = [0] * n, [0] * n
    mn, mx = x[0], x[0]
    sum_w = weights[0]
    sum_x = f32(sum_w * x[0])
    for i in range(1, n):
        mn, mx = min(mn, x[i]), max(mx, x[i])
        sum_w = f32(sum_w + weights[i])
        sum_x = f32(sum_x + f32(weights[i] * x[i]))
    if mn > 0:
        mn = f32(0)
    if mx == mn:
        return f32(0), f32(-mn), [0] * n
    iscale = f32(f32(nmax) / f32(mx - mn))
    scale = f32(f32(1) / iscale)
    best_error = f32(0)
    for i in range(n):
        L[i] = max(0, min(nmax, nearest_int(f32(iscale * f32(x[i] - mn)))))
        diff = f32(f32(f32(scale * L[i]) + mn) - x[i])
        diff = abs(diff) if use_mad else f32(diff * diff)
        best_error = f32(best_error + f32(weights[i] * diff))
    for step in range(nstep + 1):
        iscale = f32(f32(f32(f32(rmin) + f32(f32(rdelta) * step)) + nmax) / f32(mx - mn))
        sum_l = sum_l2 = sum_xl = f32(0)
        for i in range(n):
            lv = max(0, min(nmax, nearest_int(f32(iscale * f32(x[i] - mn)))))
            Laux[i] = lv
            w = weights[i]
            sum_l = f32(sum_l + f32(w * lv))
            sum_l2 = f32(sum_l2 + f32(f32(w * lv) * lv))
            sum_xl = f32(sum_xl + f32(f32(w * lv) * x[i]))
        D = f32(f32(sum_w * sum_l2) - f32(sum_l * sum_l))
        if D > 0:
            this_scale = f32(f32(f32(sum_w * sum_xl) - f32(sum_x * sum_l)) / D)
            this_min = f32(f32(f32(sum_l2 * sum_x) - f32(sum_l * sum_xl)) / D)
            if this_min > 0:
                this_min = f32(0)
                this_scale = f32(sum_xl / sum_l2)
            cur_error = f32(0)
            for i in range(n):
                diff = f32(f32(f32(this_scale * Laux[i]) + this_min) - x[i])
                diff = abs(diff) if use_mad else f32(diff * diff)
                cur_error = f32(cur_error + f32(weights[i] * diff))
            if cur_error < best_error:
                L = list(Laux)
                best_error, scale, mn = cur_error, this_scale, this_min
    return scale, f32(-mn), L


def _absmax(x):
    amax, mx = f32(0), f32(0)
    for v in x:
        if amax < abs(v):
            amax, mx = abs(v), v
    return amax, mx


def _first_fit(n, nmax, x, mx):
    """The first pass both symmetric searches make: levels at ``-nmax / max`` and their weighted sums."""
    iscale = f32(f32(-nmax) / mx)
    levels, sumlx, suml2 = [0] * n, f32(0), f32(0)
    for i in range(n):
        levels[i] = max(-nmax, min(nmax - 1, nearest_int(f32(iscale * x[i]))))
        w = f32(x[i] * x[i])
        sumlx = f32(sumlx + f32(f32(w * x[i]) * levels[i]))
        suml2 = f32(suml2 + f32(f32(w * levels[i]) * levels[i]))
    return levels, sumlx, suml2


def make_qx_quants(n, nmax, x):  # rmse_type = 1, no importance weights
    amax, mx = _absmax(x)
    if amax < EPS:
        return f32(0), [0] * n
    levels, sumlx, suml2 = _first_fit(n, nmax, x, mx)
    L = [lv + nmax for lv in levels]
    scale = f32(sumlx / suml2) if suml2 else f32(0)
    best = f32(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = f32(-f32(nmax + f32(f32(0.1) * step)) / mx)
        sumlx = suml2 = f32(0)
        for i in range(n):
            lv = max(-nmax, min(nmax - 1, nearest_int(f32(iscale * x[i]))))
            w = f32(x[i] * x[i])
            sumlx = f32(sumlx + f32(f32(w * x[i]) * lv))
            suml2 = f32(suml2 + f32(f32(w * lv) * lv))
        if suml2 > 0 and f32(sumlx * sumlx) > f32(best * suml2):
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(f32(iscale * x[i]))))
            scale = f32(sumlx / suml2)
            best = f32(scale * sumlx)
    return scale, L


def make_q3_quants(n, nmax, x):  # do_rmse = true
    amax, mx = _absmax(x)
    if amax < EPS:
        return f32(0), [0] * n
    L, sumlx, suml2 = _first_fit(n, nmax, x, mx)
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = f32(x[i] * x[i])
            slx = f32(sumlx - f32(f32(w * x[i]) * L[i]))
            if slx > 0:
                sl2 = f32(suml2 - f32(f32(w * L[i]) * L[i]))
                new_l = max(-nmax, min(nmax - 1, nearest_int(f32(f32(x[i] * sl2) / slx))))
                if new_l != L[i]:
                    slx = f32(slx + f32(f32(w * x[i]) * new_l))
                    sl2 = f32(sl2 + f32(f32(w * new_l) * new_l))
                    if sl2 > 0 and f32(f32(slx * slx) * suml2) > f32(f32(sumlx * sumlx) * sl2):
                        L[i], sumlx, suml2 = new_l, slx, sl2
                        changed += 1
        if not changed:
            break
    return (f32(sumlx / suml2) if suml2 > 0 else f32(0)), [v + nmax for v in L]


def _crumbs(L):
    return bytes(
        L[j + i] | (L[j + i + 32] << 2) | (L[j + i + 64] << 4) | (L[j + i + 96] << 6)
        for j in (0, 128)
        for i in range(32)
    )


def q2_k_block(x) -> bytes:
    L, scales, mins = [0] * QK_K, [f32(0)] * 16, [f32(0)] * 16
    max_scale = max_min = f32(0)
    for j in range(16):
        sub = x[16 * j : 16 * j + 16]
        scales[j], mins[j], L[16 * j : 16 * j + 16] = make_qkx2_quants(
            16, 3, sub, [abs(v) for v in sub], -0.5, 0.1, 15, True
        )
        max_scale, max_min = max(max_scale, scales[j]), max(max_min, mins[j])
    sc = [0] * 16
    if max_scale > 0:
        iscale = f32(f32(15) / max_scale)
        sc = [nearest_int(f32(iscale * s)) & 0xFF for s in scales]
        d_b, d = fp16(f32(max_scale / f32(15)))
    else:
        d_b, d = fp16(0)
    if max_min > 0:
        iscale = f32(f32(15) / max_min)
        sc = [(s | (nearest_int(f32(iscale * m)) << 4)) & 0xFF for s, m in zip(sc, mins)]
        m_b, dmin = fp16(f32(max_min / f32(15)))
    else:
        m_b, dmin = fp16(0)
    for j in range(16):
        dj = f32(d * (sc[j] & 0xF))
        if not dj:
            continue
        dm = f32(dmin * (sc[j] >> 4))
        for ii in range(16):
            L[16 * j + ii] = max(0, min(3, nearest_int(f32(f32(x[16 * j + ii] + dm) / dj))))
    return bytes(sc) + _crumbs(L) + d_b + m_b


def q3_k_block(x) -> bytes:
    L, scales = [0] * QK_K, [f32(0)] * 16
    amax, max_scale = f32(0), f32(0)
    for j in range(16):
        scales[j], L[16 * j : 16 * j + 16] = make_q3_quants(16, 4, x[16 * j : 16 * j + 16])
        if abs(scales[j]) > amax:
            amax, max_scale = abs(scales[j]), scales[j]
    sc = [0] * 12
    if max_scale:
        iscale = f32(f32(-32) / max_scale)
        for j in range(16):
            lv = max(-32, min(31, nearest_int(f32(iscale * scales[j])))) + 32
            if j < 8:
                sc[j] = lv & 0xF
            else:
                sc[j - 8] |= (lv & 0xF) << 4
            sc[j % 4 + 8] |= (lv >> 4) << (2 * (j // 4))
        d_b, d = fp16(f32(f32(1) / iscale))
    else:
        d_b, d = fp16(0)
    for j in range(16):
        s = (sc[j] & 0xF) if j < 8 else (sc[j - 8] >> 4)
        s = (s | (((sc[8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
        dj = f32(d * s)
        if not dj:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-4, min(3, nearest_int(f32(x[16 * j + ii] / dj)))) + 4
    hmask = [0] * 32
    for j in range(QK_K):
        if L[j] > 3:
            hmask[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    return bytes(hmask) + _crumbs(L) + bytes(sc) + d_b


def _qk_asym(x, nmax, rmin, nstep):
    L, scales, mins = [0] * QK_K, [f32(0)] * 8, [f32(0)] * 8
    max_scale = max_min = f32(0)
    for j in range(8):
        sub = x[32 * j : 32 * j + 32]
        sum_x2 = f32(0)
        for v in sub:
            sum_x2 = f32(sum_x2 + f32(v * v))
        av_x = np.sqrt(f32(sum_x2 / f32(32)))
        weights = [f32(av_x + abs(v)) for v in sub]
        scales[j], mins[j], L[32 * j : 32 * j + 32] = make_qkx2_quants(32, nmax, sub, weights, rmin, 0.1, nstep, False)
        max_scale, max_min = max(max_scale, scales[j]), max(max_min, mins[j])
    inv_scale = f32(f32(63) / max_scale) if max_scale > 0 else f32(0)
    inv_min = f32(f32(63) / max_min) if max_min > 0 else f32(0)
    sc = [0] * 12
    ls = [min(63, nearest_int(f32(inv_scale * s)) & 0xFF) for s in scales]
    lm = [min(63, nearest_int(f32(inv_min * m)) & 0xFF) for m in mins]
    for j in range(8):
        if j < 4:
            sc[j], sc[j + 4] = ls[j], lm[j]
        else:
            sc[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            sc[j - 4] |= (ls[j] >> 4) << 6
            sc[j] |= (lm[j] >> 4) << 6
    d_b, d = fp16(f32(max_scale / f32(63)))
    m_b, dmin = fp16(f32(max_min / f32(63)))
    for j in range(8):
        dj = f32(d * ls[j])
        if not dj:
            continue
        dm = f32(dmin * lm[j])
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int(f32(f32(x[32 * j + ii] + dm) / dj))))
    return d_b + m_b + bytes(sc), L


def q4_k_block(x) -> bytes:
    head, L = _qk_asym(x, 15, -1.0, 20)
    return head + bytes(L[j + i] | (L[j + i + 32] << 4) for j in range(0, QK_K, 64) for i in range(32))


def q5_k_block(x) -> bytes:
    head, L = _qk_asym(x, 31, -0.5, 15)
    qh, ql = [0] * 32, []
    m1, m2 = 1, 2
    for n in range(0, QK_K, 64):
        for j in range(32):
            l1, l2 = L[n + j], L[n + j + 32]
            if l1 > 15:
                l1 -= 16
                qh[j] |= m1
            if l2 > 15:
                l2 -= 16
                qh[j] |= m2
            ql.append(l1 | (l2 << 4))
        m1, m2 = m1 << 2, m2 << 2
    return head + bytes(qh) + bytes(ql)


def q6_k_block(x) -> bytes:
    L, scales = [0] * QK_K, [f32(0)] * 16
    max_scale = max_abs = f32(0)
    for ib in range(16):
        scales[ib], L[16 * ib : 16 * ib + 16] = make_qx_quants(16, 32, x[16 * ib : 16 * ib + 16])
        if abs(scales[ib]) > max_abs:
            max_abs, max_scale = abs(scales[ib]), scales[ib]
    if max_abs < EPS:
        return bytes(210)
    iscale = f32(f32(-128) / max_scale)
    d_b, d = fp16(f32(f32(1) / iscale))
    sc = [min(127, nearest_int(f32(iscale * s))) for s in scales]
    for j in range(16):
        dj = f32(d * sc[j])
        if not dj:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-32, min(31, nearest_int(f32(x[16 * j + ii] / dj)))) + 32
    ql, qh = [0] * 128, [0] * 64
    for h, j in enumerate((0, 128)):
        for i in range(32):
            q1, q2, q3, q4 = (L[j + i + 32 * k] & 0xF for k in range(4))
            ql[64 * h + i] = q1 | (q3 << 4)
            ql[64 * h + i + 32] = q2 | (q4 << 4)
            qh[32 * h + i] = (
                (L[j + i] >> 4)
                | ((L[j + i + 32] >> 4) << 2)
                | ((L[j + i + 64] >> 4) << 4)
                | ((L[j + i + 96] >> 4) << 6)
            )
    return bytes(ql) + bytes(qh) + np.array(sc, dtype=np.int8).tobytes() + d_b


BLOCK_QUANTIZERS = {"Q2_K": q2_k_block, "Q3_K": q3_k_block, "Q4_K": q4_k_block, "Q5_K": q5_k_block, "Q6_K": q6_k_block}


def quantize_rows(values: np.ndarray, type_name: str) -> np.ndarray:
    """``[rows, k]`` float32 -> ``[rows, bytes]`` uint8, one super-block at a time."""
    quantize_block = BLOCK_QUANTIZERS[type_name]
    blocks = values.astype(np.float32).reshape(-1, QK_K)
    raw = b"".join(quantize_block([f32(v) for v in block]) for block in blocks)
    return np.frombuffer(raw, dtype=np.uint8).reshape(values.shape[0], -1)
