"""The one-row FP4 kernels on integer dot products (``fw_fp4.kernels.fp4_gemv``, ``fp4_moe_gemv``)
against dequantize-then-matmul of the packer's exact values times x rounded as the kernels round
it (``quantize_x_reference``): the word-dot PTX run by a small PTX interpreter against the format's
decode; the kernels under the Triton interpreter (its ``prmt`` / ``dp4a`` emulation) for NVFP4
and MXFP4, split K, ragged outputs, K past a step, gpt-oss's biased clamped SwiGLU; compiled for
sm_90 through ptxas at every launch setting of the Llama-3-8B, gpt-oss-20b and Qwen3-30B-A3B
shapes; on CUDA at those shapes."""

from __future__ import annotations

import pytest
import torch
from test_fp4_linear_kernels import LLAMA3_8B, llama3_8b_weight, mxfp4_weight, nvfp4_weight
from test_mxfp4_kernels import gpt_oss_activation, mxfp4_experts, routed_inputs
from test_nvfp4_moe_kernels import nvfp4_experts

from framework import ops
from framework.ops import MoEActivation
from framework.testing import HopperCompile, compile_for_hopper, interpreted, require_triton

require_triton()

from fw_fp4.formats import decode_e2m1  # noqa: E402
from fw_fp4.kernels.fp4_gemv import int8_gemv_config  # noqa: E402
from fw_fp4.kernels.fp4_linear import fp4_matmul  # noqa: E402
from fw_fp4.kernels.fp4_moe import quantized_fused_moe  # noqa: E402
from fw_fp4.kernels.fp4_moe_gemv import ONE_TOKEN_TILES, one_token_moe, one_token_reference  # noqa: E402
from fw_fp4.kernels.int8_dot import WORD_DOT_PTX, quantize_x_reference  # noqa: E402


def run_ptx(text: str, inputs: list[int]) -> int:
    """Execute ``text`` (the mov / and / or / shr / prmt / dp4a subset, PTX semantics) on 32-bit
    ``inputs`` ``$1..``; returns ``$0``."""
    regs = {f"${i + 1}": v & 0xFFFFFFFF for i, v in enumerate(inputs)}

    def value(operand: str) -> int:
        return int(operand, 0) & 0xFFFFFFFF if operand[0].isdigit() else regs[operand]

    def signed_bytes(word: int) -> list[int]:
        return [((word >> (8 * i)) & 255) - 256 * ((word >> (8 * i + 7)) & 1) for i in range(4)]

    for line in text.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        d, *src = [s.strip() for s in rest.split(",")]
        v = [value(s) for s in src]
        if op == "mov.b32":
            out = v[0]
        elif op == "and.b32":
            out = v[0] & v[1]
        elif op == "or.b32":
            out = v[0] | v[1]
        elif op == "shr.u32":
            out = v[0] >> v[1]
        elif op == "prmt.b32":  # the default mode: selector nibble bit 3 replicates the byte's sign
            source = [((v[1] << 32 | v[0]) >> (8 * i)) & 255 for i in range(8)]
            out = 0
            for i in range(4):
                select = (v[2] >> (4 * i)) & 15
                byte = source[select & 7]
                if select & 8:
                    byte = 255 if byte & 128 else 0
                out |= byte << (8 * i)
        elif op == "dp4a.s32.s32":
            total = sum(p * q for p, q in zip(signed_bytes(v[0]), signed_bytes(v[1]))) + v[2] - (v[2] >> 31 << 32)
            out = total & 0xFFFFFFFF
        else:
            raise AssertionError(f"run_ptx: {op}")
        regs[d] = out
    result = regs["$0"]
    return result - (result >> 31 << 32)


def test_the_word_dot_ptx_multiplies_every_code_by_twice_its_e2m1_value():
    generator = torch.Generator().manual_seed(0)
    twice = (decode_e2m1(torch.arange(16)).float() * 2.0**15).round().long().tolist()  # 2 e2m1, exact
    assert twice[:8] == [0, 1, 2, 3, 4, 6, 8, 12] and twice[8:] == [-t for t in twice[:8]]
    words = [0x76543210, 0xFEDCBA98, 0x89ABCDEF] + torch.randint(0, 2**32, (40,), generator=generator).tolist()
    for word in words:
        x = torch.randint(-127, 128, (8,), generator=generator).tolist()
        x_lo, x_hi = (sum((q & 255) << (8 * i) for i, q in enumerate(x[j : j + 4])) for j in (0, 4))
        expected = sum(twice[(word >> (4 * i)) & 15] * x[i] for i in range(8))
        assert run_ptx(WORD_DOT_PTX.value, [word, x_lo, x_hi]) == expected, hex(word)


def expected_one_row(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    return (quantize_x_reference(x).double() @ dense.double().T).float()


def int8(block_n, step, split_k, warps=1):
    return {"KIND": "int8", "BLOCK_N": block_n, "STEP": step, "SPLIT_K": split_k, "num_warps": warps}


#: (format, N, K, config): ragged N, split K (uneven splits), K past the last step, one step.
DENSE_CASES = [
    ("nvfp4", 200, 512, int8(128, 128, 2)),
    ("nvfp4", 136, 160, int8(64, 64, 4)),
    ("mxfp4", 136, 96, int8(128, 64, 1)),
    ("mxfp4", 72, 384, int8(64, 128, 3)),
]


@interpreted
@pytest.mark.parametrize("fmt,n,k,config", DENSE_CASES, ids=[f"{f}-{n}x{k}" for f, n, k, _ in DENSE_CASES])
def test_interpreted_int8_gemv_matches_dequantize_then_matmul_of_rounded_x(fmt, n, k, config):
    weight, dense = nvfp4_weight(n, k, "divide", seed=n + k) if fmt == "nvfp4" else mxfp4_weight(n, k, seed=n)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k))
    out = fp4_matmul(x, weight, config)
    assert out.shape == (1, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected_one_row(x, dense), rtol=1e-5, atol=1e-4)
    assert (quantize_x_reference(x) != x).any()  # the rounding the reference models is real


@interpreted
def test_one_row_takes_the_int8_gemv_where_fw_fp4_gemv_says(monkeypatch):
    weight, dense = nvfp4_weight(96, 256, "multiply", seed=1)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2))
    exact = (x.double() @ dense.double().T).float()
    torch.testing.assert_close(fp4_matmul(x, weight), exact, rtol=1e-5, atol=1e-4)  # the interpreter's default
    monkeypatch.setenv("FW_FP4_GEMV", "int8")
    rounded = fp4_matmul(x, weight)
    torch.testing.assert_close(rounded, expected_one_row(x, dense), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(rounded, exact, rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("FW_FP4_GEMV", "fast")
    with pytest.raises(ValueError, match="valid: int8, exact"):
        fp4_matmul(x, weight)


def test_the_int8_rule_splits_k_until_the_warps_cover_the_sms():
    assert int8_gemv_config(4096, 4096, 132) == int8(128, 128, 16)  # 32 blocks of 1 warp: 16 splits of 2 steps
    assert int8_gemv_config(28672, 4096, 132) == int8(512, 128, 8, 4)  # 56 blocks of 4 warps
    assert int8_gemv_config(4096, 14336, 132)["SPLIT_K"] == 32  # at most 32
    assert int8_gemv_config(128256, 4096, 132)["SPLIT_K"] == 2  # 251 blocks of 4 warps


def moe_case(fmt, gpt_oss, shape, seed, device="cpu", dtype=torch.float32):
    num_experts, top_k, hidden_size, width = shape
    generator = torch.Generator().manual_seed(seed)
    if fmt == "mxfp4":
        packed, _ = mxfp4_experts(num_experts, hidden_size, width, generator, device)
    else:
        packed, _ = nvfp4_experts(num_experts, hidden_size, width, "multiply", generator, device)
    hidden, topk_weights, topk_ids = routed_inputs(1, num_experts, top_k, hidden_size, generator, dtype, device)
    activation = MoEActivation()
    if gpt_oss:
        activation = gpt_oss_activation(num_experts, hidden_size, width, generator, device, dtype)
        activation = activation._replace(swiglu_limit=7.0, swiglu_alpha=1.702)
    return hidden, packed, topk_weights, topk_ids, activation


#: (format, gpt-oss activation, (experts, top_k, hidden, width), tiles): several K steps, a ragged
#: last step and block of rows, NVFP4's two scale groups an x group.
MOE_CASES = [
    ("mxfp4", True, (8, 2, 160, 96), {"BLOCK_N": 32, "STEP": 64}),
    ("mxfp4", False, (4, 2, 96, 64), {"BLOCK_N": 64, "STEP": 128}),
    ("nvfp4", False, (4, 3, 128, 64), {"BLOCK_N": 64, "STEP": 64}),
]


@interpreted
@pytest.mark.parametrize("fmt,gpt_oss,shape,tiles", MOE_CASES, ids=[f"{c[0]}-{'gpt_oss' * c[1]}" for c in MOE_CASES])
def test_interpreted_one_token_moe_matches_its_reference(fmt, gpt_oss, shape, tiles):
    hidden, packed, topk_weights, topk_ids, activation = moe_case(fmt, gpt_oss, shape, seed=sum(shape))
    out = one_token_moe(hidden, *packed, topk_weights, topk_ids, activation, tiles=tiles)
    expected = one_token_reference(hidden, *packed, topk_weights, topk_ids, activation)
    scale = expected.abs().max().item()
    assert scale > 0.1
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * scale)
    # the reference differs from the op's (x not rounded) by the activations' 8-bit rounding only
    exact = ops.quantized_fused_moe(hidden, *packed, topk_weights, topk_ids, activation)
    torch.testing.assert_close(expected, exact, rtol=0, atol=3e-2 * scale)


@interpreted
def test_one_token_takes_the_int8_kernels_where_fw_fp4_gemv_says(monkeypatch):
    hidden, packed, topk_weights, topk_ids, activation = moe_case("mxfp4", True, (4, 2, 64, 64), seed=9)
    monkeypatch.setenv("FW_FP4_GEMV", "int8")
    out = quantized_fused_moe(hidden, *packed, topk_weights, topk_ids, activation)
    expected = one_token_reference(hidden, *packed, topk_weights, topk_ids, activation)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


# --- sm_90 compiles -------------------------------------------------------------------------------

DENSE_POINTERS = {
    "x_ptr": "*bf16",
    "codes_ptr": "*i32",
    "scales_ptr": "*u8",
    "row_scales_ptr": "*fp32",
    "out_ptr": "*bf16",
    "partial_ptr": "*fp32",
    "counter_ptr": "*i32",
}
#: Llama-3-8B's layers and gpt-oss-20b's / Qwen3-30B-A3B's dense ones (q/k/v/o at their shapes).
DENSE_SHAPES = {**LLAMA3_8B, "head": (128256, 4096), "gpt_oss_qkv": (5120, 2880), "gpt_oss_o": (2880, 4096)}


def dense_compile_cases() -> list[HopperCompile]:
    cases, seen = [], set()
    for (n, k), fmt in [(shape, fmt) for shape in DENSE_SHAPES.values() for fmt in ("nvfp4", "mxfp4")]:
        config = int8_gemv_config(n, k, 132)
        key = (fmt, config["BLOCK_N"], config["num_warps"], config["SPLIT_K"] > 1, n % 16 == 0 and k % 16 == 0)
        if key in seen:
            continue
        seen.add(key)
        divisible = [p for p in DENSE_POINTERS] + [name for name, v in (("N", n), ("K", k)) if v % 16 == 0]
        cases.append(
            HopperCompile(
                "fw_fp4.kernels.fp4_gemv:fp4_int8_gemv_kernel",
                DENSE_POINTERS,
                {
                    "GROUP": 16 if fmt == "nvfp4" else 32,
                    "E8M0": fmt == "mxfp4",
                    "HAS_ROW_SCALES": fmt == "nvfp4",
                    "STEP": config["STEP"],
                    "BLOCK_N": config["BLOCK_N"],
                    "SPLIT": config["SPLIT_K"] > 1,
                    "EMULATE": False,
                },
                options={"num_warps": config["num_warps"], "num_stages": 2},
                divisible_by_16=tuple(divisible),
            )
        )
    return cases


#: (name, format, experts, top_k, hidden, width, gpt-oss activation)
MOE_SHAPES = [
    ("gpt-oss-20b", "mxfp4", 32, 4, 2880, 2880, True),
    ("qwen3-30b-a3b", "nvfp4", 128, 8, 2048, 768, False),
    ("qwen3-30b-a3b", "mxfp4", 128, 8, 2048, 768, False),
]


def moe_compile_cases() -> list[HopperCompile]:
    cases = []
    for _, fmt, _, _, hidden, width, gpt_oss in MOE_SHAPES:
        group = 16 if fmt == "nvfp4" else 32
        tiles = dict(ONE_TOKEN_TILES)
        options = {"num_warps": tiles.pop("num_warps"), "num_stages": tiles.pop("num_stages")}
        meta = {**tiles, "GROUP": group, "E8M0": fmt == "mxfp4", "HAS_GLOBAL": fmt == "nvfp4", "EMULATE": False}
        global_type = "*fp32" if fmt == "nvfp4" else "*u8"
        gate_up = {
            **{p: "*u8" for p in ("gate_ptr", "up_ptr", "gate_s_ptr", "up_s_ptr")},
            "x_ptr": "*bf16",
            "gate_g_ptr": global_type,
            "up_g_ptr": global_type,
            "bias_ptr": "*bf16",
            "act_ptr": "*bf16",
            "ids_ptr": "*i32",
        }
        gate_up_ints = {
            "HIDDEN": hidden,
            "INTER": width,
            "stride_we": width * hidden,  # w13's rows: 2 width x hidden / 2 bytes
            "stride_wn": hidden // 2,
            "stride_se": 2 * width * hidden // group,
            "stride_sn": hidden // group,
        }
        down = {
            "act_ptr": "*bf16",
            "w_ptr": "*u8",
            "s_ptr": "*u8",
            "g_ptr": global_type,
            "bias_ptr": "*bf16",
            "out_ptr": "*fp32",
            "weights_ptr": "*fp32",
            "ids_ptr": "*i32",
        }
        down_ints = {
            "HIDDEN": hidden,
            "INTER": width,
            "stride_we": hidden * width // 2,
            "stride_wn": width // 2,
            "stride_se": hidden * width // group,
            "stride_sn": width // group,
        }
        for kernel, pointers, ints, extra in (
            ("_one_token_gate_up_kernel", gate_up, gate_up_ints, {"HAS_BIAS": gpt_oss, "SWIGLU_OAI": gpt_oss}),
            ("_one_token_down_kernel", down, down_ints, {"HAS_BIAS": gpt_oss}),
        ):
            cases.append(
                HopperCompile(
                    f"fw_fp4.kernels.fp4_moe_gemv:{kernel}",
                    pointers,
                    {**meta, **extra},
                    float_args=("swiglu_alpha", "swiglu_limit") if "gate_up" in kernel else (),
                    options=options,
                    divisible_by_16=(*pointers, *(name for name, v in ints.items() if v % 16 == 0)),
                )
            )
    return cases


def test_the_one_row_kernels_compile_for_hopper_with_prmt_and_dp4a():
    cases = dense_compile_cases() + moe_compile_cases()
    ptx = compile_for_hopper(cases)
    assert len(ptx) == len(cases)
    for case, text in zip(cases, ptx):
        assert ".target sm_90" in text, case.kernel
        assert "prmt.b32" in text and "dp4a.s32.s32" in text, case.kernel


# --- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layer", sorted(LLAMA3_8B))
def test_cuda_int8_gemv_matches_dequantize_then_matmul_of_rounded_x_at_llama3_8b_shapes(layer):
    weight, dense = llama3_8b_weight(layer)
    x = torch.randn(1, weight.in_features, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    expected = expected_one_row(x.float(), dense)
    out = fp4_matmul(x, weight)  # the CUDA default for one row
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=2e-3 * expected.abs().max().item())
    for config in (int8(128, 128, 1), int8(512, 256, 4, 4), int8(256, 64, 8, 2)):
        got = fp4_matmul(x, weight, config).float()
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=2e-3 * expected.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("name,fmt,experts,top_k,hidden_size,width,gpt_oss", MOE_SHAPES)
def test_cuda_one_token_moe_matches_its_reference(name, fmt, experts, top_k, hidden_size, width, gpt_oss):
    shape = (min(experts, 16), top_k, hidden_size, width)  # 16 experts: the packer's time on the host
    hidden, packed, topk_weights, topk_ids, activation = moe_case(fmt, gpt_oss, shape, 0, "cuda", torch.bfloat16)
    out = quantized_fused_moe(hidden, *packed, topk_weights, topk_ids, activation)  # the CUDA default for one token
    expected = one_token_reference(hidden, *packed, topk_weights, topk_ids, activation)
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=1e-2 * scale)
