"""fw_gptq.kernels.moe under the Triton interpreter (fp32; the interpreter computes bf16 wrongly): the
wna16 ``quantized_fused_moe`` against the torch reference ``framework.ops.quantized_fused_moe`` and
against dequantize-then-``fused_moe``, 4 and 8 bits, symmetric and asymmetric zeros, act-order
``g_idx``, channel-wise groups, both forms (per-pair and sorted blocks), tokens 1..64 and top-k 1..8
with experts that get no token; its registration and fallbacks; sm_90 codegen; on the GPU, bf16
within tolerance of the reference, no host sync and CUDA-graph replay at the Qwen3-30B-A3B shape."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from framework import ops
from framework.ops import MoEActivation, PackedExperts
from framework.testing import (
    HopperCompile,
    check_no_sync_and_cuda_graph_replay,
    compile_for_hopper,
    interpreted,
    require_triton,
)

require_triton()

from fw_gptq.kernels import moe as moe_module  # noqa: E402
from fw_gptq.kernels.moe import MoEKernelConfig, moe_config, quantized_fused_moe  # noqa: E402
from fw_gptq.moe import dequantize_experts, stack_experts  # noqa: E402
from fw_gptq.packing import IntWeight  # noqa: E402

# narrow tiles: few values a program, which is what the interpreter's time goes by
UNSORTED = MoEKernelConfig(sorted=False, block_n=64, block_k=64, sub_k=32)
SORTED = MoEKernelConfig(sorted=True, block_m=16, block_n=64, block_k=64, sub_k=32)


def _stack(experts, rows, cols, bits, group_size, symmetric, act_order, seed, device="cpu"):
    """``(PackedExperts, dense float32 [E, rows, cols])``: random experts in the MoE method's layout
    (small scales: the SwiGLU stays in its interesting range) and their values by the canonical
    form's own decoder. ``act_order``: ``"perm"``, each expert's groups a random permutation of
    ``k // size`` (as GPTQ's desc_act writes them); ``"uneven"``, random groups of uneven sizes."""
    generator = torch.Generator().manual_seed(seed)
    size = cols if group_size == -1 else group_size
    groups = -(-cols // size)
    weights = []
    for _ in range(experts):
        q = torch.randint(0, 2**bits, (cols, rows), generator=generator, dtype=torch.uint8)
        scales = torch.rand(groups, rows, generator=generator) * 0.02 + 0.005
        zeros = None if symmetric else torch.randint(0, 2**bits, (groups, rows), generator=generator, dtype=torch.uint8)
        g_idx = None
        if act_order == "perm":
            g_idx = (torch.arange(cols) // size)[torch.randperm(cols, generator=generator)]
        elif act_order == "uneven":
            g_idx = torch.randint(0, groups, (cols,), generator=generator)
        weights.append(IntWeight(q, scales, zeros, g_idx, bits, size))
    data, side, grouping = stack_experts(weights)
    perm_size = int(grouping[4:]) if grouping.startswith("perm") else None
    decode = functools.partial(dequantize_experts, bits, cols, rows, perm_group_size=perm_size)
    packed = PackedExperts(data.to(device), side.to(device), f"wna16:{bits}bit:{grouping}", cols, decode)
    return packed, torch.stack([w.dequantize(torch.float32) for w in weights]).to(device)


def _routing(num_tokens: int, top_k: int, chosen: list[int], seed: int, device: str = "cpu"):
    """Each token's ``top_k`` distinct experts among ``chosen`` (the others get no token) and weights."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.tensor(chosen)[torch.randperm(len(chosen), generator=generator)[:top_k]] for _ in range(num_tokens)]
    )
    return torch.rand(num_tokens, top_k, generator=generator).to(device), ids.to(device)


def _check(
    hidden_size,
    inter,
    experts,
    num_tokens,
    top_k,
    config,
    bits=4,
    group_size=32,
    symmetric=True,
    act_order=False,
    chosen=None,
    seed=0,
):
    """The kernel against the reference op and against dequantize-then-fused_moe."""
    w1, d1 = _stack(experts, inter, hidden_size, bits, group_size, symmetric, act_order, seed + 1)
    w3, d3 = _stack(experts, inter, hidden_size, bits, group_size, symmetric, act_order, seed + 2)
    w2, d2 = _stack(experts, hidden_size, inter, bits, group_size, symmetric, act_order, seed + 3)
    expected = {
        False: f"g{group_size if group_size > 0 else hidden_size}",
        "perm": f"perm{group_size}",
        "uneven": "g_idx",
    }[act_order]
    assert w1.quant_type == f"wna16:{bits}bit:{expected}"
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(seed))
    topk_weights, topk_ids = _routing(num_tokens, top_k, chosen or list(range(experts)), seed)
    got = quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, config=config)
    reference = ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids)
    dense = ops.fused_moe(hidden, torch.cat([d1, d3], dim=1), d2, topk_weights, topk_ids)
    assert got.shape == (num_tokens, hidden_size) and got.dtype == torch.float32
    scale = reference.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=2e-6 * scale)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=2e-6 * scale)


@interpreted
@pytest.mark.parametrize(
    ("bits", "group_size", "symmetric", "act_order", "config"),
    [
        (4, 32, True, False, UNSORTED),
        (4, 32, False, False, SORTED),
        (4, 32, False, "perm", UNSORTED),
        (4, 32, True, "perm", SORTED),
        (8, 16, True, "uneven", SORTED),
        (8, 32, False, False, UNSORTED),
        (8, -1, True, False, SORTED),
        (4, 16, False, False, SORTED),
    ],
    ids=[
        "gptq4-sym",
        "awq4-asym-sorted",
        "gptq4-act-order",
        "act-order-sorted",
        "uneven-groups-looked-up-sorted",
        "int8-asym",
        "int8-channel-sorted",
        "group16-per-feature-scales",
    ],
)
def test_moe_kernel_of_every_scheme_matches_the_reference(bits, group_size, symmetric, act_order, config):
    # expert 2 of 4 gets no token
    _check(64, 64, 4, 3, 2, config, bits, group_size, symmetric, act_order, chosen=[0, 1, 3], seed=bits + group_size)


@interpreted
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (1, 8), (4, 8), (64, 2), (33, 8)])
def test_moe_kernel_from_one_token_to_64_at_top_k_1_to_8(num_tokens, top_k):
    """The rule's form (per pair up to 64 pairs, 16-row blocks up to 256, then 32-row blocks),
    asymmetric 4-bit experts, 12 of 16 experts chosen (the rest get no token)."""
    chosen = [0, 1, 2, 4, 5, 7, 8, 9, 11, 12, 14, 15]
    pairs = num_tokens * top_k
    assert not moe_config(64, 32).sorted and moe_config(65, 32).sorted  # 8 tokens at top-8: per pair
    config = moe_config(pairs, 32)
    assert config.sorted == (pairs > 64) and config.block_m == (32 if pairs > 256 else 16) and config.sub_k == 32
    config = dataclasses.replace(config, block_n=64)
    _check(64, 64, 16, num_tokens, top_k, config, symmetric=False, chosen=chosen, seed=num_tokens * 10 + top_k)


def test_other_formats_and_activations_go_to_the_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "quantized_fused_moe", lambda *args: calls.append(args) or "reference")
    w = _stack(2, 32, 32, 4, 32, True, False, 1)[0]
    hidden, (topk_weights, topk_ids) = torch.randn(1, 32), _routing(1, 1, [0, 1], 0)
    assert quantized_fused_moe(hidden, w, w, w._replace(quant_type="gguf:Q4_K"), topk_weights, topk_ids) == "reference"
    biased = MoEActivation(w13_bias=torch.zeros(2, 64))
    assert quantized_fused_moe(hidden, w, w, w, topk_weights, topk_ids, biased) == "reference"
    eight = w._replace(quant_type="wna16:8bit:g32")
    assert quantized_fused_moe(hidden, w, w, eight, topk_weights, topk_ids) == "reference"  # two bit widths
    assert len(calls) == 3
    assert moe_module.parse_quant_type("wna16:4bit:g128") == (4, 128, False)
    assert moe_module.parse_quant_type("wna16:4bit:perm32") == (4, 32, True)
    assert moe_module.parse_quant_type("wna16:8bit:g_idx") == (8, None, False)
    assert moe_module.parse_quant_type("wna16:4bit") is None and moe_module.parse_quant_type("wna16:3bit:g64") is None


@interpreted
def test_stacks_whose_shapes_do_not_fit_are_refused():
    w = _stack(2, 32, 64, 4, 32, True, False, 1)[0]
    hidden, (topk_weights, topk_ids) = torch.randn(1, 64), _routing(1, 1, [0, 1], 0)
    down = _stack(2, 64, 64, 4, 32, True, False, 2)[0]  # width 64 where the gate/up stacks have 32 rows
    with pytest.raises(ValueError, match=r"w2: expected int32 words \[E, 32 // 8, 64\]"):
        quantized_fused_moe(hidden, w, w, down, topk_weights, topk_ids)
    with pytest.raises(ValueError, match="block_m is a power of two >= 16"):
        MoEKernelConfig(sorted=True, block_m=8)
    with pytest.raises(ValueError, match="sub_k is a power of two >= 32 dividing block_k"):
        MoEKernelConfig(sorted=False, block_k=96, sub_k=64)


def test_registered_for_cuda_and_asked_for_by_the_moe_method():
    from framework import registries
    from framework.platform import Platform

    cuda = Platform("cuda", compute_capability=(9, 0), packages=frozenset({"triton"}))
    spec = registries.kernels(cuda).get("quantized_fused_moe/triton_wna16")
    assert spec.load() is quantized_fused_moe and not spec.unavailable_reasons(cuda)
    assert 0 < spec.priority < 5  # the torch reference is 0, fw-gguf's kernel 5, fw-fp4's MXFP4 kernel 10
    cpu = Platform("cpu", packages=frozenset({"triton"}))
    assert spec.unavailable_reasons(cpu)


# --- sm_90 codegen --------------------------------------------------------------------------------------------


def _hopper(
    kernel: str,
    bits: int,
    sorted_: bool,
    act_order: bool,
    block_m: int,
    block_k: int,
    stages: int,
    sub_k: int = 128,
    gather: bool = False,
):
    pointers = {
        "x_ptr": "*bf16",
        "w1_ptr": "*i32",
        "w3_ptr": "*i32",
        "side1_ptr": "*fp32",
        "side3_ptr": "*fp32",
        "act_ptr": "*bf16",
        "sorted_ids_ptr": "*i32",
        "expert_ids_ptr": "*i64",
    }
    aligned = (
        "x_ptr",
        "w1_ptr",
        "w3_ptr",
        "side1_ptr",
        "side3_ptr",
        "H",
        "INTER",
        "stride_xm",
        "stride_we",
        "stride_se",
    )
    if kernel == "_down_kernel":
        pointers = {
            "act_ptr": "*bf16",
            "w2_ptr": "*i32",
            "side2_ptr": "*fp32",
            "out_ptr": "*bf16",
            "weights_ptr": "*fp32",
            "sorted_ids_ptr": "*i32",
            "expert_ids_ptr": "*i64",
        }
        aligned = ("act_ptr", "w2_ptr", "side2_ptr", "out_ptr", "H", "INTER", "stride_we", "stride_se")
    return HopperCompile(
        f"fw_gptq.kernels.moe:{kernel}",
        pointers,
        dict(
            BITS=bits,
            GROUP_SIZE=128,
            ACT_ORDER=act_order,
            GATHER_X=gather,
            SCALE_PER_SLICE=not act_order,
            FP32=False,
            SORTED=sorted_,
            BLOCK_M=block_m,
            BLOCK_N=128,
            BLOCK_K=block_k,
            SUB_K=sub_k,
        ),
        options=dict(num_warps=4, num_stages=stages),
        divisible_by_16=aligned,
    )


@pytest.mark.slow
def test_moe_kernels_compile_for_hopper_on_wgmma_from_registers():
    """The rule's launches at the Qwen3-30B-A3B shape, 4-bit group 128: sm_90 PTX on wgmma, the
    unpacked weights never stored to shared memory as 16-bit values, no integer-to-float conversion,
    the words streamed by 16-byte async copies, act-order experts sorted by group (the activations
    gathered through ``perm``) too; looked-up groups compile."""
    decode, batch, act_order = moe_config(8, 128), moe_config(512, 128), moe_config(8, 128, act_order=True)
    cases = [
        _hopper("_gate_up_kernel", 4, False, False, 16, decode.block_k, decode.num_stages),
        _hopper("_down_kernel", 8, True, False, batch.block_m, batch.block_k, batch.num_stages),
        _hopper("_down_kernel", 4, False, False, 16, decode.block_k, decode.num_stages, gather=True),
        _hopper("_gate_up_kernel", 4, False, True, 16, act_order.block_k, act_order.num_stages, act_order.sub_k),
    ]
    ptx = compile_for_hopper(cases)
    assert all("wgmma" in text for text in ptx)
    for text in ptx[:3]:
        assert "cvt.rn.f32.u32" not in text and "cvt.rn.f32.s32" not in text
        assert "cp.async.cg.shared.global" in text and "ld.global.b8" not in text
    assert "st.shared.b16" not in ptx[0] and "st.shared.b16" not in ptx[1]
    # gathered through perm, x's bf16 tile [SUB_K, 16] goes through registers (16 values a thread of 128 per
    # slice); the weights do not (they would be 128 a thread)
    assert ptx[2].count("st.shared.b16") == decode.block_k // 128 * 16, ptx[2].count("st.shared.b16")


# --- compiled on CUDA -------------------------------------------------------------------------------------------

#: Qwen3-30B-A3B's experts: 128 of them, 8 per token, hidden 2048, expert width 768.
QWEN3_30B_A3B = (128, 8, 2048, 768)


@functools.cache
def _qwen3_stacks(act_order: bool | str) -> tuple[PackedExperts, ...]:
    """4-bit group-128 experts with zero points (built once per form: packing 384 experts takes seconds)."""
    experts, _, hidden_size, inter = QWEN3_30B_A3B
    return tuple(
        _stack(experts, rows, cols, 4, 128, False, act_order, i, "cuda")[0]
        for i, (rows, cols) in enumerate(((inter, hidden_size), (inter, hidden_size), (hidden_size, inter)))
    )


def _qwen3(num_tokens, act_order=False, seed=0):
    experts, top_k, hidden_size, _ = QWEN3_30B_A3B
    stacks = _qwen3_stacks(act_order)
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(seed))
    return stacks, (
        hidden.to("cuda", torch.bfloat16),
        *_routing(num_tokens, top_k, list(range(0, experts, 3)), seed, "cuda"),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("act_order", [False, "perm", "uneven"], ids=["group128", "act-order", "looked-up-groups"])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512])
def test_compiled_moe_kernel_bf16_matches_the_reference_at_the_qwen3_30b_a3b_shape(num_tokens, act_order):
    """bf16 on the GPU: the kernel's error against fp32 math within twice that of the torch
    reference op and of dequantize-then-bf16 ``fused_moe`` (the registry's, Triton's on CUDA)."""
    from framework.kernels import get_kernel

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    (w1, w3, w2), (hidden, topk_weights, topk_ids) = _qwen3(num_tokens, act_order)
    exact = ops.quantized_fused_moe(hidden.float(), w1, w3, w2, topk_weights, topk_ids)
    got = quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids).float()
    reference = ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids).float()
    ids = torch.arange(QWEN3_30B_A3B[0], device="cuda")
    w13 = torch.cat([w1.experts(ids, torch.bfloat16), w3.experts(ids, torch.bfloat16)], dim=1)
    dense = get_kernel("fused_moe")(hidden, w13, w2.experts(ids, torch.bfloat16), topk_weights, topk_ids).float()
    errors = [(out - exact).abs().max().item() for out in (got, reference, dense)]
    assert errors[0] <= 2 * max(errors[1:]) + 1e-3 * exact.abs().max().item(), errors


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512])
def test_compiled_moe_kernel_does_not_sync_and_replays_in_a_cuda_graph(num_tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    stacks, inputs = _qwen3(num_tokens)
    run = functools.partial(lambda w, x, weights, ids: quantized_fused_moe(x, *w, weights, ids), stacks)
    check_no_sync_and_cuda_graph_replay(run, inputs, lambda: _qwen3(num_tokens, seed=5)[1])
