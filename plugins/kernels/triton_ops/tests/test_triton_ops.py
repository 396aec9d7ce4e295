"""The Triton ops against the torch references in ``framework.ops``: interpreted on CPU (fp32), compiled on CUDA."""

from __future__ import annotations

import pytest
import torch
from fw_triton_ops.hooks import OPT_IN_KERNELS, TRITON_KERNELS

from framework import ops, registries
from framework.platform import Platform
from framework.testing import check_no_sync_and_cuda_graph_replay, interpreted, require_triton

#: The ops whose Triton implementation outranks the torch reference (the opt-in ones: tests/test_gemv.py);
#: ops this plugin does not implement (quantized_fused_moe) keep the reference anyway.
DEFAULT_TRITON_OPS = sorted(TRITON_KERNELS)

require_triton()

from fw_triton_ops.activation import gelu_tanh_and_mul, silu_and_mul  # noqa: E402
from fw_triton_ops.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from fw_triton_ops.rotary import qk_norm_rotary_embedding, rotary_embedding  # noqa: E402

#: fp32 on CPU: the kernels do the reference's arithmetic, only the reduction order differs.
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}
#: compiled on CUDA: about two units in the last place of the storage dtype.
GPU_TOL = {
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
    torch.float16: {"rtol": 4e-3, "atol": 4e-3},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
}

NORM_SHAPES = [(1, 64), (7, 576), (3, 5, 640), (4, 1000), (2, 4096)]
ACT_SHAPES = [(1, 2 * 64), (6, 2 * 576), (2, 3, 2 * 640), (3, 2 * 1500)]  # 1500: two column blocks
#: (head_size, rotary_dim, num_heads, num_kv_heads)
ROTARY_SHAPES = [
    (64, 64, 4, 4),
    (128, 128, 8, 2),
    (256, 256, 4, 1),
    (128, 64, 4, 2),
    (128, 96, 2, 2),
    (256, 64, 2, 1),
    (80, 80, 3, 1),
]


def _randn(*shape, seed=0, device="cpu", dtype=torch.float32, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def _norm_inputs(shape, device="cpu", dtype=torch.float32):
    x = _randn(*shape, seed=1, device=device, dtype=dtype, scale=3.0)
    residual = _randn(*shape, seed=2, device=device, dtype=dtype)
    weight = _randn(shape[-1], seed=3, device=device, dtype=dtype, scale=0.5) + 1.0
    return x, residual, weight


def _rotary_inputs(shape, num_tokens=9, device="cpu", dtype=torch.float32, max_position=4096):
    head_size, rotary_dim, num_heads, num_kv_heads = shape
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)
    positions = torch.randint(0, max_position, (num_tokens,), generator=torch.Generator().manual_seed(4)).to(device)
    # query and key as the model hands them over: strided views of the fused QKV projection
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, seed=5, device=device, dtype=dtype)
    query, key, _ = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    return positions, query, key, cache


def _qk_norm_weights(head_size, device="cpu", dtype=torch.float32):
    """Qwen3/Gemma 3 QK-norm weights: one per projection, shared by its heads (and unequal)."""
    return (
        _randn(head_size, seed=6, device=device, dtype=dtype, scale=0.5) + 1.0,
        _randn(head_size, seed=7, device=device, dtype=dtype, scale=0.5) + 1.0,
    )


# --- interpreted on CPU, fp32 ---------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm_matches_reference_fp32(shape, offset):
    x, _, weight = _norm_inputs(shape)
    out = rms_norm(x, weight, 1e-6, offset)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, ops.rms_norm(x, weight, 1e-6, offset), **FP32_TOL)


@interpreted
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_fused_add_rms_norm_returns_normed_sum_and_new_residual_fp32(shape, offset):
    x, residual, weight = _norm_inputs(shape)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5, offset)
    expected_normed, expected_residual = ops.fused_add_rms_norm(x_before, residual_before, weight, 1e-5, offset)
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, expected_normed, **FP32_TOL)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs only read


@interpreted
def test_rms_norm_reads_strided_per_head_views():
    # Gemma's q_norm: per-head norm of a column slice of the fused QKV output
    qkv = _randn(5, 8 * 64 + 2 * 2 * 64, seed=6)
    q = qkv[:, : 8 * 64].unflatten(-1, (8, 64))
    weight = _randn(64, seed=7)
    torch.testing.assert_close(rms_norm(q, weight, 1e-6, 1.0), ops.rms_norm(q, weight, 1e-6, 1.0), **FP32_TOL)


@interpreted
@pytest.mark.parametrize("shape", ACT_SHAPES, ids=str)
@pytest.mark.parametrize(
    "kernel, reference",
    [(silu_and_mul, ops.silu_and_mul), (gelu_tanh_and_mul, ops.gelu_tanh_and_mul)],
    ids=["silu", "gelu_tanh"],
)
def test_gated_activation_matches_reference_fp32(kernel, reference, shape):
    x = _randn(*shape, seed=8, scale=3.0)
    out = kernel(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, reference(x), **FP32_TOL)


@interpreted
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=lambda s: f"head{s[0]}_rot{s[1]}_h{s[2]}_kv{s[3]}")
def test_rotary_embedding_matches_reference_fp32(shape, is_neox_style):
    positions, query, key, cache = _rotary_inputs(shape)
    query_before, key_before = query.clone(), key.clone()
    q_out, k_out = rotary_embedding(positions, query, key, shape[0], cache, is_neox_style)
    q_ref, k_ref = ops.rotary_embedding(positions, query_before, key_before, shape[0], cache, is_neox_style)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    torch.testing.assert_close(q_out, q_ref, **FP32_TOL)
    torch.testing.assert_close(k_out, k_ref, **FP32_TOL)
    assert not torch.equal(q_out, query)  # it did rotate
    if shape[1] < shape[0]:  # partial rotary: the tail of every head passes through unchanged
        tail = (..., slice(shape[1], None))
        assert torch.equal(q_out.unflatten(-1, (-1, shape[0]))[tail], query.unflatten(-1, (-1, shape[0]))[tail])


@interpreted
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
def test_rotary_embedding_takes_batched_positions_and_head_shaped_inputs(is_neox_style):
    head_size = 64
    positions, query, key, cache = _rotary_inputs((head_size, head_size, 4, 2), num_tokens=6)
    positions = positions.view(2, 3)
    query, key = query.reshape(2, 3, 4, head_size), key.reshape(2, 3, 2, head_size)
    for out, ref in zip(
        rotary_embedding(positions, query, key, head_size, cache, is_neox_style),
        ops.rotary_embedding(positions, query, key, head_size, cache, is_neox_style),
        strict=True,
    ):
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, **FP32_TOL)


@interpreted
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "shape",
    [(64, 64, 4, 4), (128, 128, 8, 2), (128, 64, 4, 2), (80, 80, 3, 1)],
    ids=lambda s: f"head{s[0]}_rot{s[1]}_h{s[2]}_kv{s[3]}",
)
def test_qk_norm_rotary_embedding_matches_reference_fp32(shape, is_neox_style, offset):
    """Each head normalised over all its features (the pass-through tail of a partial rotary
    included), with the query's weight on query heads and the key's on key heads, then rotated."""
    positions, query, key, cache = _rotary_inputs(shape)
    q_weight, k_weight = _qk_norm_weights(shape[0])
    args = (shape[0], cache, is_neox_style, q_weight, k_weight, 1e-6, offset)
    q_out, k_out = qk_norm_rotary_embedding(positions, query, key, *args)
    q_ref, k_ref = ops.qk_norm_rotary_embedding(positions, query, key, *args)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    torch.testing.assert_close(q_out, q_ref, **FP32_TOL)
    torch.testing.assert_close(k_out, k_ref, **FP32_TOL)
    # not the rotation alone, and not with the weights swapped
    assert not torch.allclose(q_out, ops.rotary_embedding(positions, query, key, shape[0], cache, is_neox_style)[0])
    swapped = ops.qk_norm_rotary_embedding(
        positions, query, key, shape[0], cache, is_neox_style, k_weight, q_weight, 1e-6, offset
    )
    assert not torch.allclose(k_out, swapped[1])


@interpreted
def test_interpreted_kernels_read_and_write_bf16():
    # loads are cast to fp32 (the interpreter computes bf16 wrongly); the results keep the input dtype
    x, residual, weight = _norm_inputs((3, 576), dtype=torch.bfloat16)
    positions, query, key, cache = _rotary_inputs((64, 64, 2, 1), dtype=torch.bfloat16)
    pairs = [
        (rms_norm(x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6)),
        (
            fused_add_rms_norm(x, residual, weight, 1e-6, 1.0)[0],
            ops.fused_add_rms_norm(x, residual, weight, 1e-6, 1.0)[0],
        ),
        (silu_and_mul(x), ops.silu_and_mul(x)),
        (gelu_tanh_and_mul(x), ops.gelu_tanh_and_mul(x)),
        (
            rotary_embedding(positions, query, key, 64, cache, True)[0],
            ops.rotary_embedding(positions, query, key, 64, cache, True)[0],
        ),
        *zip(
            qk_norm_rotary_embedding(
                positions, query, key, 64, cache, True, *_qk_norm_weights(64, dtype=torch.bfloat16), 1e-6
            ),
            ops.qk_norm_rotary_embedding(
                positions, query, key, 64, cache, True, *_qk_norm_weights(64, dtype=torch.bfloat16), 1e-6
            ),
            strict=True,
        ),
    ]
    for out, ref in pairs:
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=3e-2)


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64)
    assert rms_norm(x, torch.ones(64), 1e-6).shape == (0, 64)
    assert fused_add_rms_norm(x, x, torch.ones(64), 1e-6)[1].shape == (0, 64)
    assert silu_and_mul(torch.empty(0, 128)).shape == (0, 64)
    q, k = rotary_embedding(
        torch.empty(0, dtype=torch.long), torch.empty(0, 128), torch.empty(0, 64), 64, torch.randn(16, 64), True
    )
    assert q.shape == (0, 128) and k.shape == (0, 64)
    q, k = qk_norm_rotary_embedding(
        torch.empty(0, dtype=torch.long),
        torch.empty(0, 128),
        torch.empty(0, 64),
        64,
        torch.randn(16, 64),
        True,
        torch.ones(64),
        torch.ones(64),
        1e-6,
    )
    assert q.shape == (0, 128) and k.shape == (0, 64)


# --- registry ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", DEFAULT_TRITON_OPS)
def test_registry_selects_triton_on_cuda_with_triton(op):
    platform = Platform("cuda", compute_capability=(9, 0), packages=frozenset({"triton"}))
    registry = registries.kernels(platform)
    spec = registry.select(op, platform)
    assert spec.name == "triton" and registry.plugin_of(spec.key) == "triton_ops"
    assert spec.load().__module__.startswith("fw_triton_ops.")


@pytest.mark.parametrize("op", sorted({*TRITON_KERNELS, *OPT_IN_KERNELS}))
def test_registry_keeps_torch_reference_on_cpu_and_without_triton(op):
    for platform in (
        Platform("cpu", packages=frozenset({"triton"})),
        Platform("cuda", compute_capability=(9, 0), packages=frozenset()),
    ):
        registry = registries.kernels(platform)
        assert registry.select(op, platform).name == "torch"
        assert registry.unavailable(platform)[f"{op}/triton"]


# --- compiled on CUDA -------------------------------------------------------------------------------------------

GPU_DTYPES = pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)


@pytest.mark.gpu
@GPU_DTYPES
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("shape", [*NORM_SHAPES, (4096, 4096), (300, 8192), (17, 3, 640)], ids=str)
def test_compiled_norms_match_reference_on_cuda(shape, offset, dtype):
    x, residual, weight = _norm_inputs(shape, device="cuda", dtype=dtype)
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-6, offset), ops.rms_norm(x, weight, 1e-6, offset), **GPU_TOL[dtype]
    )
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6, offset)
    expected_normed, expected_residual = ops.fused_add_rms_norm(x, residual, weight, 1e-6, offset)
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, expected_normed, **GPU_TOL[dtype])


@pytest.mark.gpu
@GPU_DTYPES
@pytest.mark.parametrize("shape", [*ACT_SHAPES, (4096, 2 * 14336), (33, 2 * 2048)], ids=str)
@pytest.mark.parametrize(
    "kernel, reference",
    [(silu_and_mul, ops.silu_and_mul), (gelu_tanh_and_mul, ops.gelu_tanh_and_mul)],
    ids=["silu", "gelu_tanh"],
)
def test_compiled_gated_activations_match_reference_on_cuda(kernel, reference, shape, dtype):
    x = _randn(*shape, seed=8, device="cuda", dtype=dtype, scale=3.0)
    torch.testing.assert_close(kernel(x), reference(x), **GPU_TOL[dtype])


@pytest.mark.gpu
@GPU_DTYPES
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "shape",
    [*ROTARY_SHAPES, (128, 128, 32, 8), (64, 32, 64, 8)],
    ids=lambda s: f"head{s[0]}_rot{s[1]}_h{s[2]}_kv{s[3]}",
)
@pytest.mark.parametrize("num_tokens", [1, 2048])
def test_compiled_rotary_matches_reference_on_cuda(shape, is_neox_style, num_tokens, dtype):
    positions, query, key, cache = _rotary_inputs(shape, num_tokens=num_tokens, device="cuda", dtype=dtype)
    outs = rotary_embedding(positions, query, key, shape[0], cache, is_neox_style)
    refs = ops.rotary_embedding(positions, query, key, shape[0], cache, is_neox_style)
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, **GPU_TOL[dtype])


@pytest.mark.gpu
@GPU_DTYPES
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize(
    "shape",
    [(128, 128, 8, 2), (128, 128, 32, 4), (128, 64, 4, 2), (256, 256, 4, 1)],
    ids=lambda s: f"head{s[0]}_rot{s[1]}_h{s[2]}_kv{s[3]}",
)
@pytest.mark.parametrize("num_tokens", [1, 2048])
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
def test_compiled_qk_norm_rotary_matches_reference_on_cuda(shape, offset, num_tokens, is_neox_style, dtype):
    positions, query, key, cache = _rotary_inputs(shape, num_tokens=num_tokens, device="cuda", dtype=dtype)
    args = (shape[0], cache, is_neox_style, *_qk_norm_weights(shape[0], device="cuda", dtype=dtype), 1e-6, offset)
    for out, ref in zip(
        qk_norm_rotary_embedding(positions, query, key, *args),
        ops.qk_norm_rotary_embedding(positions, query, key, *args),
        strict=True,
    ):
        torch.testing.assert_close(out, ref, **GPU_TOL[dtype])


def _call_every_op(x, residual, weight, gate_up, positions, query, key, cache):
    return (
        rms_norm(x, weight, 1e-6),
        *fused_add_rms_norm(x, residual, weight, 1e-6, 1.0),
        silu_and_mul(gate_up),
        gelu_tanh_and_mul(gate_up),
        *rotary_embedding(positions, query, key, 128, cache, True),
        *qk_norm_rotary_embedding(positions, query, key, 128, cache, True, weight[:128], weight[128:256], 1e-6),
    )


def _every_op_inputs(seed):
    x, residual, weight = _norm_inputs((8, 2048), device="cuda", dtype=torch.bfloat16)
    x.copy_(_randn(8, 2048, seed=seed, device="cuda", dtype=torch.bfloat16))
    gate_up = _randn(8, 2 * 4096, seed=seed + 1, device="cuda", dtype=torch.bfloat16)
    positions, query, key, cache = _rotary_inputs((128, 128, 16, 4), num_tokens=8, device="cuda", dtype=torch.bfloat16)
    return x, residual, weight, gate_up, positions, query, key, cache


@pytest.mark.gpu
def test_ops_do_not_sync_and_replay_in_a_cuda_graph():
    check_no_sync_and_cuda_graph_replay(_call_every_op, _every_op_inputs(seed=10), lambda: _every_op_inputs(seed=20))


@pytest.mark.gpu
@pytest.mark.parametrize("op", DEFAULT_TRITON_OPS)
def test_this_gpu_machine_selects_triton(op):
    from framework.platform import detect_platform

    platform = detect_platform()
    assert registries.kernels(platform).select(op, platform).name == "triton"
