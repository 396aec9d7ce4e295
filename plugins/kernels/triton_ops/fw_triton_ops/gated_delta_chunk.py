"""Chunked (WY form) Triton prefill of the gated delta rule over a step's varlen sequences.

The math is :func:`framework.ops_linear_attention.chunk_gated_delta_rule`'s: each sequence is cut
into chunks of ``CHUNK`` tokens from its first token in the step; inside a chunk, with
``G = cumsum(g)`` and ``D[t, s] = exp(G_t - G_s)`` (``s <= t``), ``A[t, s] = beta_t D[t, s] k_t . k_s``
(``s < t``) and ``T = (I + A)^-1``::

    W = T (beta exp(G) K)     U = T (beta V)              (independent of the state: kernel 1)
    u = U - W S0                                          (the chunk's corrected values)
    O = (exp(G) Q) S0 + ((Q K^T) o D) u
    S = exp(G_C) S0 + (exp(G_C - G) K)^T u                (in chunk order: kernel 2)

Two launches::

    _chunk_prepare_kernel   program (sequence, chunk, value head): G, the triangular inverse T by
                            forward substitution on its 64 x 64 tile, then W, U and the masked
                            ``(Q K^T) o D`` rows, stored at the chunk's token rows (float32 scratch)
    _chunk_state_kernel     program (sequence, value head, block of v_dim): the state in registers
                            from its slot (zeros for a new sequence), chunk after chunk: u, the
                            outputs, the next state; the last one written back to the slot

Every program reads its sequence's ``(start, end, slot, has_initial_state)`` from the step's
``longer_table``; a chunk index past a sequence's end exits at once (the grid spans the longest).
q and k are L2-normalised in float32 inside both kernels (as they are loaded). Matmuls of float32
inputs run in IEEE float32; of 16-bit inputs in TF32 with float32 accumulation (IEEE float32 on
GPUs before Ampere, which have no TF32).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

#: tokens per chunk (fla's and transformers' choice: the tile of the triangular solve)
CHUNK = 64


@functools.cache
def _has_tf32(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


@triton.jit
def _load_qk(ptr, rows, row_mask, stride, key_head, dk, k_mask, K_DIM: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """Rows ``rows`` of one key head as float32 ``[CHUNK, BLOCK_K]`` (zeros where masked), normalised."""
    x = tl.load(
        ptr + rows[:, None] * stride + key_head * K_DIM + dk[None, :],
        mask=row_mask[:, None] & k_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    if USE_QK_L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _chunk_prepare_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    table_ptr,
    gcum_ptr,
    w_ptr,
    u_ptr,
    aqk_ptr,
    stride_q,
    stride_k,
    stride_v,
    stride_gb,
    scale,
    HEADS_PER_KEY: tl.constexpr,
    NUM_V_HEADS: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    entry = table_ptr + tl.program_id(0).to(tl.int64) * 4  # (start, end, slot, has_initial_state)
    start, end = tl.load(entry), tl.load(entry + 1)
    first = start + tl.program_id(1) * CHUNK
    if first >= end:
        return
    head = tl.program_id(2)
    key_head = head // HEADS_PER_KEY
    t = tl.arange(0, CHUNK)
    rows = first + t
    t_mask = rows < end
    dk = tl.arange(0, BLOCK_K)
    k_mask = dk < K_DIM
    k = _load_qk(k_ptr, rows, t_mask, stride_k, key_head, dk, k_mask, K_DIM, USE_QK_L2NORM)
    q = _load_qk(q_ptr, rows, t_mask, stride_q, key_head, dk, k_mask, K_DIM, USE_QK_L2NORM) * scale
    g = tl.load(g_ptr + rows * stride_gb + head, mask=t_mask, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_gb + head, mask=t_mask, other=0.0).to(tl.float32)
    gcum = tl.cumsum(g, axis=0)
    causal = t[:, None] >= t[None, :]
    decay = tl.exp(tl.where(causal, gcum[:, None] - gcum[None, :], float("-inf")))  # D, every entry <= 1
    kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)
    a = tl.where(t[:, None] > t[None, :], kk * decay * beta[:, None], 0.0)  # padded rows and columns are 0
    # (I + A)^-1 row by row: inv[i] = e_i - sum_{j < i} A[i, j] inv[j]; rows j >= i are still e_j,
    # where A[i, j] = 0, so each step may sum over the whole tile; rows past the chunk's last token
    # (A = 0 there) stay e_i
    inv = tl.where(t[:, None] == t[None, :], 1.0, 0.0)
    for i in range(1, tl.minimum(end - first, CHUNK)):
        a_row = tl.sum(tl.where(t[:, None] == i, a, 0.0), axis=0)
        row = tl.where(t == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inv, axis=0)
        inv = tl.where(t[:, None] == i, row[None, :], inv)
    w = tl.dot(inv, k * (beta * tl.exp(gcum))[:, None], input_precision=DOT_PRECISION)
    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < V_DIM
    v = tl.load(
        v_ptr + rows[:, None] * stride_v + head * V_DIM + dv[None, :],
        mask=t_mask[:, None] & dv_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    u = tl.dot(inv, v * beta[:, None], input_precision=DOT_PRECISION)
    aqk = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay, 0.0)
    # scratch rows: gcum [T, Hv], w [T, Hv, Dk], u [T, Hv, Dv], aqk [T, Hv, CHUNK], contiguous
    head_rows = rows * NUM_V_HEADS + head
    tl.store(gcum_ptr + head_rows, gcum, mask=t_mask)
    tl.store(w_ptr + head_rows[:, None] * K_DIM + dk[None, :], w, mask=t_mask[:, None] & k_mask[None, :])
    tl.store(u_ptr + head_rows[:, None] * V_DIM + dv[None, :], u, mask=t_mask[:, None] & dv_mask[None, :])
    tl.store(aqk_ptr + head_rows[:, None] * CHUNK + t[None, :], aqk, mask=t_mask[:, None])


@triton.jit
def _chunk_state_kernel(
    q_ptr,
    k_ptr,
    gcum_ptr,
    w_ptr,
    u_ptr,
    aqk_ptr,
    states_ptr,
    out_ptr,
    table_ptr,
    stride_q,
    stride_k,
    stride_o,
    scale,
    HEADS_PER_KEY: tl.constexpr,
    NUM_V_HEADS: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    entry = table_ptr + tl.program_id(0).to(tl.int64) * 4
    start, end, slot, resume = tl.load(entry), tl.load(entry + 1), tl.load(entry + 2), tl.load(entry + 3)
    head = tl.program_id(1)
    key_head = head // HEADS_PER_KEY
    t = tl.arange(0, CHUNK)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = dk < K_DIM, dv < V_DIM
    # states [num_slots, Hv, Dk, Dv] float32, contiguous
    state_ptrs = states_ptr + ((slot * NUM_V_HEADS + head) * K_DIM + dk[:, None]) * V_DIM + dv[None, :]
    state_mask = k_mask[:, None] & v_mask[None, :]
    # a sequence starting here ignores its row (whatever the slot's last holder left there)
    state = tl.where(resume != 0, tl.load(state_ptrs, mask=state_mask, other=0.0), 0.0)
    for first in range(start, end, CHUNK):
        rows = first + t
        t_mask = rows < end
        head_rows = rows * NUM_V_HEADS + head
        k = _load_qk(k_ptr, rows, t_mask, stride_k, key_head, dk, k_mask, K_DIM, USE_QK_L2NORM)
        q = _load_qk(q_ptr, rows, t_mask, stride_q, key_head, dk, k_mask, K_DIM, USE_QK_L2NORM) * scale
        gcum = tl.load(gcum_ptr + head_rows, mask=t_mask, other=0.0)
        w = tl.load(w_ptr + head_rows[:, None] * K_DIM + dk[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        u = tl.load(u_ptr + head_rows[:, None] * V_DIM + dv[None, :], mask=t_mask[:, None] & v_mask[None, :], other=0.0)
        aqk = tl.load(aqk_ptr + head_rows[:, None] * CHUNK + t[None, :], mask=t_mask[:, None], other=0.0)
        u = u - tl.dot(w, state, input_precision=DOT_PRECISION)
        out = tl.dot(q * tl.exp(gcum)[:, None], state, input_precision=DOT_PRECISION)
        out += tl.dot(aqk, u, input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + rows[:, None] * stride_o + head * V_DIM + dv[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & v_mask[None, :])
        last = tl.minimum(first + CHUNK, end) - 1
        g_last = tl.load(gcum_ptr + last * NUM_V_HEADS + head)
        tail = tl.where(t_mask, tl.exp(g_last - gcum), 0.0)  # exp(G_C - G_s)
        state = state * tl.exp(g_last) + tl.dot(tl.trans(k * tail[:, None]), u, input_precision=DOT_PRECISION)
    tl.store(state_ptrs, state, mask=state_mask)


def chunked_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    table: Tensor,
    max_len: int,
    out: Tensor,
    use_qk_l2norm: bool = True,
) -> None:
    """The sequences of ``table`` (``[R, 4]`` int64 rows ``(start, end, slot, has_initial_state)``,
    the longest ``max_len`` tokens) in chunks: their outputs into ``out`` ``[T, Hv, Dv]``, their
    final states into ``states`` ``[num_slots, Hv, Dk, Dv]`` float32. ``q, k`` ``[T, Hk, Dk]``,
    ``v`` ``[T, Hv, Dv]``, ``g, beta`` ``[T, Hv]``, each with unit stride inside a token row;
    other rows of ``out`` and ``states`` are left alone."""
    num_tokens, num_v, v_dim = v.shape
    k_dim = q.shape[2]
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        assert x.stride(-1) == 1 and (x.dim() == 2 or x.stride(-2) == x.shape[-1]), f"{name} rows must be dense"
    assert states.is_contiguous() and states.dtype == torch.float32
    scratch = dict(device=v.device, dtype=torch.float32)
    gcum = torch.empty(num_tokens, num_v, **scratch)
    w = torch.empty(num_tokens, num_v, k_dim, **scratch)
    u = torch.empty(num_tokens, num_v, v_dim, **scratch)
    aqk = torch.empty(num_tokens, num_v, CHUNK, **scratch)
    shared = dict(
        HEADS_PER_KEY=num_v // q.shape[1], NUM_V_HEADS=num_v, K_DIM=k_dim, V_DIM=v_dim, CHUNK=CHUNK,
        BLOCK_K=max(16, triton.next_power_of_2(k_dim)), USE_QK_L2NORM=use_qk_l2norm,
        DOT_PRECISION="tf32" if v.dtype != torch.float32 and _has_tf32(v.device) else "ieee", num_warps=4,
    )  # fmt: skip
    scale = k_dim**-0.5
    num_seqs = table.shape[0]
    _chunk_prepare_kernel[(num_seqs, triton.cdiv(max_len, CHUNK), num_v)](
        q, k, v, g, beta, table, gcum, w, u, aqk,
        q.stride(0), k.stride(0), v.stride(0), g.stride(0), scale,
        BLOCK_DV=max(16, triton.next_power_of_2(v_dim)), **shared,
    )  # fmt: skip
    block_v = min(32, max(16, triton.next_power_of_2(v_dim)))
    # two stages of the chunk loop's loads: Triton's default three need 287 KB of shared memory at
    # 128 x 128 states with 16-byte aligned rows (an H200 SM has 227 KB); two need 197 KB
    _chunk_state_kernel[(num_seqs, num_v, triton.cdiv(v_dim, block_v))](
        q, k, gcum, w, u, aqk, states, out, table,
        q.stride(0), k.stride(0), out.stride(0), scale,
        BLOCK_V=block_v, num_stages=2, **shared,
    )  # fmt: skip
