"""fw_fp8.kernels.moe under the Triton interpreter (fp32; the interpreter computes bf16 wrongly): the
FP8 ``quantized_fused_moe`` against the torch reference ``framework.ops.quantized_fused_moe`` and
against ``fused_moe`` on weights dequantized by the test's own reference, for block scales (per
128-row block and per output feature, partial blocks), channel and tensor scales, both forms
(per-pair and sorted blocks), tokens 1..64 and top-k 1..8 with experts that get no token; its
registration and fallbacks; sm_90 codegen; on the GPU, bf16 within tolerance of the reference, no
host sync and CUDA-graph replay at the Qwen3-30B-A3B shape."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from fp8_reference import dequantize_reference, quantize_reference, random_weight

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

from fw_fp8.kernels import moe as moe_module  # noqa: E402
from fw_fp8.kernels.moe import MoEKernelConfig, moe_config, quantized_fused_moe  # noqa: E402
from fw_fp8.moe import decode_experts  # noqa: E402

# narrow tiles and short steps: few values a program, which is what the interpreter's time goes by
UNSORTED = MoEKernelConfig(sorted=False, block_n=64, block_k=128, sub_k=64)
SORTED = MoEKernelConfig(sorted=True, block_m=16, block_n=64, block_k=128, sub_k=64)


def _stack(experts, rows, cols, granularity, seed, per_feature_rows=False, device="cpu"):
    """``(PackedExperts, dense float32 [E, rows, cols])``: random experts quantized by the test's reference
    (``per_feature_rows``: block scales repeated per output feature, as a shard off a block boundary keeps
    them), and the values they stand for."""
    generator = torch.Generator().manual_seed(seed)
    data, scales, dense = [], [], []
    for _ in range(experts):
        q, scale = quantize_reference(random_weight(rows, cols, generator) * 20, granularity)
        dense.append(dequantize_reference(q, scale, granularity))
        if granularity == "block" and per_feature_rows:
            scale = scale.repeat_interleave(128, 0)[:rows]
        elif granularity != "block":
            scale = scale.reshape(-1, 1).expand(rows, 1)
        data.append(q.view(torch.uint8))
        scales.append(scale.float().contiguous())
    scale_rows = 128 if granularity == "block" and not per_feature_rows else 1
    scale_cols = 128 if granularity == "block" else cols
    packed = PackedExperts(
        torch.stack(data).to(device),
        torch.stack(scales).to(device),
        f"fp8:e4m3:{scale_rows}x{scale_cols}",
        cols,
        functools.partial(decode_experts, scale_rows, scale_cols),
    )
    return packed, torch.stack(dense).to(device)


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
    granularity="block",
    per_feature_rows=False,
    chosen=None,
    seed=0,
):
    """The kernel against the reference op and against dense fused_moe on the reference's values."""
    (w1, d1), (w3, d3), (w2, d2) = (
        _stack(experts, rows, cols, granularity, seed + i, per_feature_rows)
        for i, (rows, cols) in enumerate(((inter, hidden_size), (inter, hidden_size), (hidden_size, inter)))
    )
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
    ("hidden_size", "inter", "granularity", "per_feature_rows", "config"),
    [
        (256, 128, "block", False, UNSORTED),
        (256, 128, "block", False, SORTED),
        (320, 192, "block", False, SORTED),
        (256, 128, "block", True, UNSORTED),
        (192, 64, "channel", False, SORTED),
        (128, 64, "tensor", False, UNSORTED),
    ],
    ids=["block-unsorted", "block-sorted", "partial-blocks-sorted", "block-rows1", "channel-sorted", "tensor"],
)
def test_moe_kernel_of_every_scale_layout_matches_the_reference(
    hidden_size, inter, granularity, per_feature_rows, config
):
    # expert 2 of 4 gets no token
    _check(hidden_size, inter, 4, 3, 2, config, granularity, per_feature_rows, chosen=[0, 1, 3], seed=hidden_size)


@interpreted
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (1, 8), (4, 8), (64, 2), (33, 8)])
def test_moe_kernel_from_one_token_to_64_at_top_k_1_to_8(num_tokens, top_k):
    """The rule's form (per pair up to 64 pairs, 16-row blocks up to 256, then 32-row blocks), block
    scales, 12 of 16 experts chosen (the rest get no token)."""
    chosen = [0, 1, 2, 4, 5, 7, 8, 9, 11, 12, 14, 15]
    pairs = num_tokens * top_k
    assert not moe_config(64).sorted and moe_config(65).sorted  # 8 tokens at top-8: per pair
    config = moe_config(pairs)
    assert config.sorted == (pairs > 64) and config.block_m == (32 if pairs > 256 else 16)
    config = dataclasses.replace(config, block_n=64, block_k=128, sub_k=128)
    _check(128, 128, 16, num_tokens, top_k, config, chosen=chosen, seed=num_tokens * 10 + top_k)


def test_other_formats_and_activations_go_to_the_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "quantized_fused_moe", lambda *args: calls.append(args) or "reference")
    w, _ = _stack(2, 128, 128, "block", 1)
    hidden, (topk_weights, topk_ids) = torch.randn(1, 128), _routing(1, 1, [0, 1], 0)
    assert quantized_fused_moe(hidden, w, w, w._replace(quant_type="gguf:Q4_K"), topk_weights, topk_ids) == "reference"
    biased = MoEActivation(w13_bias=torch.zeros(2, 256))
    assert quantized_fused_moe(hidden, w, w, w, topk_weights, topk_ids, biased) == "reference"
    rows1 = w._replace(quant_type="fp8:e4m3:1x128")
    assert quantized_fused_moe(hidden, w, rows1, w, topk_weights, topk_ids) == "reference"  # gate, up unlike
    assert len(calls) == 3
    assert moe_module.parse_quant_type("fp8:e4m3:128x128") == (128, 128)
    assert moe_module.parse_quant_type("fp8:e4m3") is None and moe_module.parse_quant_type("fp8:e5m2:1x1") is None


@interpreted
def test_stacks_whose_shapes_do_not_fit_are_refused():
    w, _ = _stack(2, 128, 256, "block", 1)
    hidden, (topk_weights, topk_ids) = torch.randn(1, 256), _routing(1, 1, [0, 1], 0)
    down, _ = _stack(2, 256, 256, "block", 2)  # width 256 where the gate/up stacks have 128 rows
    with pytest.raises(ValueError, match=r"w2: expected FP8 bytes \[E, 256, 128\] and float32 scales \[2, 2, 1\]"):
        quantized_fused_moe(hidden, w, w, down, topk_weights, topk_ids)
    with pytest.raises(ValueError, match="block_m is a power of two >= 16"):
        MoEKernelConfig(sorted=True, block_m=8)
    with pytest.raises(ValueError, match="sub_k is a power of two >= 16 dividing block_k"):
        MoEKernelConfig(sorted=False, block_k=96, sub_k=64)


def test_registered_for_cuda_below_the_other_quantized_moe_kernels():
    from framework import registries
    from framework.platform import Platform

    cuda = Platform("cuda", compute_capability=(9, 0), packages=frozenset({"triton"}))
    spec = registries.kernels(cuda).get("quantized_fused_moe/triton_fp8")
    assert spec.load() is quantized_fused_moe and not spec.unavailable_reasons(cuda)
    assert 0 < spec.priority < 4  # the torch reference is 0, fw-gptq's 4, fw-gguf's 5, fw-fp4's MXFP4 kernel 10
    assert spec.unavailable_reasons(Platform("cpu", packages=frozenset({"triton"})))


#: Qwen3-30B-A3B's experts: 128 of them, 8 per token, hidden 2048, expert width 768.
QWEN3_30B_A3B = (128, 8, 2048, 768)
#: The token counts the GPU tests run.
GPU_TOKENS = (1, 8, 64, 512)


# --- sm_90 codegen --------------------------------------------------------------------------------------------


def _hopper(kernel: str, config: MoEKernelConfig, hidden_size: int, inter: int, scale_rows: int = 128) -> HopperCompile:
    """The launch :func:`quantized_fused_moe` makes of ``kernel`` with ``config`` on bf16 activations and
    ``<scale_rows>x128`` block scales: its ids are ``topk_ids`` (int64, as ``torch.topk`` gives) unsorted and
    ``moe_align_block_size``'s int32 sorted, its K step ``config.k_step`` of the kernel's K, and the
    arguments that are multiples of 16 at these shapes compiled as such."""
    ids = "*i32" if config.sorted else "*i64"
    if kernel == "_gate_up_kernel":
        pointers = {
            "x_ptr": "*bf16",
            "w1_ptr": "*fp8e4nv",
            "w3_ptr": "*fp8e4nv",
            "s1_ptr": "*fp32",
            "s3_ptr": "*fp32",
            "act_ptr": "*bf16",
            "sorted_ids_ptr": ids,
            "expert_ids_ptr": ids,
        }
        aligned = ("x_ptr", "w1_ptr", "w3_ptr", "s1_ptr", "s3_ptr", "H", "INTER", "stride_xm", "stride_we")
        k = hidden_size
    else:
        pointers = {
            "act_ptr": "*bf16",
            "w2_ptr": "*fp8e4nv",
            "s2_ptr": "*fp32",
            "out_ptr": "*bf16",
            "weights_ptr": "*fp32",
            "sorted_ids_ptr": ids,
            "expert_ids_ptr": ids,
        }
        aligned = ("act_ptr", "w2_ptr", "s2_ptr", "out_ptr", "H", "INTER", "stride_we")
        k = inter
    return HopperCompile(
        f"fw_fp8.kernels.moe:{kernel}",
        pointers,
        dict(
            SCALE_ROWS=scale_rows,
            SCALE_COLS=128,
            FP32=False,
            SORTED=config.sorted,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.k_step(k),
            SUB_K=config.sub_k,
        ),
        options=dict(num_warps=config.num_warps, num_stages=config.num_stages),
        divisible_by_16=aligned,
    )


@pytest.mark.slow
def test_moe_kernels_compile_for_hopper_on_wgmma_with_16_byte_copies():
    """Every launch the rule picks for the GPU tests below (1 to 512 tokens at the Qwen3-30B-A3B shape,
    block scales; and block scales per output feature): sm_90 PTX on wgmma (the upcast weight its register operand), FP8 bytes streamed by
    16-byte async copies, none loaded one by one."""
    _, top_k, hidden_size, inter = QWEN3_30B_A3B
    configs = {moe_config(num_tokens * top_k): None for num_tokens in GPU_TOKENS}
    assert [c.sorted for c in configs] == [False, True]  # per pair for 1 and 8 tokens, sorted beyond
    cases = [_hopper(kernel, c, hidden_size, inter) for c in configs for kernel in ("_gate_up_kernel", "_down_kernel")]
    cases.append(_hopper("_down_kernel", moe_config(512), hidden_size, inter, scale_rows=1))  # a shard off the blocks
    for text in compile_for_hopper(cases):
        assert "wgmma" in text and "cp.async.cg.shared.global" in text and "ld.global.b8" not in text


# --- compiled on CUDA -------------------------------------------------------------------------------------------


def _qwen3(num_tokens, seed=0):
    experts, top_k, hidden_size, inter = QWEN3_30B_A3B
    generator = torch.Generator("cuda").manual_seed(seed)
    stacks = []
    for rows, cols in ((inter, hidden_size), (inter, hidden_size), (hidden_size, inter)):
        # clamped: torch < 2.12 casts |x| > 464 to NaN in float8_e4m3fn (later ones saturate at 448); a few
        # hundred of these draws a stack lie beyond, and one NaN byte makes every output of its expert NaN
        values = torch.randn(experts, rows, cols, device="cuda", generator=generator) * 100
        data = values.clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.rand(experts, rows // 128, cols // 128, device="cuda", generator=generator) * 1e-4 + 1e-4
        stacks.append(
            PackedExperts(
                data.view(torch.uint8), scales, "fp8:e4m3:128x128", cols, functools.partial(decode_experts, 128, 128)
            )
        )
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=generator).to(torch.bfloat16)
    return stacks, (hidden, *_routing(num_tokens, top_k, list(range(0, experts, 3)), seed, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", GPU_TOKENS)
def test_compiled_moe_kernel_bf16_matches_the_reference_at_the_qwen3_30b_a3b_shape(num_tokens):
    """bf16 on the GPU: the kernel's error against fp32 math within twice that of the torch
    reference op and of dequantize-then-bf16 ``fused_moe`` (the registry's, Triton's on CUDA)."""
    from framework.kernels import get_kernel

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    (w1, w3, w2), (hidden, topk_weights, topk_ids) = _qwen3(num_tokens)
    exact = ops.quantized_fused_moe(hidden.float(), w1, w3, w2, topk_weights, topk_ids)
    got = quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids).float()
    reference = ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids).float()
    ids = torch.arange(QWEN3_30B_A3B[0], device="cuda")
    w13 = torch.cat([w1.experts(ids, torch.bfloat16), w3.experts(ids, torch.bfloat16)], dim=1)
    dense = get_kernel("fused_moe")(hidden, w13, w2.experts(ids, torch.bfloat16), topk_weights, topk_ids).float()
    errors = [(out - exact).abs().max().item() for out in (got, reference, dense)]
    assert errors[0] <= 2 * max(errors[1:]) + 1e-3 * exact.abs().max().item(), errors


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", GPU_TOKENS)
def test_compiled_moe_kernel_does_not_sync_and_replays_in_a_cuda_graph(num_tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    stacks, inputs = _qwen3(num_tokens)
    run = functools.partial(lambda w, x, weights, ids: quantized_fused_moe(x, *w, weights, ids), stacks)
    check_no_sync_and_cuda_graph_replay(run, inputs, lambda: _qwen3(num_tokens, seed=5)[1])
