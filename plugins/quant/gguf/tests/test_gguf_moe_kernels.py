"""fw_gguf.kernels.moe under the Triton interpreter (fp32; the interpreter computes bf16 wrongly):
the GGUF ``quantized_fused_moe`` against the torch reference ``framework.ops.quantized_fused_moe``
and against dequantize-then-``fused_moe``, for every kernel type, both forms (per-pair GEMV and
sorted tensor-core blocks) and both layouts, tokens 1..64 and top-k 1..8 with experts that get no
token; its registration and fallbacks; sm_90 compilation; on the GPU, bf16 within tolerance of the
reference, no host sync and CUDA-graph replay at the Qwen3-30B-A3B shape."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

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

from fw_gguf.dequant import dequantize  # noqa: E402
from fw_gguf.kernels import moe as moe_module  # noqa: E402
from fw_gguf.kernels.layout import GROUPS, KERNEL_TYPES, experts_from_planar, experts_to_planar  # noqa: E402
from fw_gguf.kernels.moe import MoEKernelConfig, moe_config, quantized_fused_moe  # noqa: E402

TYPES = sorted(KERNEL_TYPES, key=int)
# wide tiles: few programs, which is what the interpreter's time goes by
GEMV = MoEKernelConfig(block_m=1, block_n_gate_up=256, block_n_down=256)
DOT = MoEKernelConfig(block_m=16, block_n_gate_up=256, block_n_down=256)


def _stack(
    qtype: Q, experts: int, rows: int, cols: int, seed: int, random_packed, planar: bool = False, device: str = "cpu"
) -> PackedExperts:
    """Random packed experts (small scales: the SwiGLU stays in its interesting range), the file's
    layout or planar per expert, with the reference's decoder of either."""
    data = torch.from_numpy(random_packed(qtype, experts * rows, cols, seed=seed, scale_exponents=(-3, -1)))
    data = data.reshape(experts, rows, -1)
    if planar:
        data = experts_to_planar(data, qtype)

    def dequantize_rows(packed, scales, dtype):
        packed = experts_from_planar(packed, qtype) if planar else packed
        return dequantize(packed, qtype, (packed.shape[0] * rows, cols), dtype).view(-1, rows, cols)

    layout = "gguf-planar" if planar else "gguf"
    return PackedExperts(data.contiguous().to(device), None, f"{layout}:{qtype.name}", cols, dequantize_rows)


def _routing(num_tokens: int, top_k: int, chosen: list[int], seed: int, device: str = "cpu"):
    """Each token's ``top_k`` distinct experts among ``chosen`` (the others get no token) and weights."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.tensor(chosen)[torch.randperm(len(chosen), generator=generator)[:top_k]] for _ in range(num_tokens)]
    )
    weights = torch.rand(num_tokens, top_k, generator=generator)
    return weights.to(device), ids.to(device)


def _check(
    types, hidden_size, inter, experts, num_tokens, top_k, random_packed, config=None, planar=False, chosen=None, seed=0
):
    """The kernel against the reference op and against dequantize-then-fused_moe, in fp64 terms."""
    gate, up, down = types
    w1 = _stack(gate, experts, inter, hidden_size, seed + 1, random_packed, planar)
    w3 = _stack(up, experts, inter, hidden_size, seed + 2, random_packed, planar)
    w2 = _stack(down, experts, hidden_size, inter, seed + 3, random_packed, planar)
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(seed))
    topk_weights, topk_ids = _routing(num_tokens, top_k, chosen or list(range(experts)), seed)
    got = quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, config=config)
    reference = ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids)
    all_experts = torch.arange(experts)
    w13 = torch.cat([w1.experts(all_experts, torch.float32), w3.experts(all_experts, torch.float32)], dim=1)
    dense = ops.fused_moe(hidden, w13, w2.experts(all_experts, torch.float32), topk_weights, topk_ids)
    assert got.shape == (num_tokens, hidden_size) and got.dtype == torch.float32
    scale = reference.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=2e-6 * scale)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=2e-6 * scale)


def _k(qtype: Q) -> int:
    return 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 64


@interpreted
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_moe_kernel_of_every_type_matches_the_reference(qtype, random_packed):
    # tensor-core blocks; expert 2 of 4 gets no token
    _check((qtype, qtype, qtype), _k(qtype), _k(qtype), 4, 3, 2, random_packed, DOT, chosen=[0, 1, 3], seed=int(qtype))


@interpreted
@pytest.mark.parametrize(
    ("types", "config", "planar"),
    [
        ((Q.Q4_K, Q.Q4_K, Q.Q6_K), GEMV, True),
        ((Q.Q4_K, Q.Q4_K, Q.Q6_K), DOT, False),
        ((Q.Q5_K, Q.Q8_0, Q.Q4_0), GEMV, False),
        ((Q.Q5_K, Q.Q8_0, Q.Q4_0), DOT, True),
    ],
    ids=["Q4_K_M-gemv-planar", "Q4_K_M-dot-gguf", "mixed-gemv-gguf", "mixed-dot-planar"],
)
def test_moe_kernel_with_per_projection_types_in_both_forms_and_layouts(types, config, planar, random_packed):
    """Q4_K_M's experts (Q4_K gate/up, Q6_K down), and gate / up / down of three types (K steps of
    one 256-value block and of eight 32-value blocks side by side)."""
    _check(types, 256, 256, 4, 2, 2, random_packed, config, planar=planar, seed=7 + planar)


@interpreted
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (1, 8), (8, 8), (64, 2), (33, 8)])
def test_moe_kernel_from_one_token_to_64_at_top_k_1_to_8(num_tokens, top_k, random_packed):
    """The rule's form (per-pair GEMV up to 64 pairs, 16-row blocks up to 256, then 32-row blocks;
    its row tiles widened to the whole width), planar Q4_0 / Q8_0 experts, 12 of 16 experts chosen
    (the rest get no token)."""
    chosen = [0, 1, 2, 4, 5, 7, 8, 9, 11, 12, 14, 15]
    pairs = num_tokens * top_k
    config = moe_config(pairs)
    assert config.block_m == (1 if pairs <= 64 else 16 if pairs <= 256 else 32)
    config = dataclasses.replace(config, block_n_gate_up=64, block_n_down=64)
    _check(
        (Q.Q4_0, Q.Q4_0, Q.Q8_0),
        64,
        64,
        16,
        num_tokens,
        top_k,
        random_packed,
        config,
        planar=True,
        chosen=chosen,
        seed=num_tokens * 10 + top_k,
    )


def test_planar_experts_round_trip(random_packed):
    for qtype in (Q.Q4_K, Q.Q6_K, Q.Q8_0):
        data = torch.from_numpy(random_packed(qtype, 3 * 4, 256, seed=int(qtype))).reshape(3, 4, -1)
        planar = experts_to_planar(data, qtype)
        assert planar.shape == data.shape and not torch.equal(planar, data)
        assert torch.equal(experts_from_planar(planar, qtype), data)


def test_other_formats_and_activations_go_to_the_reference(monkeypatch, random_packed):
    calls = []
    monkeypatch.setattr(ops, "quantized_fused_moe", lambda *args: calls.append(args) or "reference")
    w = _stack(Q.Q8_0, 2, 32, 32, 1, random_packed)
    hidden, (topk_weights, topk_ids) = torch.randn(1, 32), _routing(1, 1, [0, 1], 0)
    other = w._replace(quant_type="wna16:4bit")
    assert quantized_fused_moe(hidden, w, w, other, topk_weights, topk_ids) == "reference"
    biased = MoEActivation(w13_bias=torch.zeros(2, 64))
    assert quantized_fused_moe(hidden, w, w, w, topk_weights, topk_ids, biased) == "reference"
    assert (
        quantized_fused_moe(hidden, w, w._replace(quant_type="gguf-planar:Q8_0"), w, topk_weights, topk_ids)
        == "reference"
    )  # gate and up in two layouts
    assert len(calls) == 3
    assert moe_module.parse_quant_type("gguf:Q4_K") == (False, Q.Q4_K)
    assert moe_module.parse_quant_type("gguf-planar:Q6_K") == (True, Q.Q6_K)
    assert moe_module.parse_quant_type("gguf:F16") is None and moe_module.parse_quant_type("mxfp4") is None


@interpreted
@pytest.mark.parametrize("config", [GEMV, DOT], ids=["gemv", "dot"])
def test_geglu_experts_are_multiplied_as_geglu_in_the_kernels(config, random_packed, monkeypatch):
    """A GeGLU activation (Gemma 4's experts) runs in the kernels (no reference call: CUDA graphs
    can capture it) in both forms and gets GeGLU's values, not SwiGLU's."""
    w1, w3, w2 = (_stack(Q.Q8_0, 2, 32, 32, seed, random_packed) for seed in (1, 2, 3))
    hidden, (topk_weights, topk_ids) = (
        torch.randn(2, 32, generator=torch.Generator().manual_seed(0)),
        _routing(2, 2, [0, 1], 0),
    )
    geglu = MoEActivation(gelu_tanh=True)
    reference = ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, geglu)
    assert (reference - ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids)).abs().max() > 1e-3

    def no_reference(*args):
        raise AssertionError("the GeGLU experts went to the torch reference")

    monkeypatch.setattr(ops, "quantized_fused_moe", no_reference)
    got = quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, geglu, config=config)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)


@interpreted
def test_stacks_whose_bytes_do_not_match_their_features_are_refused(random_packed):
    w = _stack(Q.Q8_0, 2, 32, 64, 1, random_packed)
    hidden, (topk_weights, topk_ids) = torch.randn(1, 64), _routing(1, 1, [0, 1], 0)
    with pytest.raises(ValueError, match=r"gguf:Q8_0 experts need contiguous uint8 \[E, rows, 32 // 32 \* 34\]"):
        quantized_fused_moe(hidden, w, w, w._replace(in_features=32), topk_weights, topk_ids)
    down = _stack(Q.Q8_0, 2, 64, 64, 2, random_packed)  # width 64 where the gate/up stacks have 32 rows
    with pytest.raises(
        ValueError,
        match=r"w2: expected 2 experts of \[64, 32\] for hidden 64 and width 32, got 2 of "
        r"\[64, 64\]",
    ):
        quantized_fused_moe(hidden, w, w, down, topk_weights, topk_ids)
    with pytest.raises(ValueError, match="block_m is 1 .* or a power of two >= 16"):
        MoEKernelConfig(block_m=8, block_n_gate_up=16, block_n_down=16)


def test_a_tuned_moe_setting_replaces_the_rule_for_its_device_types_shape_and_pairs(monkeypatch, random_packed):
    w1, w2 = _stack(Q.Q4_K, 4, 256, 512, 1, random_packed), _stack(Q.Q6_K, 4, 512, 256, 2, random_packed)
    tuned = MoEKernelConfig(block_m=32, block_n_gate_up=16, block_n_down=16, k_step=512)
    monkeypatch.setitem(moe_module.MOE_TUNED, ("cpu", "Q4_K", "Q6_K", 4, 512, 256, 64), tuned)
    device = torch.device("cpu")
    assert moe_module.launch_setting(w1, w2, 40, device) is tuned  # 40 pairs: the 64 bucket
    assert moe_module.launch_setting(w1, w2, 8, device) == moe_config(8)
    assert moe_module.launch_setting(w2, w2, 40, device) == moe_config(40)  # another gate type


def test_registered_for_cuda_below_the_mxfp4_kernel():
    from framework import registries
    from framework.platform import Platform

    cuda = Platform("cuda", compute_capability=(9, 0), packages=frozenset({"triton", "gguf"}))
    registry = registries.kernels(cuda)
    spec = registry.get("quantized_fused_moe/triton_gguf")
    assert spec.load() is quantized_fused_moe and not spec.unavailable_reasons(cuda)
    assert 0 < spec.priority < 10  # the torch reference is 0, fw-fp4's MXFP4 kernel 10
    cpu = Platform("cpu", packages=frozenset({"triton", "gguf"}))
    assert spec.unavailable_reasons(cpu) and registries.kernels(cpu).select("quantized_fused_moe", cpu).name == "torch"
    assert {f"gguf-planar:{t.name}" for t in TYPES} <= quantized_fused_moe.quant_types


# What a GPU launch of aligned planar experts compiles (the stacks' bases and strides are multiples of 16)
ALIGNED = ("w1_ptr", "w3_ptr", "w2_ptr", "stride_w1e", "stride_w3e", "stride_w2e", "H", "INTER")


def _meta(qtype: Q, suffix: str = "") -> dict:
    groups, size = GROUPS[qtype]
    return {
        f"QTYPE{suffix}": int(qtype),
        f"G{suffix}": groups,
        f"S{suffix}": size,
        f"NB{suffix}": 256 // (groups * size),
    }


def _gate_up(qtype, block_m, block_n, warps, gelu_tanh=False):
    return HopperCompile(
        "fw_gguf.kernels.moe:_gate_up_kernel",
        {
            "x_ptr": "*bf16",
            "w1_ptr": "*u8",
            "w3_ptr": "*u8",
            "act_ptr": "*bf16",
            "sorted_ids_ptr": "*i32",
            "expert_ids_ptr": "*i64",
        },
        dict(
            PLANAR=True,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            PRECISION="tf32",
            GELU_TANH=gelu_tanh,
            **_meta(qtype, "1"),
            **_meta(qtype, "3"),
        ),
        options=dict(num_warps=warps, num_stages=2),
        divisible_by_16=tuple(a for a in ALIGNED if a not in ("w2_ptr", "stride_w2e")),
    )


def _down(qtype, block_m, block_n, warps):
    return HopperCompile(
        "fw_gguf.kernels.moe:_down_kernel",
        {
            "act_ptr": "*bf16",
            "w2_ptr": "*u8",
            "out_ptr": "*bf16",
            "weights_ptr": "*fp32",
            "sorted_ids_ptr": "*i32",
            "expert_ids_ptr": "*i64",
        },
        dict(PLANAR=True, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="tf32", **_meta(qtype)),
        options=dict(num_warps=warps, num_stages=2),
        divisible_by_16=("w2_ptr", "stride_w2e", "H", "INTER"),
    )


def _loads(ptx: str) -> dict[str, int]:
    """``{form: count}`` of the global loads in ``ptx``; a ``cp.async`` form says its bytes."""
    counts: dict[str, int] = {}
    for form, operands in re.findall(r"(ld\.global[.\w]*|cp\.async\.c[ag]\.shared\.global)([^;]*);", ptx):
        key = form + (" " + str(int(operands.split(",")[2], 16)) if form.startswith("cp.async") else "")
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_moe_kernels_compile_for_hopper_with_16_byte_weight_loads():
    """Qwen3-30B-A3B Q4_K_M's launches at the rule's settings (Q4_K gate/up, Q6_K down) in both
    forms: sm_90 PTX; the tensor-core forms use ``mma``; planar quant bytes arrive in
    16-byte loads: at least a thread's share of them in ``ld.global.v4`` in the GEMV (128 threads;
    Q4_K: 16 rows x 128 bytes x 2 projections, Q6_K: 32 rows x 192 bytes) and in 16-byte
    ``cp.async`` in the tiles (256 threads, 32 rows); bytes loaded one by one are at most Q4_K's
    three scale bytes a projection. The GeGLU epilogue (Gemma 4's experts) compiles with the
    tiles' loads unchanged."""
    cases = [_gate_up(Q.Q4_K, 1, 16, 4), _down(Q.Q6_K, 1, 32, 4), _gate_up(Q.Q4_K, 16, 32, 8), _down(Q.Q6_K, 32, 32, 8)]
    cases.append(_gate_up(Q.Q4_K, 16, 32, 8, gelu_tanh=True))
    ptx = compile_for_hopper(cases)
    loads = [_loads(text) for text in ptx]
    assert all(".target sm_90" in text for text in ptx)
    assert "mma" not in ptx[0] and "mma" not in ptx[1] and "mma" in ptx[2] and "mma" in ptx[3]
    assert loads[0].get("ld.global.v4.b32", 0) >= 16 * 128 * 2 // 128 // 16, loads[0]
    assert loads[1].get("ld.global.v4.b32", 0) >= 32 * 192 // 128 // 16, loads[1]
    assert loads[2].get("cp.async.cg.shared.global 16", 0) >= 32 * 128 * 2 // 256 // 16, loads[2]
    assert loads[3].get("cp.async.cg.shared.global 16", 0) >= 32 * 192 // 256 // 16, loads[3]
    assert all(counts.get("ld.global.b8", 0) <= 6 for counts in loads), loads
    assert loads[1].get("ld.global.b8", 0) == loads[3].get("ld.global.b8", 0) == 0  # Q6_K: none
    assert "mma" in ptx[4] and loads[4] == loads[2] and ptx[4] != ptx[2]


# --- compiled on CUDA -------------------------------------------------------------------------------------------

#: Qwen3-30B-A3B's experts: 128 of them, 8 per token, hidden 2048, expert width 768; Q4_K_M's types.
QWEN3_30B_A3B = (128, 8, 2048, 768)


def _qwen3_stacks(random_packed) -> list[PackedExperts]:
    experts, _, hidden_size, inter = QWEN3_30B_A3B
    shapes = ((Q.Q4_K, inter, hidden_size), (Q.Q4_K, inter, hidden_size), (Q.Q6_K, hidden_size, inter))
    return [
        _stack(t, experts, rows, cols, i, random_packed, planar=True, device="cuda")
        for i, (t, rows, cols) in enumerate(shapes)
    ]


def _qwen3_routing(num_tokens, seed=0):
    """bf16 hidden states and each token's 8 of every third expert (the others get no token)."""
    experts, top_k, hidden_size, _ = QWEN3_30B_A3B
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(seed))
    return (hidden.to("cuda", torch.bfloat16), *_routing(num_tokens, top_k, list(range(0, experts, 3)), seed, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512])
def test_compiled_moe_kernel_bf16_matches_the_reference_at_the_qwen3_30b_a3b_shape(
    num_tokens, random_packed, monkeypatch
):
    """bf16 on the GPU: the kernel's error against fp32 math within twice that of the torch
    reference op and of dequantize-then-bf16 ``fused_moe`` (the registry's, Triton's on CUDA). The
    integer decode form that 1-16 tokens take by default rounds x to int8 (test_gguf_moe_int8.py checks
    it against that rounding), so it is turned off here: these are the exact-in-x forms."""
    from fw_gguf.kernels import moe_int8

    from framework.kernels import get_kernel

    monkeypatch.setattr(moe_int8, "INT8_DECODE", False)

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    w1, w3, w2 = _qwen3_stacks(random_packed)
    hidden, topk_weights, topk_ids = _qwen3_routing(num_tokens)
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
def test_compiled_moe_kernel_does_not_sync_and_replays_in_a_cuda_graph(num_tokens, random_packed):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    stacks = _qwen3_stacks(random_packed)
    run = functools.partial(lambda w, x, weights, ids: quantized_fused_moe(x, *w, weights, ids), stacks)
    check_no_sync_and_cuda_graph_replay(run, _qwen3_routing(num_tokens), lambda: _qwen3_routing(num_tokens, seed=5))
