"""The Triton fused MoE against the torch reference ``framework.ops.fused_moe``: interpreted on CPU
(fp32, small shapes), compiled on CUDA (bf16, Qwen3-30B-A3B's expert shapes)."""

from __future__ import annotations

import pytest
import torch

from framework import ops
from framework.layers.fused_moe import select_experts
from framework.testing import check_no_sync_and_cuda_graph_replay, interpreted, require_triton

require_triton()

from fw_triton_ops.fused_moe import align_pairs_to_blocks, fused_moe  # noqa: E402


def moe_inputs(
    num_tokens,
    num_experts,
    top_k,
    hidden_size,
    intermediate_size,
    *,
    seed=0,
    device="cpu",
    dtype=torch.float32,
    renormalize=True,
):
    """Random activations, expert weights scaled like trained ones, and a softmax top-k routing."""
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)  # noqa: E731
    hidden = rand(num_tokens, hidden_size)
    w13 = rand(num_experts, 2 * intermediate_size, hidden_size, scale=hidden_size**-0.5)
    w2 = rand(num_experts, hidden_size, intermediate_size, scale=intermediate_size**-0.5)
    logits = rand(num_tokens, num_experts, scale=2.0)
    topk_weights, topk_ids = select_experts(logits, top_k, renormalize)
    return hidden, w13, w2, topk_weights, topk_ids


#: (tokens, experts, top_k, hidden, intermediate): decode, ragged sizes (masks), a prefill-sized batch
#: that takes the large-tile configuration (more than 256 pairs).
CPU_SHAPES = [(1, 8, 2, 64, 32), (7, 16, 4, 96, 80), (70, 8, 4, 64, 48)]


@interpreted
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "T{}_E{}_k{}_H{}_I{}".format(*s))
def test_fused_moe_matches_reference_fp32(shape):
    inputs = moe_inputs(*shape, renormalize=shape[0] != 7)
    out = fused_moe(*inputs)
    expected = ops.fused_moe(*inputs)
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert expected.abs().max() > 0.1  # a real signal, not zeros


@interpreted
@pytest.mark.parametrize("shape", CPU_SHAPES[:2], ids=lambda s: "T{}_E{}_k{}_H{}_I{}".format(*s))
def test_fused_moe_with_biases_and_the_clamped_swiglu_matches_reference_fp32(shape):
    hidden, w13, w2, topk_weights, topk_ids = moe_inputs(*shape, seed=8)
    num_experts, width, hidden_size = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    generator = torch.Generator().manual_seed(9)
    activation = ops.MoEActivation(
        torch.randn(num_experts, 2 * width, generator=generator) * 3.0,
        torch.randn(num_experts, hidden_size, generator=generator),
        swiglu_limit=2.0,  # low enough that both clamps bite on these scales
        swiglu_alpha=1.702,
    )
    hidden = hidden * 4.0
    out = fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation)
    expected = ops.fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    gate_up = torch.einsum("th,eih->tei", hidden, w13) + activation.w13_bias
    assert (gate_up[..., :width] > 2.0).any() and (gate_up[..., width:] < -2.0).any()  # the clamps are exercised
    plain = ops.fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    assert (expected - plain).abs().max() > 0.1  # biases and activation change the result


@interpreted
def test_fused_moe_with_geglu_experts_matches_reference_fp32():
    """Gemma 4's experts: gelu_tanh(gate) * up between the projections."""
    inputs = moe_inputs(5, 8, 2, 64, 48, seed=5)
    geglu = ops.MoEActivation(gelu_tanh=True)
    expected = ops.fused_moe(*inputs, geglu)
    torch.testing.assert_close(fused_moe(*inputs, geglu), expected, rtol=1e-5, atol=1e-5)
    assert (expected - ops.fused_moe(*inputs)).abs().max() > 0.05  # not SwiGLU's result


@interpreted
def test_fused_moe_when_every_token_picks_the_same_experts():
    # one expert group spans several blocks; the other experts get no rows at all
    hidden, w13, w2, _, _ = moe_inputs(40, 8, 2, 64, 32, seed=3)
    topk_ids = torch.tensor([[5, 2]] * 40, dtype=torch.int32)
    topk_weights = torch.rand(40, 2, generator=torch.Generator().manual_seed(4))  # not normalised: any weights
    torch.testing.assert_close(
        fused_moe(hidden, w13, w2, topk_weights, topk_ids),
        ops.fused_moe(hidden, w13, w2, topk_weights, topk_ids),
        rtol=1e-5,
        atol=1e-5,
    )


@interpreted
def test_interpreted_fused_moe_reads_and_writes_bf16():
    inputs = moe_inputs(5, 8, 2, 64, 32, seed=5, dtype=torch.bfloat16)
    out = fused_moe(*inputs)
    assert out.dtype == torch.bfloat16
    # a dtype smoke test: the interpreter truncates bf16 stores (the kernel's top-k sum is one) where
    # a GPU rounds, so up to about two bf16 units off; fp32 above and bf16 on CUDA check the values
    torch.testing.assert_close(out.float(), ops.fused_moe(*inputs).float(), rtol=2e-2, atol=4e-2)


def _distinct_ids(num_tokens, top_k, num_experts, seed=6):
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)]).to(
        torch.int32
    )


@interpreted
@pytest.mark.parametrize("num_pairs_shape", [(1, 2), (1, 8), (9, 4), (64, 8)])
def test_alignment_puts_every_pair_once_in_blocks_of_one_expert(num_pairs_shape):
    num_experts, block_m = 16, 16
    topk_ids = _distinct_ids(*num_pairs_shape, num_experts)
    sorted_pair_ids, block_expert_ids = align_pairs_to_blocks(topk_ids, num_experts, block_m)
    num_pairs = topk_ids.numel()
    real = sorted_pair_ids[sorted_pair_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    flat = topk_ids.reshape(-1)
    for block, expert in enumerate(block_expert_ids.tolist()):
        rows = sorted_pair_ids[block * block_m : (block + 1) * block_m]
        rows = rows[rows < num_pairs]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows.long()] == expert).all())


@interpreted
@pytest.mark.parametrize("num_experts", [8, 60, 128])
@pytest.mark.parametrize("num_pairs_shape", [(1, 1), (1, 8), (3, 5), (4, 8)])
def test_one_program_alignment_equals_the_sort(num_pairs_shape, num_experts, monkeypatch):
    import fw_triton_ops.fused_moe as kernels

    topk_ids = _distinct_ids(*num_pairs_shape, num_experts, seed=num_experts)
    assert topk_ids.numel() <= kernels.MAX_PAIRS_ONE_PROGRAM
    one_program = align_pairs_to_blocks(topk_ids, num_experts, 16)
    monkeypatch.setattr(kernels, "MAX_PAIRS_ONE_PROGRAM", 0)
    sorted_ = align_pairs_to_blocks(topk_ids, num_experts, 16)
    assert torch.equal(one_program[0], sorted_[0]) and torch.equal(one_program[1], sorted_[1])


def test_empty_batch_launches_nothing():
    hidden, w13, w2, topk_weights, topk_ids = moe_inputs(0, 8, 2, 64, 32)
    assert fused_moe(hidden, w13, w2, topk_weights, topk_ids).shape == (0, 64)


# --- compiled on CUDA -------------------------------------------------------------------------------------------

#: Qwen3-30B-A3B's experts: 128 of them, 8 per token, hidden 2048, expert width 768.
QWEN3_30B_A3B = (128, 8, 2048, 768)


def _errors_against_fp32(inputs):
    """Max error of the Triton kernel and of the torch reference (both bf16) against float32 math."""
    exact = ops.fused_moe(*(x.float() if x.is_floating_point() else x for x in inputs))
    return (
        (fused_moe(*inputs).float() - exact).abs().max().item(),
        (ops.fused_moe(*inputs).float() - exact).abs().max().item(),
        exact.abs().max().item(),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64, 256])
def test_compiled_fused_moe_bf16_matches_reference_on_cuda(num_tokens):
    inputs = moe_inputs(num_tokens, *QWEN3_30B_A3B, seed=num_tokens, device="cuda", dtype=torch.bfloat16)
    triton_error, torch_error, scale = _errors_against_fp32(inputs)
    assert triton_error <= 2 * torch_error + 1e-3 * scale, (triton_error, torch_error, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_compiled_fused_moe_with_geglu_experts_matches_reference_on_cuda(num_tokens):
    inputs = moe_inputs(num_tokens, 16, 4, 512, 384, device="cuda")
    geglu = ops.MoEActivation(gelu_tanh=True)
    torch.testing.assert_close(fused_moe(*inputs, geglu), ops.fused_moe(*inputs, geglu), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_compiled_fused_moe_fp32_matches_reference_on_cuda():
    inputs = moe_inputs(33, 16, 4, 512, 384, device="cuda")
    torch.testing.assert_close(fused_moe(*inputs), ops.fused_moe(*inputs), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [4, 64], ids=["one_program_alignment", "sorted_alignment"])
def test_compiled_fused_moe_does_not_sync_and_replays_in_a_cuda_graph(num_tokens):
    inputs = moe_inputs(num_tokens, *QWEN3_30B_A3B, device="cuda", dtype=torch.bfloat16)
    check_no_sync_and_cuda_graph_replay(
        fused_moe, inputs, lambda: moe_inputs(num_tokens, *QWEN3_30B_A3B, seed=9, device="cuda", dtype=torch.bfloat16)
    )
