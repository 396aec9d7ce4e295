"""The one-launch ops of a MoE / Gated DeltaNet decode step against their torch references:
``select_experts`` (router), ``sigmoid_gate_mul``, ``rms_norm_gated`` and ``gdn_gating``, plus
fused_moe's top-k sum. Interpreted on CPU (fp32, bf16 I/O), compiled for sm_90 without a GPU,
and on CUDA (``gpu``: bf16 at Qwen3.5-35B-A3B's shapes, no sync, CUDA-graph replay)."""

from __future__ import annotations

import pytest
import torch

from framework import ops_fused, ops_linear_attention
from framework.testing import (
    HopperCompile,
    check_no_sync_and_cuda_graph_replay,
    compile_for_hopper,
    interpreted,
    require_triton,
)

require_triton()

from fw_triton_ops.fused_moe import sum_top_k  # noqa: E402
from fw_triton_ops.gates import gdn_gating, sigmoid_gate_mul  # noqa: E402
from fw_triton_ops.norm import rms_norm_gated  # noqa: E402
from fw_triton_ops.routing import select_experts  # noqa: E402

FP32_TOL = {"rtol": 1e-6, "atol": 1e-7}
#: bf16 on CUDA: about two units in the last place of bf16.
BF16_TOL = {"rtol": 1.6e-2, "atol": 1.6e-2}
#: bf16 I/O under the interpreter, whose bf16 casts truncate: a smoke test (the rounding is checked on CUDA).
INTERPRETED_BF16_TOL = {"rtol": 2e-2, "atol": 6e-2}


def randn(*shape, seed=0, scale=1.0, device="cpu", dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


# --- select_experts -----------------------------------------------------------------------------------------------

#: (tokens, experts, top_k, scoring, renormalize, correction bias): decode at Qwen3.5-35B-A3B's router,
#: ragged expert counts (masks), many tokens (several per program), top_k = experts, MiniMax-M2's router.
ROUTER_CASES = [
    (1, 256, 8, "softmax", True, False),
    (5, 60, 4, "softmax", False, False),
    (300, 16, 2, "softmax", True, False),
    (3, 8, 8, "sigmoid", False, False),
    (300, 16, 2, "sigmoid", True, True),
    (2, 256, 8, "sigmoid", True, True),
]
ROUTERS = [("softmax", True, False), ("sigmoid", True, True)]


@interpreted
@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: "T{}_E{}_k{}_{}_renorm{}_bias{}".format(*c))
def test_select_experts_matches_reference_ids_exactly_and_weights_in_fp32(case):
    num_tokens, num_experts, top_k, scoring, renormalize, has_bias = case
    logits = randn(num_tokens, num_experts, seed=num_experts, scale=2.0)
    bias = randn(num_experts, seed=1, scale=0.5) if has_bias else None
    weights, ids = select_experts(logits, top_k, renormalize, scoring, bias)
    expected_weights, expected_ids = ops_fused.select_experts(logits, top_k, renormalize, scoring, bias)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (num_tokens, top_k)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, **FP32_TOL)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens), rtol=0, atol=1e-6)


@interpreted
def test_select_experts_reads_bf16_logits_and_strided_rows():
    logits = randn(4, 2 * 256, seed=3, scale=2.0, dtype=torch.bfloat16)[:, :256]  # a view: row stride 512
    weights, ids = select_experts(logits, 8, True)
    expected_weights, expected_ids = ops_fused.select_experts(logits, 8, True)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, **FP32_TOL)


@interpreted
def test_select_experts_breaks_ties_toward_the_lower_expert_id_as_the_reference():
    logits = torch.zeros(3, 64)
    logits[0, ::5] = 1.0  # 13 equal maxima: the first six win
    logits[1, 40:] = 2.0  # 24 equal maxima at the end
    logits[2] = torch.arange(64.0) % 4  # groups of 16 equal values
    weights, ids = select_experts(logits, 6, True)
    expected_weights, expected_ids = ops_fused.select_experts(logits, 6, True)
    assert ids[0].tolist() == [0, 5, 10, 15, 20, 25] and ids[1].tolist() == list(range(40, 46))
    assert ids[2].tolist() == [3, 7, 11, 15, 19, 23]
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, **FP32_TOL)


def test_select_experts_reference_refuses_unknown_scoring_and_a_top_k_beyond_the_experts():
    with pytest.raises(ValueError, match="valid: softmax, sigmoid"):
        ops_fused.select_experts(torch.zeros(1, 4), 2, True, "softplus")
    with pytest.raises(ValueError, match=r"top_k must be in 1\.\.4"):
        ops_fused.select_experts(torch.zeros(1, 4), 5, True)


# --- sigmoid_gate_mul, rms_norm_gated, gdn_gating, sum_top_k -------------------------------------------------------


def gate_cases(device="cpu", dtype=torch.float32, tokens=3, heads=4, head_dim=40):
    """(x, gate, residual) as the models pass them: an attention gate that is the second half of each
    head of a [T, H, 2D] projection, a shared expert's one gate per token with the routed output."""
    width = heads * head_dim
    x = randn(tokens, width, seed=1, scale=2.0, device=device, dtype=dtype)
    query_gate = randn(tokens, heads, 2 * head_dim, seed=2, scale=3.0, device=device, dtype=dtype)
    return [
        (x, query_gate.chunk(2, dim=-1)[1], None),
        (x, randn(tokens, 1, seed=3, scale=3.0, device=device, dtype=dtype), randn(tokens, width, seed=4, device=device, dtype=dtype)),
        (x, randn(tokens, width, seed=5, scale=3.0, device=device, dtype=dtype), None),
    ]  # fmt: skip


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sigmoid_gate_mul_matches_reference_for_head_views_token_gates_and_full_gates(dtype):
    for x, gate, residual in gate_cases(dtype=dtype, head_dim=40 if dtype == torch.float32 else 300):
        out = sigmoid_gate_mul(x, gate, residual)
        expected = ops_fused.sigmoid_gate_mul(x, gate, residual)
        assert out.shape == expected.shape and out.dtype == dtype
        tol = FP32_TOL if dtype == torch.float32 else INTERPRETED_BF16_TOL
        torch.testing.assert_close(out, expected, **tol)
        assert expected.abs().max() > 0.5


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_gated_matches_reference_with_a_strided_gate(dtype):
    x = randn(3, 4, 128, seed=6, scale=2.0, dtype=dtype)
    gate = randn(3, 4, 2 * 128, seed=7, scale=2.0, dtype=dtype)[..., 128:]  # a view, as Qwen3-Next's z
    weight = (1 + randn(128, seed=8, scale=0.2)).to(dtype)
    out = rms_norm_gated(x, weight, gate, 1e-6)
    expected = ops_fused.rms_norm_gated(x, weight, gate, 1e-6)
    tol = FP32_TOL if dtype == torch.float32 else INTERPRETED_BF16_TOL
    torch.testing.assert_close(out, expected, **tol)
    assert out.shape == x.shape and expected.abs().max() > 0.5
    with pytest.raises(ValueError, match="gate shaped as x"):
        rms_norm_gated(x, weight, gate[:, :2], 1e-6)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gdn_gating_matches_reference_across_the_softplus_threshold(dtype):
    a = randn(5, 32, seed=9, scale=4.0, dtype=dtype)
    a[0, :8] = torch.tensor([25.0, 19.5, -30.0, -90.0, 0.0, 1e-4, -1e-4, 20.5]).to(dtype)  # both sides of 20
    b = randn(5, 32, seed=10, scale=3.0, dtype=dtype)
    a_log, dt_bias = randn(32, seed=11).abs().log(), randn(32, seed=12)
    g, beta = gdn_gating(a, b, a_log, dt_bias)
    expected_g, expected_beta = ops_linear_attention.gdn_gating(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, expected_g, rtol=2e-6, atol=1e-30)  # log1p exact for tiny exp(a)
    torch.testing.assert_close(beta, expected_beta, **(FP32_TOL if dtype == torch.float32 else INTERPRETED_BF16_TOL))


@interpreted
def test_sum_top_k_adds_each_tokens_pairs_in_float32():
    per_pair = randn(3 * 8, 600, seed=13)  # 600: two column blocks
    expected = per_pair.view(3, 8, 600).sum(1)
    torch.testing.assert_close(sum_top_k(per_pair, 3, 8), expected, **FP32_TOL)


# --- compiled for sm_90 ---------------------------------------------------------------------------------------------


def test_routing_gate_and_norm_kernels_compile_for_hopper():
    cases = [
        HopperCompile(
            "fw_triton_ops.routing:_select_experts_kernel",
            {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32"},
            dict(NUM_EXPERTS=256, TOP_K=8, SIGMOID=False, HAS_BIAS=False, RENORMALIZE=True, BLOCK_T=1, BLOCK_E=256, BLOCK_K=8),
            options=dict(num_warps=1),
        ),
        HopperCompile(
            "fw_triton_ops.routing:_select_experts_kernel",
            {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32"},
            dict(NUM_EXPERTS=256, TOP_K=8, SIGMOID=True, HAS_BIAS=True, RENORMALIZE=True, BLOCK_T=8, BLOCK_E=256, BLOCK_K=8),
            options=dict(num_warps=8),
        ),
        HopperCompile(
            "fw_triton_ops.gates:_sigmoid_gate_mul_kernel",
            {"x_ptr": "*bf16", "gate_ptr": "*bf16", "residual_ptr": "*bf16", "out_ptr": "*bf16"},
            dict(GATE_HEAD=256, BROADCAST=False, HAS_RESIDUAL=True, BLOCK_N=1024),
            options=dict(num_warps=4),
        ),
        HopperCompile(
            "fw_triton_ops.gates:_gdn_gating_kernel",
            {"a_ptr": "*bf16", "b_ptr": "*bf16", "a_log_ptr": "*fp32", "dt_bias_ptr": "*fp32", "g_ptr": "*fp32", "beta_ptr": "*bf16"},
            dict(NUM_HEADS=32, BLOCK_H=32),
            options=dict(num_warps=1),
        ),
        HopperCompile(
            "fw_triton_ops.norm:_rms_norm_gated_kernel",
            {"x_ptr": "*bf16", "w_ptr": "*bf16", "gate_ptr": "*bf16", "out_ptr": "*bf16"},
            dict(BLOCK_N=128),
            float_args=("eps",),
            options=dict(num_warps=1),
        ),
        HopperCompile(
            "fw_triton_ops.fused_moe:_sum_top_k_kernel",
            {"per_pair_ptr": "*bf16", "out_ptr": "*bf16"},
            dict(TOP_K=8, BLOCK_N=512),
            options=dict(num_warps=4),
        ),
    ]  # fmt: skip
    assert all(".target sm_90" in ptx for ptx in compile_for_hopper(cases))


# --- compiled on CUDA ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 1000])
@pytest.mark.parametrize("scoring, renormalize, has_bias", ROUTERS, ids=["softmax", "sigmoid_bias"])
def test_select_experts_matches_reference_on_cuda_without_sync_and_in_a_graph(
    num_tokens, scoring, renormalize, has_bias
):
    logits = randn(num_tokens, 256, seed=num_tokens, scale=2.0, device="cuda", dtype=torch.bfloat16)
    bias = randn(256, seed=1, scale=0.5, device="cuda") if has_bias else None
    weights, ids = select_experts(logits, 8, renormalize, scoring, bias)
    expected_weights, expected_ids = ops_fused.select_experts(logits, 8, renormalize, scoring, bias)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
    check_no_sync_and_cuda_graph_replay(
        lambda x: select_experts(x, 8, renormalize, scoring, bias),
        [logits.clone()],
        lambda: [randn(num_tokens, 256, seed=7, scale=2.0, device="cuda", dtype=torch.bfloat16)],
    )


@pytest.mark.gpu
def test_gates_norm_and_top_k_sum_match_reference_on_cuda_at_qwen3_5_moe_shapes():
    bf16 = BF16_TOL
    for x, gate, residual in gate_cases("cuda", torch.bfloat16, tokens=2, heads=16, head_dim=256):
        torch.testing.assert_close(
            sigmoid_gate_mul(x, gate, residual), ops_fused.sigmoid_gate_mul(x, gate, residual), **bf16
        )
    x, z = (
        randn(2, 32, 128, seed=1, device="cuda", dtype=torch.bfloat16),
        randn(2, 32, 128, seed=2, device="cuda", dtype=torch.bfloat16),
    )
    weight = (1 + randn(128, seed=3, scale=0.2)).to("cuda", torch.bfloat16)
    torch.testing.assert_close(rms_norm_gated(x, weight, z, 1e-6), ops_fused.rms_norm_gated(x, weight, z, 1e-6), **bf16)
    a, b = (
        randn(2, 32, seed=4, scale=4.0, device="cuda", dtype=torch.bfloat16),
        randn(2, 32, seed=5, device="cuda", dtype=torch.bfloat16),
    )
    a_log, dt_bias = randn(32, seed=6, device="cuda").abs().log(), randn(32, seed=7, device="cuda")
    for got, expected in zip(
        gdn_gating(a, b, a_log, dt_bias), ops_linear_attention.gdn_gating(a, b, a_log, dt_bias), strict=True
    ):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=4e-3)
    per_pair = randn(2 * 8, 2048, seed=8, device="cuda", dtype=torch.bfloat16)
    expected = per_pair.view(2, 8, 2048).sum(1, dtype=torch.float32).to(torch.bfloat16)
    torch.testing.assert_close(sum_top_k(per_pair, 2, 8), expected, **bf16)  # torch may sum in another order
    check_no_sync_and_cuda_graph_replay(
        lambda x, g, r: sigmoid_gate_mul(x, g, r),
        [t.clone() for t in gate_cases("cuda", torch.bfloat16, tokens=1, heads=1, head_dim=2048)[1]],
        lambda: list(gate_cases("cuda", torch.bfloat16, tokens=1, heads=1, head_dim=2048)[1][::-1]),
    )
