"""The torch reference ops (framework.ops) against transformers' modules and hand references."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from framework import ops

HIDDEN = 96


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _randomised(norm: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    with torch.no_grad():
        norm.weight.copy_(torch.randn(HIDDEN) * 0.5 + 0.2)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama_rmsnorm_bitwise(dtype):
    norm = _randomised(LlamaRMSNorm(HIDDEN, eps=1e-5), dtype)
    x = (torch.randn(7, HIDDEN) * 3).to(dtype)
    out = ops.rms_norm(x, norm.weight, 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, norm(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_offset_matches_gemma3_rmsnorm_bitwise(dtype):
    norm = _randomised(Gemma3RMSNorm(HIDDEN, eps=1e-6), dtype)
    x = (torch.randn(2, 5, HIDDEN) * 3).to(dtype)
    out = ops.rms_norm(x, norm.weight, 1e-6, offset=1.0)
    assert out.dtype == dtype
    torch.testing.assert_close(out, norm(x), rtol=0, atol=0)


def test_gemma_and_llama_rounding_orders_differ_in_bf16():
    # Gemma scales in float32 before rounding; feeding Llama's order (1 + w) gives other bf16 values.
    weight = torch.randn(HIDDEN).to(torch.bfloat16)
    x = torch.randn(64, HIDDEN).to(torch.bfloat16)
    gemma = ops.rms_norm(x, weight, 1e-6, offset=1.0)
    llama_order = ops.rms_norm(x, (1.0 + weight.float()).to(torch.bfloat16), 1e-6)
    assert not torch.equal(gemma, llama_order)


@pytest.mark.parametrize("offset, norm_cls", [(0.0, LlamaRMSNorm), (1.0, Gemma3RMSNorm)])
def test_fused_add_rms_norm_adds_residual_then_normalises(offset, norm_cls):
    norm = _randomised(norm_cls(HIDDEN, eps=1e-6), torch.bfloat16)
    x, residual = torch.randn(2, 4, HIDDEN).to(torch.bfloat16), torch.randn(2, 4, HIDDEN).to(torch.bfloat16)
    out, new_residual = ops.fused_add_rms_norm(x, residual, norm.weight, 1e-6, offset)
    expected_residual = residual + x  # what the HF decoder layer does
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, norm(expected_residual), rtol=0, atol=0)


@pytest.mark.parametrize("op, act", [(ops.silu_and_mul, "silu"), (ops.gelu_tanh_and_mul, "gelu_pytorch_tanh")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activations_match_hf_mlp(op, act, dtype):
    gate, up = torch.randn(3, 5, 40).to(dtype), torch.randn(3, 5, 40).to(dtype)
    out = op(torch.cat([gate, up], dim=-1))
    # float32 may differ in the last bit: vectorised math over a strided slice vs a contiguous tensor
    torch.testing.assert_close(out, ACT2FN[act](gate) * up)


def _cos_sin_cache(inv_freq: torch.Tensor, num_positions: int) -> torch.Tensor:
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _hf_rotate(positions, q, k, head_size, inv_freq, dtype):
    """transformers' LlamaRotaryEmbedding.forward + apply_rotary_pos_emb on [T, heads, rotary_dim]."""
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rotary_neox_matches_hf_apply_rotary_pos_emb(dtype, tol):
    num_heads, num_kv_heads, head_size = 4, 2, 32
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2).float() / head_size))
    positions = torch.randint(0, 200, (9,))
    q = torch.randn(9, num_heads, head_size).to(dtype)
    k = torch.randn(9, num_kv_heads, head_size).to(dtype)
    out_q, out_k = ops.rotary_embedding(
        positions, q.flatten(1), k.flatten(1), head_size, _cos_sin_cache(inv_freq, 200), True
    )
    ref_q, ref_k = _hf_rotate(positions, q, k, head_size, inv_freq, dtype)
    assert out_q.shape == (9, num_heads * head_size) and out_q.dtype == dtype
    torch.testing.assert_close(out_q.view_as(q), ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(out_k.view_as(k), ref_k, rtol=tol, atol=tol)


def test_partial_rotary_rotates_only_the_first_rotary_dim_features():
    # StableLM / Phi: apply_rotary_pos_emb to q[..., :rotary_dim], pass the rest through.
    head_size, rotary_dim = 64, 16
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    positions = torch.randint(0, 50, (6,))
    q, k = torch.randn(6, 3, head_size), torch.randn(6, 1, head_size)
    out_q, out_k = ops.rotary_embedding(
        positions, q.flatten(1), k.flatten(1), head_size, _cos_sin_cache(inv_freq, 50), True
    )
    ref_q_rot, ref_k_rot = _hf_rotate(
        positions, q[..., :rotary_dim], k[..., :rotary_dim], head_size, inv_freq, torch.float32
    )
    torch.testing.assert_close(out_q.view_as(q), torch.cat([ref_q_rot, q[..., rotary_dim:]], -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_k.view_as(k), torch.cat([ref_k_rot, k[..., rotary_dim:]], -1), rtol=1e-6, atol=1e-6)
    assert torch.equal(out_q.view_as(q)[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("rotary_dim", [32, 24])
def test_rotary_gptj_style_rotates_neighbouring_pairs_as_complex_numbers(rotary_dim):
    # Reference: Meta's original Llama code, pairs (x[2i], x[2i+1]) times e^(i * pos * inv_freq[i]).
    head_size = 32
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    positions = torch.randint(0, 100, (2, 5))  # batched positions [B, S]
    q, k = torch.randn(2, 5, 2, head_size), torch.randn(2, 5, 1, head_size)
    out_q, out_k = ops.rotary_embedding(positions, q, k, head_size, _cos_sin_cache(inv_freq, 100), False)

    def reference(x):
        pairs = torch.view_as_complex(x[..., :rotary_dim].reshape(*x.shape[:-1], -1, 2).contiguous())
        angles = positions[..., None, None].float() * inv_freq
        rotated = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)

    torch.testing.assert_close(out_q, reference(q), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, reference(k), rtol=1e-5, atol=1e-5)
