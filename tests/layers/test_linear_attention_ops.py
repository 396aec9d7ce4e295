"""The gated-delta-net reference ops (framework.ops_linear_attention) against transformers' own
torch implementations (``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
``causal_conv1d_fn``), and the varlen ops' state handling against running each sequence alone."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from framework import ops_linear_attention as ops

HK, HV, DK, DV = 2, 4, 16, 8  # two value heads per key head (grouped, as the real models)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _inputs(length: int):
    """q, k [L, Hk, Dk], v [L, Hv, Dv], g (log decay, <= 0) and beta [L, Hv]."""
    q, k = torch.randn(length, HK, DK), torch.randn(length, HK, DK)
    v = torch.randn(length, HV, DV)
    g, beta = -2 * torch.rand(length, HV), torch.rand(length, HV)
    return q, k, v, g, beta


def _transformers(fn, q, k, v, g, beta, state, **kwargs):
    out, final = fn(
        q[None], k[None], v[None], g[None], beta[None], initial_state=None if state is None else state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs,
    )  # fmt: skip
    return out[0], final[0]


@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_rule_matches_transformers_across_chunk_boundaries(with_state):
    q, k, v, g, beta = _inputs(37)  # chunks of 16, 16 and 5
    state = torch.randn(HV, DK, DV) if with_state else None
    out, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    ref_out, ref_final = _transformers(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, state, chunk_size=16)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)


def test_recurrent_rule_matches_transformers_and_the_chunked_rule():
    q, k, v, g, beta = _inputs(9)
    state = torch.randn(HV, DK, DV)
    out, final = ops.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    ref_out, ref_final = _transformers(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)
    chunked_out, chunked_final = ops.chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=4)
    torch.testing.assert_close(chunked_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked_final, final, rtol=1e-5, atol=1e-5)


def test_varlen_rule_reads_and_writes_each_sequence_state_slot():
    """One step of four sequences: a fresh one-token prompt, a decode, a resumed prefill chunk and a
    fresh prefill; each equals the sequence run alone from its state; unused slots stay untouched."""
    lengths, slots, resumes = [1, 1, 6, 5], [3, 0, 4, 1], [False, True, True, False]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = _inputs(cu[-1])
    states = torch.randn(6, HV, DK, DV)
    before = states.clone()
    indices = ops.StateIndices.build(cu, slots, resumes, torch.device("cpu"))
    assert indices.decode_rows.tolist() == [0, 1] and indices.longer == [2, 3]
    out = ops.gated_delta_rule(q, k, v, g, beta, states, indices)
    for r, (slot, resume) in enumerate(zip(slots, resumes)):
        piece = slice(cu[r], cu[r + 1])
        initial = before[slot] if resume else None
        ref_out, ref_final = _transformers(
            hf.torch_recurrent_gated_delta_rule, q[piece], k[piece], v[piece], g[piece], beta[piece], initial
        )
        torch.testing.assert_close(out[piece], ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[slot], ref_final, rtol=1e-5, atol=1e-5)
    for untouched in (2, 5):
        assert torch.equal(states[untouched], before[untouched])


@pytest.mark.parametrize("split", [1, 2, 7])  # a chunk shorter than the conv's kernel - 1, and longer
def test_causal_conv1d_carries_its_state_across_chunks(split):
    """A 10-token sequence in two calls (``split`` tokens, then the rest) gives transformers' one-pass
    ``causal_conv1d_fn`` (SiLU), and the state ends holding the last ``kernel - 1`` inputs."""
    channels, kernel = 12, 4
    x, weight = torch.randn(10, channels), torch.randn(channels, kernel)
    states = torch.randn(3, channels, kernel - 1)  # stale rows: a fresh sequence must not read them
    cpu = torch.device("cpu")
    first = ops.causal_conv1d(x[:split], weight, states, ops.StateIndices.build([0, split], [2], [False], cpu))
    second = ops.causal_conv1d(x[split:], weight, states, ops.StateIndices.build([0, 10 - split], [2], [True], cpu))
    expected = hf.causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    torch.testing.assert_close(torch.cat([first, second]), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(states[2], x[-(kernel - 1) :].T)


def test_causal_conv1d_of_a_batch_of_decodes_matches_transformers_update():
    channels, kernel = 12, 4
    x, weight = torch.randn(3, channels), torch.randn(channels, kernel)
    states = torch.randn(5, channels, kernel - 1)
    hf_states = states[[4, 0, 2]].clone()
    indices = ops.StateIndices.build([0, 1, 2, 3], [4, 0, 2], [True, True, True], torch.device("cpu"))
    out = ops.causal_conv1d(x, weight, states, indices)
    expected = hf.causal_conv1d_update(x[:, :, None], hf_states, weight, None, activation="silu")[:, :, 0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[[4, 0, 2]], hf_states)
