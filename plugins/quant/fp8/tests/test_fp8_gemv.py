"""The W8A8 block GEMM's decode path: split-K on few rows, its deterministic sum, the settings its
rule and table give at real layer shapes, and every one of them compiled for sm_90.

Under the Triton interpreter (fp32) the kernel, split or not, equals the float32 product of the
quantized activations (the torch reference of the 1x128 group quantizer) and the dequantized weight,
for block (per 128-row block and per output feature), channel and tensor weights, including K that
ends inside a group and splits that do not divide the groups evenly; quantizing the activations
inside the GEMM (the decode rows' default) equals the quantizer kernel run before it."""

from __future__ import annotations

import itertools

import pytest
import torch
from fp8_reference import quantize_reference, random_weight

from framework.testing import HopperCompile, compile_for_hopper, interpreted, require_triton

require_triton()

from fw_fp8.kernels.dispatch import w8a8_settings  # noqa: E402
from fw_fp8.kernels.layout import Fp8Weight, dequantize_fp8_weight  # noqa: E402
from fw_fp8.kernels.splits import sum_splits  # noqa: E402
from fw_fp8.kernels.w8a8_block import (  # noqa: E402
    GEMV_MAX_ROWS,
    GROUP,
    MIN_AMAX,
    ONE_SCALE_COLUMN,
    UNSPECIALIZED,
    choose_config,
    quantize_activations,
    quantize_activations_kernel,
    quantize_activations_reference,
    split_groups,
    w8a8_block_matmul,
)
from fw_fp8.quantize import FP8_MAX  # noqa: E402

#: The FP8-quantized linear layers (N, K) of one rank at TP 1: Llama-3-8B's fused qkv, o, fused
#: gate_up, down and LM head; Qwen3-30B-A3B's fused qkv, o and LM head (its experts run fused_moe).
LAYER_SHAPES = {
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)],
    "qwen3-30b-a3b": [(5120, 2048), (2048, 4096), (151936, 2048)],
}
H200 = ("NVIDIA H200", 132)


def fp8_weight(n: int, k: int, granularity: str, per_feature_rows: bool = False, seed: int = 0) -> Fp8Weight:
    q, scale = quantize_reference(random_weight(n, k, torch.Generator().manual_seed(seed)), granularity)
    if granularity == "block":
        if per_feature_rows:
            return Fp8Weight(q, scale.repeat_interleave(128, 0)[:n].contiguous(), 1, 128)
        return Fp8Weight(q, scale, 128, 128)
    return Fp8Weight(q, scale.reshape(-1, 1).expand(n, 1).contiguous(), 1, k)


def reference(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    q, s = quantize_activations_reference(x)
    x_values = q.float() * s.repeat_interleave(GROUP, 1)[:, : x.shape[1]]
    return x_values @ dequantize_fp8_weight(weight, torch.float32).t()


CASES = [  # (n, k, granularity, per-feature scale rows, rows)
    (96, 640, "block", False, 1),  # 5 groups: splits of 3 + 2, 2 + 2 + 1
    (160, 384, "block", True, 3),
    (64, 600, "block", False, 2),  # K ends inside the fifth group
    (128, 512, "channel", False, 1),
    (96, 768, "tensor", False, 5),
]


@interpreted
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}-k{c[1]}-{c[2]}{'-rows1' if c[3] else ''}-m{c[4]}")
def test_split_k_gemv_equals_the_product_of_quantized_operands(case):
    n, k, granularity, per_feature, rows = case
    weight = fp8_weight(n, k, granularity, per_feature, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = reference(x, weight)
    base = {"BLOCK_M": 16, "BLOCK_N": 32, "FUSED_QUANT": False, "num_warps": 4, "num_stages": 2}
    for split_k in (1, 2, 4):
        out = w8a8_block_matmul(x, weight, config={**base, "SPLIT_K": split_k})
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4, msg=f"SPLIT_K={split_k}")
    rule = {**choose_config(rows, n, k), "FUSED_QUANT": False}
    torch.testing.assert_close(w8a8_block_matmul(x, weight, config=rule), expected, rtol=1e-4, atol=1e-4)


def interpreted_quantizer_reference(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """The product with the activations quantized by the (interpreted) Triton quantizer kernel: the
    interpreter's float -> FP8 conversion mis-rounds some values (0.49 -> 0.25), and a kernel quantizing
    its own tiles under the interpreter rounds the same way; on the GPU both equal the torch reference."""
    m, k = x.shape
    groups = -(-k // GROUP)
    q, s = torch.empty(m, k, dtype=torch.float8_e4m3fn), torch.empty(m, groups)
    quantize_activations_kernel[(m, groups)](
        x, q, s, k, x.stride(0), groups, GROUP=GROUP, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX
    )
    x_values = q.float() * s.repeat_interleave(GROUP, 1)[:, :k]
    return x_values @ dequantize_fp8_weight(weight, torch.float32).t()


@interpreted
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"n{c[0]}-k{c[1]}-{c[2]}-m{c[4]}")
def test_fused_activation_quantization_equals_the_quantizer_kernel(case):
    n, k, granularity, per_feature, rows = case
    weight = fp8_weight(n, k, granularity, per_feature, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * torch.logspace(-2, 1, k)
    expected = interpreted_quantizer_reference(x, weight)
    for split_k in (1, 3):
        config = {"BLOCK_M": 16, "BLOCK_N": 32, "SPLIT_K": split_k, "FUSED_QUANT": True, "num_stages": 2}
        torch.testing.assert_close(w8a8_block_matmul(x, weight, config=config), expected, rtol=1e-4, atol=1e-4)
    assert choose_config(rows, n, k)["FUSED_QUANT"]  # the decode rows fuse by default
    torch.testing.assert_close(w8a8_block_matmul(x, weight), expected, rtol=1e-4, atol=1e-4)


@interpreted
def test_split_sums_add_in_order_and_round_once():
    partial = torch.randn(3, 2, 1500, generator=torch.Generator().manual_seed(7))
    out = sum_splits(partial, torch.empty(2, 1500))
    assert torch.equal(out, (partial[0] + partial[1]) + partial[2])  # the fixed order, bit for bit


@pytest.mark.parametrize("model", LAYER_SHAPES)
def test_decode_settings_fill_the_sms_and_split_only_small_n(model):
    device_name, sms = H200
    for n, k in LAYER_SHAPES[model]:
        setting = choose_config(1, n, k, sms, device_name)
        blocks = -(-n // setting["BLOCK_N"])
        assert blocks * split_groups(-(-k // GROUP), setting["SPLIT_K"])[1] >= sms, (n, k, setting)  # all SMs stream
        if blocks >= 2 * sms:
            assert setting["SPLIT_K"] == 1, (n, k, setting)  # enough programs: no partial sums to add


def _divisible(args: dict[str, int], pointers: tuple[str, ...]) -> tuple[str, ...]:
    """What Triton's launcher marks divisible by 16: the (16-byte aligned) pointers and the integer
    arguments whose values are multiples of 16."""
    return (*pointers, *(name for name, value in args.items() if value % 16 == 0))


def _w8a8_case(n: int, k: int, rows: int, setting: dict, scale: tuple[int, int]) -> HopperCompile:
    setting = dict(setting)
    options = {"num_warps": setting.pop("num_warps"), "num_stages": setting.pop("num_stages")}
    groups = -(-k // GROUP)
    groups_per_split, split_k = split_groups(groups, setting.pop("SPLIT_K"))
    fused = setting.pop("FUSED_QUANT", rows <= GEMV_MAX_ROWS)  # the launcher's default
    ints = {
        "M": rows,
        "N": n,
        "K": k,
        "stride_am": k,
        "stride_om": n,
        "stride_os": rows * n,
        "stride_sn": -(-k // scale[1]) if scale[1] != ONE_SCALE_COLUMN else 1,
        "num_groups": groups,
        "groups_per_split": groups_per_split,
    }
    pointers = ("a_ptr", "a_scale_ptr", "w_ptr", "scale_ptr", "out_ptr")
    return HopperCompile(
        "fw_fp8.kernels.w8a8_block:w8a8_block_matmul_kernel",
        {
            "a_ptr": "*bf16" if fused else "*fp8e4nv",  # fused: the kernel quantizes x itself
            "a_scale_ptr": "*bf16" if fused else "*fp32",  # (then unread: the launcher passes x)
            "w_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32",
            "out_ptr": "*fp32" if split_k > 1 else "*bf16",  # split-K stores float32 partial sums
        },
        {
            "SCALE_ROWS": scale[0],
            "SCALE_COLS": scale[1],
            "BLOCK_K": GROUP,
            "FUSED_QUANT": fused,
            "FP8_MAX": FP8_MAX,
            "MIN_AMAX": MIN_AMAX,
            **setting,
        },
        options=options,
        divisible_by_16=_divisible({name: v for name, v in ints.items() if name not in UNSPECIALIZED}, pointers),
    )


def hopper_cases() -> list[HopperCompile]:
    """Every distinct W8A8 block variant the dispatch launches at the layer shapes (channel and
    per-feature scales at the decode settings), the split sum and the activation quantizer."""
    device_name, sms = H200
    variants = {}
    for n, k in (shape for shapes in LAYER_SHAPES.values() for shape in shapes):
        for setting in w8a8_settings(n, k, sms, device_name):
            rows = setting["BLOCK_M"] if setting["BLOCK_M"] > 16 else 1
            # block scales for every setting; per-feature block rows and channel scales (only index
            # arithmetic differs) for the decode settings, to keep the test within seconds
            scales = ((128, 128), (1, 128), (1, ONE_SCALE_COLUMN)) if rows == 1 else ((128, 128),)
            for scale in scales:
                case = _w8a8_case(n, k, rows, setting, scale)
                key = (
                    tuple(sorted(case.constexprs.items())),
                    tuple(sorted(case.options.items())),
                    tuple(sorted(case.pointer_types.items())),
                )
                variants.setdefault(key, case)
    split_sum = HopperCompile(  # the split count is a launch argument: one variant for every split
        "fw_fp8.kernels.splits:sum_splits_kernel",
        {"partial_ptr": "*fp32", "out_ptr": "*bf16"},
        {"BLOCK": 1024},
        options={"num_warps": 4},
        divisible_by_16=("partial_ptr", "out_ptr", "N", "stride_ps", "stride_pm", "stride_om"),
    )
    quantizer = HopperCompile(  # more rows than GEMV_MAX_ROWS quantize once, before the GEMM
        "fw_fp8.kernels.w8a8_block:quantize_activations_kernel",
        {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
        {"GROUP": GROUP, "FP8_MAX": FP8_MAX, "MIN_AMAX": MIN_AMAX},
        options={"num_warps": 4},
        divisible_by_16=("x_ptr", "q_ptr", "s_ptr", "K", "stride_xm", "num_groups"),
    )
    return [*variants.values(), split_sum, quantizer]


@pytest.mark.slow
def test_every_dispatched_w8a8_setting_compiles_for_sm90():
    cases = hopper_cases()
    ptx = compile_for_hopper(cases)
    assert len(ptx) == len(cases)
    for case, text in zip(cases, ptx, strict=True):
        assert ".target sm_90" in text
        if case.kernel.endswith("w8a8_block_matmul_kernel"):
            assert "mma" in text and "e4m3" in text, case  # FP8 operands into tensor-core mma


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 14336), (2048, 4096)])
@pytest.mark.parametrize("granularity", ["block", "channel"])
def test_decode_gemv_on_the_gpu_is_deterministic_and_replays_in_a_cuda_graph(n, k, granularity):
    """bf16, one row, small-N shapes. At one quantization, every split sums the same product: the
    quantizer kernel's codes through the unfused GEMM unsplit, split 4 ways and at the dispatched
    setting, and the fused quantization's codes (read back as ``test_fp8_quantizer_codes`` does)
    through the fused GEMM unsplit and split, each equal the float64 product of those codes and the
    dequantized weight up to fp32 summation order and the bf16 rounding. (The two quantizations may
    differ by a code at near-ties: ``test_fp8_quantizer_codes`` bounds that.) The same bits on every
    call; no host sync, and the same result replayed from a CUDA graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from fp8_codes import assert_sums_the_product, fused_quantization, product

    from framework.testing import check_no_sync_and_cuda_graph_replay

    weight = fp8_weight(n, k, granularity, seed=3)
    dense = dequantize_fp8_weight(weight, torch.float32)
    weight = Fp8Weight(weight.qweight.cuda(), weight.scale.cuda(), weight.scale_rows, weight.scale_cols)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    setting = choose_config(1, n, k, torch.cuda.get_device_properties(0).multi_processor_count, "NVIDIA H200")
    quantized = {False: product(*quantize_activations(x), dense), True: product(*fused_quantization(x), dense)}
    for fused, split_k in itertools.product((False, True), (1, 4)):
        out = w8a8_block_matmul(x, weight, config={**setting, "SPLIT_K": split_k, "FUSED_QUANT": fused})
        assert_sums_the_product(out, quantized[fused], f"FUSED_QUANT={fused}, SPLIT_K={split_k}")
    out = w8a8_block_matmul(x, weight)
    assert_sums_the_product(out, quantized[setting["FUSED_QUANT"]], f"dispatched {setting}")
    assert all(torch.equal(out, w8a8_block_matmul(x, weight)) for _ in range(3))
    check_no_sync_and_cuda_graph_replay(lambda x: w8a8_block_matmul(x, weight), [x], lambda: [torch.randn_like(x)])
