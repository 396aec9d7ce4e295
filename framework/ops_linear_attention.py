"""Torch reference ops of gated-delta-rule linear attention (Qwen3-Next / Qwen3.5 GDN layers).

A GDN layer keeps, per sequence, a short-convolution state ``[conv_dim, kernel - 1]`` (the last
inputs of its depthwise causal conv) and a recurrent state ``S`` ``[num_v_heads, k_dim, v_dim]``
(float32). One token ``t`` of one value head updates and reads ``S``::

    S <- exp(g_t) * S                        decay (g_t <= 0, log space)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T  the delta rule: write the part of v_t S does not predict
    o_t = S^T q_t                            (q and k L2-normalised, q scaled by k_dim ** -0.5)

:func:`recurrent_gated_delta_rule` runs that loop; :func:`chunk_gated_delta_rule` computes the
same in chunks of ``chunk_size`` tokens with matmuls (the WY form: within a chunk the corrected
values ``u`` solve one unit-lower-triangular system, then the chunk's outputs and its end state
are two products). The registry ops :func:`causal_conv1d` and :func:`gated_delta_rule` take a
whole step's packed tokens and update the per-sequence states in place, at the rows the step's
:class:`StateIndices` name; a sequence whose ``has_initial_state`` is false starts from zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the normalisation fla and transformers apply)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q: Tensor, k: Tensor, num_v_heads: int, use_qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    """q and k in float32, one head per value head (each key head serves consecutive value heads),
    normalised as the layer asks; q scaled by ``k_dim ** -0.5``."""
    groups = num_v_heads // q.shape[-2]
    q, k = q.float(), k.float()
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """One sequence token by token: ``q, k`` ``[L, Hk, Dk]``, ``v`` ``[L, Hv, Dv]``, ``g, beta``
    ``[L, Hv]``, ``initial_state`` ``[Hv, Dk, Dv]`` (None: zeros). Returns ``(o [L, Hv, Dv]`` in
    ``v.dtype``, the final state float32)."""
    q, k = _prepare(q, k, v.shape[-2], use_qk_l2norm)
    values, g, beta = v.float(), g.float(), beta.float()
    num_heads, dk, dv = v.shape[-2], q.shape[-1], v.shape[-1]
    state = torch.zeros(num_heads, dk, dv, device=v.device) if initial_state is None else initial_state.float()
    out = torch.empty_like(values)
    for t in range(v.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        update = (values[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * update[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out.to(v.dtype), state


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """:func:`recurrent_gated_delta_rule`'s result, chunk by chunk.

    In a chunk of ``C`` tokens starting from state ``S0``, with ``G = cumsum(g)`` inside the chunk
    and ``D[t, s] = exp(G_t - G_s)`` for ``s <= t`` (0 above; every entry <= 1, so nothing overflows)::

        (I + A) U = beta*V - (beta*exp(G)*K) S0     A[t, s] = beta_t D[t, s] (k_t . k_s), s < t
        O  = (exp(G)*Q) S0 + ((Q K^T) o D) U
        S  = exp(G_C) S0 + (exp(G_C - G)*K)^T U
    """
    q, k = _prepare(q, k, v.shape[-2], use_qk_l2norm)
    # heads first: [H, L, D] and [H, L]
    q, k, values = q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1)
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)
    num_heads, length, dk, dv = values.shape[0], values.shape[1], q.shape[-1], values.shape[-1]
    state = torch.zeros(num_heads, dk, dv, device=v.device) if initial_state is None else initial_state.float()
    out = torch.empty_like(values)
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], values[:, start:end], beta[:, start:end, None]
        cum = g[:, start:end].cumsum(-1)  # [H, C]
        size = end - start
        causal = torch.ones(size, size, dtype=torch.bool, device=v.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # D [H, C, C]
        system = ((bc * kc @ kc.transpose(-1, -2)) * decay).tril(-1) + torch.eye(size, device=v.device)  # I + A
        rhs = torch.cat([bc * vc, bc * cum.exp()[..., None] * kc], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u = solved[..., :dv] - solved[..., dv:] @ state
        out[:, start:end] = (cum.exp()[..., None] * qc) @ state + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        tail = (cum[:, -1:] - cum).exp()[..., None]  # exp(G_C - G_s)
        state = cum[:, -1].exp()[:, None, None] * state + (tail * kc).transpose(-1, -2) @ u
    return out.transpose(0, 1).to(v.dtype), state


class StateIndices(NamedTuple):
    """Where a step's sequences keep their states, for the varlen ops (built once per step).

    Host: ``cu_seqlens`` ``[R + 1]`` (sequence ``r`` is tokens ``cu_seqlens[r]:cu_seqlens[r + 1]``),
    each sequence's ``state_slots`` row and ``has_initial_state`` (false: it starts from zeros).
    Device (int64), for the one-token sequences (decodes) only, in batch order: their token
    ``decode_rows``, ``decode_slots`` and ``decode_has_initial_state`` (0 or 1), so a decode step
    runs without host lists. ``longer`` lists the other sequences' indices ``r``; ``longer_table``
    ``[len(longer), 4]`` (device, int64) holds their ``(start, end, slot, has_initial_state)``.
    """

    cu_seqlens: list[int]
    state_slots: list[int]
    has_initial_state: list[bool]
    decode_rows: Tensor
    decode_slots: Tensor
    decode_has_initial_state: Tensor
    longer: list[int]
    longer_table: Tensor

    @classmethod
    def build(
        cls, cu_seqlens: list[int], state_slots: list[int], has_initial_state: list[bool], device: torch.device
    ) -> StateIndices:
        """The indices of a step, the decode ones crossing to ``device`` in one pinned copy that does
        not make the host wait (a step launched while the previous one runs keeps its overlap)."""
        singles = [r for r in range(len(state_slots)) if cu_seqlens[r + 1] - cu_seqlens[r] == 1]
        longer = [r for r in range(len(state_slots)) if cu_seqlens[r + 1] - cu_seqlens[r] != 1]
        flat = [cu_seqlens[r] for r in singles] + [state_slots[r] for r in singles]
        flat += [int(has_initial_state[r]) for r in singles]
        for r in longer:
            flat += [cu_seqlens[r], cu_seqlens[r + 1], state_slots[r], int(has_initial_state[r])]
        decode = torch.tensor(flat, dtype=torch.int64)
        if device.type == "cuda":
            decode = decode.pin_memory().to(device, non_blocking=True)
        n = len(singles)
        return cls(
            list(cu_seqlens), list(state_slots), list(has_initial_state),
            decode[:n], decode[n : 2 * n], decode[2 * n : 3 * n], longer, decode[3 * n :].view(-1, 4),
        )  # fmt: skip

    def without_decodes(self) -> StateIndices:
        """The same step with its one-token sequences left out (an implementation that runs them itself)."""
        empty = self.decode_rows[:0]
        return self._replace(decode_rows=empty, decode_slots=empty, decode_has_initial_state=empty)

    def max_longer_len(self) -> int:
        """Tokens of the longest sequence in ``longer`` (0 if none)."""
        return max((self.cu_seqlens[r + 1] - self.cu_seqlens[r] for r in self.longer), default=0)

    def sequence(self, r: int) -> tuple[slice, int, bool]:
        """``(token rows, state slot, has_initial_state)`` of sequence ``r``."""
        return slice(self.cu_seqlens[r], self.cu_seqlens[r + 1]), self.state_slots[r], self.has_initial_state[r]


def causal_conv1d(
    x: Tensor, weight: Tensor, conv_states: Tensor, indices: StateIndices, bias: Tensor | None = None
) -> Tensor:
    """Depthwise causal conv then SiLU over a step's packed tokens, carrying each sequence's state.

    ``x`` ``[T, D]``; ``weight`` ``[D, K]``; ``conv_states`` ``[num_slots, D, K - 1]`` (updated in
    place: each sequence's row ends holding its last ``K - 1`` inputs, zeros before its first).
    Returns ``[T, D]`` in ``x.dtype``.
    """
    width = weight.shape[1] - 1
    out = torch.empty_like(x)
    if indices.decode_rows.numel():  # one token each: the window is the state and the token
        rows, slots = indices.decode_rows, indices.decode_slots
        keep = indices.decode_has_initial_state.bool()[:, None, None]
        window = torch.cat([torch.where(keep, conv_states[slots], 0).to(x.dtype), x[rows][:, :, None]], dim=-1)
        conv = (window.to(weight.dtype) * weight).sum(-1) + (0 if bias is None else bias)
        out[rows] = F.silu(conv).to(x.dtype)
        conv_states[slots] = window[:, :, 1:].to(conv_states.dtype)
    for r in indices.longer:
        rows, slot, resume = indices.sequence(r)
        previous = conv_states[slot] if resume else torch.zeros_like(conv_states[slot])
        window = torch.cat([previous.to(x.dtype), x[rows].transpose(0, 1)], dim=-1)  # [D, K - 1 + n]
        conv = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0])[0]
        out[rows] = F.silu(conv).transpose(0, 1).to(x.dtype)
        conv_states[slot] = window[:, window.shape[1] - width :].to(conv_states.dtype)
    return out


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    indices: StateIndices,
    use_qk_l2norm: bool = True,
) -> Tensor:
    """The gated delta rule over a step's packed sequences, each from and into its state row.

    ``q, k`` ``[T, Hk, Dk]``, ``v`` ``[T, Hv, Dv]``, ``g, beta`` ``[T, Hv]``; ``states``
    ``[num_slots, Hv, Dk, Dv]`` float32, updated in place. One-token sequences (decode) run
    together as one recurrent step; longer ones (prefill chunks) run :func:`chunk_gated_delta_rule`.
    Returns ``o`` ``[T, Hv, Dv]`` in ``v.dtype``.
    """
    out = torch.empty_like(v)
    if indices.decode_rows.numel():
        rows, slots = indices.decode_rows, indices.decode_slots
        keep = indices.decode_has_initial_state.bool()[:, None, None, None]
        qs, ks = _prepare(q[rows], k[rows], v.shape[-2], use_qk_l2norm)
        state = torch.where(keep, states[slots], 0.0) * g[rows].float().exp()[..., None, None]
        update = (v[rows].float() - torch.einsum("bhkv,bhk->bhv", state, ks)) * beta[rows].float()[..., None]
        state = state + ks[..., None] * update[..., None, :]
        out[rows] = torch.einsum("bhkv,bhk->bhv", state, qs).to(v.dtype)
        states[slots] = state
    for r in indices.longer:
        rows, slot, resume = indices.sequence(r)
        out[rows], states[slot] = chunk_gated_delta_rule(
            q[rows], k[rows], v[rows], g[rows], beta[rows], states[slot] if resume else None, use_qk_l2norm
        )
    return out


def gdn_gating(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:  # noqa: N803
    """A GDN layer's per-token gates from its projections ``a``, ``b`` ``[T, Hv]`` and its per-head
    ``A_log``, ``dt_bias`` ``[Hv]`` (float32): ``(g, beta)`` for :func:`gated_delta_rule`, with
    ``g = -exp(A_log) * softplus(a + dt_bias)`` in float32 (the decay in log space, <= 0) and
    ``beta = sigmoid(b)`` in ``b.dtype``, exactly as transformers computes them."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float()), b.sigmoid()
