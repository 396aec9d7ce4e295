"""fw_gguf.kernels.moe_int8 (the MoE decode form on integer dot products) under the Triton
interpreter (fp32) against its torch reference (x and the act rows rounded to int8 per 32 values,
``quantize_x_reference``) and, within that rounding, against dequantize-then-``fused_moe``: Q4_K,
Q6_K and Q8_0 experts, SwiGLU and GeGLU, 1 and 3 tokens, top-k 2..8; which calls take the form;
sm_90 compilation at the Qwen3-30B-A3B, gpt-oss and Gemma 4 shapes; on the GPU, bf16 within
tolerance of that reference, no host sync and CUDA-graph replay."""

from __future__ import annotations

import functools

import pytest
import torch
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
from fw_gguf.kernels import moe_int8  # noqa: E402
from fw_gguf.kernels.layout import experts_from_planar, experts_to_planar  # noqa: E402
from fw_gguf.kernels.moe import int8_form, quantized_fused_moe  # noqa: E402
from fw_gguf.kernels.moe_int8 import Int8MoEConfig, int8_moe_reference  # noqa: E402

GEGLU = MoEActivation(gelu_tanh=True)
# wide row tiles: few programs, which is what the interpreter's time goes by
WIDE = Int8MoEConfig(block_n_gate_up=256, block_n_down=256, blocks_gate_up=1, blocks_down=1)


def _stack(qtype: Q, experts: int, rows: int, cols: int, seed: int, random_packed, device="cpu") -> PackedExperts:
    """Random planar experts (small scales: the activation stays in its interesting range)."""
    data = torch.from_numpy(random_packed(qtype, experts * rows, cols, seed=seed, scale_exponents=(-3, -1)))
    data = experts_to_planar(data.reshape(experts, rows, -1), qtype)

    def dequantize_rows(packed, scales, dtype):
        packed = experts_from_planar(packed, qtype)
        return dequantize(packed, qtype, (packed.shape[0] * rows, cols), dtype).view(-1, rows, cols)

    return PackedExperts(data.contiguous().to(device), None, f"gguf-planar:{qtype.name}", cols, dequantize_rows)


def _stacks(types, experts, hidden_size, inter, seed, random_packed, device="cpu"):
    gate, up, down = types
    return (
        _stack(gate, experts, inter, hidden_size, seed + 1, random_packed, device),
        _stack(up, experts, inter, hidden_size, seed + 2, random_packed, device),
        _stack(down, experts, hidden_size, inter, seed + 3, random_packed, device),
    )


def _routing(num_tokens: int, top_k: int, experts: int, seed: int, device="cpu"):
    """Each token's ``top_k`` distinct experts (expert 1 never chosen) and positive weights."""
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.tensor([e for e in range(experts) if e != 1])
    ids = torch.stack([chosen[torch.randperm(len(chosen), generator=generator)[:top_k]] for _ in range(num_tokens)])
    return torch.rand(num_tokens, top_k, generator=generator).to(device), ids.to(device)


def _check(types, num_tokens, top_k, activation, random_packed, hidden_size=256, inter=256, config=WIDE, seed=0):
    experts = top_k + 2
    w1, w3, w2 = _stacks(types, experts, hidden_size, inter, seed, random_packed)
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(seed))
    topk_weights, topk_ids = _routing(num_tokens, top_k, experts, seed)
    got = quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, activation, config=config)
    reference = int8_moe_reference(hidden, w1, w3, w2, topk_weights, topk_ids, activation)
    exact = ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, activation)
    scale = exact.abs().max().item()
    assert got.shape == (num_tokens, hidden_size) and got.dtype == torch.float32 and scale > 0
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=2e-6 * scale)
    # the int8 rounding of x and act: ~1 % of the output's scale, and not nothing
    error = (got - exact).abs().max().item() / scale
    assert 1e-6 < error < 0.05, error


@interpreted
@pytest.mark.parametrize(
    ("types", "num_tokens", "top_k", "activation"),
    [
        ((Q.Q4_K, Q.Q4_K, Q.Q6_K), 1, 8, ops.PLAIN_SWIGLU),  # Q4_K_M, Qwen3-30B-A3B's top-8
        ((Q.Q4_K, Q.Q4_K, Q.Q6_K), 3, 2, GEGLU),
        ((Q.Q6_K, Q.Q6_K, Q.Q4_K), 3, 4, ops.PLAIN_SWIGLU),
        ((Q.Q8_0, Q.Q8_0, Q.Q8_0), 1, 2, GEGLU),
        ((Q.Q8_0, Q.Q8_0, Q.Q8_0), 3, 8, ops.PLAIN_SWIGLU),
        ((Q.Q4_K, Q.Q8_0, Q.Q6_K), 3, 3, GEGLU),  # gate and up of two types
    ],
    ids=["Q4_K_M-1tok-top8", "Q4_K_M-3tok-top2-geglu", "Q6_K-gate-3tok-top4", "Q8_0-1tok-top2-geglu",
         "Q8_0-3tok-top8", "mixed-3tok-top3-geglu"],
)  # fmt: skip
def test_int8_moe_matches_its_reference_and_the_exact_layer_within_the_rounding(
    types, num_tokens, top_k, activation, random_packed
):
    _check(types, num_tokens, top_k, activation, random_packed, seed=num_tokens * 10 + top_k)


@interpreted
def test_int8_moe_steps_over_a_partial_last_step_and_row_blocks(random_packed):
    """K of 3 superblocks in steps of 2 (the last half empty), hidden rows in blocks of 64 (two
    blocks cover 96 rows, the last half empty), and Q8_0 at K = 96 (three 32-blocks): the same
    values as the reference."""
    config = Int8MoEConfig(block_n_gate_up=256, block_n_down=64, blocks_gate_up=2, blocks_down=2)
    _check((Q.Q4_K, Q.Q4_K, Q.Q6_K), 2, 2, ops.PLAIN_SWIGLU, random_packed, hidden_size=768, inter=256, config=config)
    w1, w3, w2 = _stacks((Q.Q8_0,) * 3, 3, 96, 64, 4, random_packed)
    hidden = torch.randn(1, 96, generator=torch.Generator().manual_seed(4))
    weights, ids = _routing(1, 2, 3, 4)
    got = quantized_fused_moe(hidden, w1, w3, w2, weights, ids, config=Int8MoEConfig(block_n_down=64))
    reference = int8_moe_reference(hidden, w1, w3, w2, weights, ids)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=2e-6 * reference.abs().max().item())


def test_decode_batches_of_built_types_take_the_int8_form(monkeypatch, random_packed):
    q4 = _stack(Q.Q4_K, 2, 256, 256, 1, random_packed)
    q6 = _stack(Q.Q6_K, 2, 256, 256, 2, random_packed)
    monkeypatch.setattr(moe_int8, "INT8_DECODE", True)
    assert int8_form(1, q4, q4, q6) and int8_form(16, q4, q4, q6)
    assert not int8_form(17, q4, q4, q6)  # above INT8_MAX_TOKENS: the current forms
    assert not int8_form(1, q4, q4, q6._replace(quant_type="gguf:Q6_K"))  # the file's layout
    assert not int8_form(1, q4._replace(quant_type="gguf-planar:Q5_K"), q4, q6)  # no integer dot product built
    q8_odd = _stack(Q.Q8_0, 1, 3, 32, 3, random_packed)  # 3 blocks an expert: quants not 4-byte aligned
    assert not moe_int8.int8_supported(q8_odd, q8_odd, q8_odd)
    monkeypatch.setattr(moe_int8, "INT8_DECODE", False)  # FW_GGUF_MOE_INT8=0
    assert not int8_form(1, q4, q4, q6)
    with pytest.raises(ValueError, match="integer MoE form takes planar Q4_K / Q6_K / Q8_0"):
        hidden, (weights, ids) = torch.zeros(1, 256), _routing(1, 1, 2, 0)
        quantized_fused_moe(hidden, q4, q4, q6._replace(quant_type="gguf:Q6_K"), weights, ids, config=WIDE)
    with pytest.raises(ValueError, match="block_n_down is a power of two"):
        Int8MoEConfig(block_n_down=48)


@interpreted
def test_the_default_call_of_a_decode_batch_runs_the_int8_form_and_the_env_var_turns_it_off(monkeypatch, random_packed):
    w1, w3, w2 = _stacks((Q.Q8_0,) * 3, 4, 64, 64, 9, random_packed)
    hidden = torch.randn(2, 64, generator=torch.Generator().manual_seed(9))
    weights, ids = _routing(2, 2, 4, 9)
    int8 = int8_moe_reference(hidden, w1, w3, w2, weights, ids)
    exact = ops.quantized_fused_moe(hidden, w1, w3, w2, weights, ids)
    atol = 2e-6 * exact.abs().max().item()
    monkeypatch.setattr(moe_int8, "INT8_DECODE", True)
    torch.testing.assert_close(quantized_fused_moe(hidden, w1, w3, w2, weights, ids), int8, rtol=1e-5, atol=atol)
    monkeypatch.setattr(moe_int8, "INT8_DECODE", False)
    off = quantized_fused_moe(hidden, w1, w3, w2, weights, ids)
    torch.testing.assert_close(off, exact, rtol=1e-5, atol=atol)
    assert (off - int8).abs().max() > 100 * atol  # the two forms are told apart


# --- sm_90 --------------------------------------------------------------------------------------------------------

#: ``name: (experts, top_k, hidden, expert width, gate/up type, down type)`` of the shapes compiled:
#: Qwen3-30B-A3B Q4_K_M and Q8_0, Gemma 4 26B-A4B (width 704: no K-quant down), gpt-oss (2880).
SHAPES = {
    "qwen3-30b-a3b-Q4_K_M": (128, 8, 2048, 768, Q.Q4_K, Q.Q6_K),
    "qwen3-30b-a3b-Q8_0": (128, 8, 2048, 768, Q.Q8_0, Q.Q8_0),
    "gemma4-Q4_K_M": (128, 8, 2816, 704, Q.Q4_K, Q.Q8_0),
    "gpt-oss-Q8_0": (32, 4, 2880, 2880, Q.Q8_0, Q.Q8_0),
}
_TYPE_BYTES = {Q.Q4_K: (256, 144), Q.Q6_K: (256, 210), Q.Q8_0: (32, 34)}


def _divisible(values: dict[str, int]) -> tuple[str, ...]:
    return tuple(name for name, value in values.items() if value % 16 == 0)


def _blocks(qtype, rows, cols):
    return rows * cols // _TYPE_BYTES[qtype][0]


def _cases(shape, config: Int8MoEConfig, gelu_tanh: bool) -> list[HopperCompile]:
    """The two launches as a GPU call at ``shape`` compiles them (the stacks' bases 16-byte aligned)."""
    _, _, hidden_size, inter, gate_type, down_type = shape
    t13, t2 = _blocks(gate_type, inter, hidden_size), _blocks(down_type, hidden_size, inter)
    stride13 = t13 * _TYPE_BYTES[gate_type][1]
    stride2 = t2 * _TYPE_BYTES[down_type][1]
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    ints13 = dict(H=hidden_size, INTER=inter, T1=t13, T3=t13, stride_xm=hidden_size, stride_w1e=stride13)
    gate_up = HopperCompile(
        "fw_gguf.kernels.moe_int8:_gate_up_kernel",
        {"x_ptr": "*bf16", "w1_ptr": "*u8", "w3_ptr": "*u8", "act_ptr": "*bf16", "ids_ptr": "*i64"},
        dict(
            QTYPE1=int(gate_type),
            QTYPE3=int(gate_type),
            BLOCK_N=config.block_n_gate_up,
            NB=config.blocks_gate_up,
            GELU_TANH=gelu_tanh,
            EMULATE=False,
        ),
        options=options,
        divisible_by_16=("x_ptr", "w1_ptr", "w3_ptr", "act_ptr", *_divisible({**ints13, "stride_w3e": stride13})),
    )
    down = HopperCompile(
        "fw_gguf.kernels.moe_int8:_down_kernel",
        {"act_ptr": "*bf16", "w2_ptr": "*u8", "out_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64"},
        dict(QTYPE=int(down_type), BLOCK_N=config.block_n_down, NB=config.blocks_down, EMULATE=False),
        options=options,
        divisible_by_16=(
            "act_ptr",
            "w2_ptr",
            "out_ptr",
            *_divisible(dict(H=hidden_size, INTER=inter, T=t2, stride_w2e=stride2)),
        ),
    )
    return [gate_up, down]


def test_int8_moe_kernels_compile_for_hopper_with_dp4a_at_the_model_shapes():
    """Every shape of :data:`SHAPES` at the default setting (GeGLU for Gemma 4), Qwen3's also at
    the widest K step and rows: sm_90 PTX that multiplies on ``dp4a`` (no ``mma``), with its quant
    words in 16-byte loads and no byte loads of the quant planes (Q4_K's scale words are 32-bit)."""
    cases, names = [], []
    for name, shape in SHAPES.items():
        cases += _cases(shape, Int8MoEConfig(), gelu_tanh=name.startswith("gemma4"))
        names += [f"{name} gate/up", f"{name} down"]
    wide = Int8MoEConfig(block_n_gate_up=64, block_n_down=64, num_warps=8)
    cases += _cases(SHAPES["qwen3-30b-a3b-Q4_K_M"], wide, gelu_tanh=False)
    names += ["qwen3 wide gate/up", "qwen3 wide down"]
    for name, text in zip(names, compile_for_hopper(cases)):
        assert ".target sm_90" in text and "mma" not in text, name
        assert "dp4a.u32.s32" in text or "dp4a.s32.s32" in text, name
        assert "ld.global.v4.b32" in text or "ld.global.nc.v4.b32" in text, name
        assert "ld.global.b8" not in text and "ld.global.nc.b8" not in text, name


# --- compiled on CUDA ----------------------------------------------------------------------------------------------


def _qwen3(num_tokens: int, random_packed, seed=0):
    experts, top_k, hidden_size, inter, gate_type, down_type = SHAPES["qwen3-30b-a3b-Q4_K_M"]
    stacks = _stacks((gate_type, gate_type, down_type), experts, hidden_size, inter, 0, random_packed, "cuda")
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(seed))
    return stacks, (hidden.to("cuda", torch.bfloat16), *_routing(num_tokens, top_k, experts, seed, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 16])
@pytest.mark.parametrize("activation", [ops.PLAIN_SWIGLU, GEGLU], ids=["swiglu", "geglu"])
def test_compiled_int8_moe_bf16_matches_its_reference_at_the_qwen3_30b_a3b_shape(num_tokens, activation, random_packed):
    """bf16: the kernel's error against the fp32 reference of the same rounding within twice the
    bf16 torch reference's, and the form's result within 5 % of the exact layer's scale."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    (w1, w3, w2), (hidden, weights, ids) = _qwen3(num_tokens, random_packed)
    got = quantized_fused_moe(hidden, w1, w3, w2, weights, ids, activation, config=Int8MoEConfig()).float()
    exact = int8_moe_reference(hidden.float(), w1, w3, w2, weights, ids, activation)
    bf16 = int8_moe_reference(hidden, w1, w3, w2, weights, ids, activation).float()
    scale = exact.abs().max().item()
    errors = [(out - exact).abs().max().item() for out in (got, bf16)]
    assert errors[0] <= 2 * errors[1] + 1e-3 * scale, errors
    layer = ops.quantized_fused_moe(hidden.float(), w1, w3, w2, weights, ids, activation)
    assert (got - layer).abs().max().item() < 0.05 * layer.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_compiled_int8_moe_does_not_sync_replays_in_a_cuda_graph_and_repeats_its_bits(num_tokens, random_packed):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    stacks, inputs = _qwen3(num_tokens, random_packed)
    run = functools.partial(
        lambda w, x, weights, ids: quantized_fused_moe(x, *w, weights, ids, config=Int8MoEConfig()), stacks
    )
    check_no_sync_and_cuda_graph_replay(run, inputs, lambda: _qwen3(num_tokens, random_packed, seed=5)[1])
    assert torch.equal(run(*inputs), run(*inputs))  # deterministic
