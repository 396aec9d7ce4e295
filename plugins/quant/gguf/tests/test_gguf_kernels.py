"""fw_gguf.kernels under the Triton interpreter (fp32; the interpreter computes bf16 wrongly): the
dequantize kernel bit-exact with the torch reference for every type and both layouts, the GEMV and
tensor-core forms of the matmul against dequantize-then-matmul, and the method's per-shard launches;
plus sm_90 compilation of the main variants and the width of their global loads."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from framework.testing import HopperCompile, compile_for_hopper, interpreted, require_triton

require_triton()

from fw_gguf.dequant import dequantize  # noqa: E402
from fw_gguf.kernels import matmul as matmul_module  # noqa: E402
from fw_gguf.kernels import mmq as mmq_module  # noqa: E402
from fw_gguf.kernels.gemv import GEMV_TYPES, GemvConfig, gemv_config, gemv_supported, quantize_x_reference  # noqa: E402
from fw_gguf.kernels.layout import FIELDS, GROUPS, KERNEL_TYPES, from_planar, to_planar  # noqa: E402
from fw_gguf.kernels.matmul import (  # noqa: E402
    GGUFKernelConfig,
    gguf_dequantize,
    gguf_matmul,
    kernel_config,
    matmul_config,
)
from fw_gguf.kernels.mmq import MmqConfig, mmq_takes  # noqa: E402

TYPES = sorted(KERNEL_TYPES, key=int)
# gguf-py quantizes these itself: blocks from an independent packer; the others are random bytes
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)


def _block_size(qtype: Q) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def _weights(qtype: Q, n: int, k: int, seed: int, random_packed) -> torch.Tensor:
    if qtype in QUANTIZABLE:
        rng = np.random.default_rng(seed)
        values = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2, (n, 1))).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(values, qtype))
    return torch.from_numpy(random_packed(qtype, n, k, seed=seed))


def _layout(packed: torch.Tensor, qtype: Q, planar: bool) -> torch.Tensor:
    return to_planar(packed, qtype) if planar else packed.reshape(-1).contiguous()


def _assert_bit_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype == torch.float32 and actual.shape == expected.shape
    assert expected.abs().sum() > 0
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


def test_fields_tile_every_block_and_planar_round_trips(random_packed):
    for qtype, fields in FIELDS.items():
        ends = [start + size for start, size in fields]
        assert [start for start, _ in fields] == [0, *ends[:-1]] and ends[-1] == gguf.GGML_QUANT_SIZES[qtype][1]
        assert GROUPS[qtype][0] * GROUPS[qtype][1] == _block_size(qtype)
        packed = torch.from_numpy(random_packed(qtype, 3, 2 * _block_size(qtype), seed=1))
        planar = to_planar(packed, qtype)
        assert planar.numel() == packed.numel() and not torch.equal(planar, packed.reshape(-1))
        assert torch.equal(from_planar(planar, qtype), packed.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1]))


@interpreted
@pytest.mark.parametrize("planar", [False, True], ids=["gguf", "planar"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_kernel_is_bit_exact_with_the_torch_reference(qtype, planar, random_packed):
    n, k = 19, 3 * _block_size(qtype)  # rows and blocks that do not fill the kernel's tiles
    packed = torch.from_numpy(random_packed(qtype, n, k, seed=int(qtype)))
    expected = dequantize(packed, qtype, (n, k))
    _assert_bit_exact(
        gguf_dequantize(_layout(packed, qtype, planar), qtype, n, k, torch.float32, planar=planar), expected
    )
    out = torch.full((n, k + 5), 7.0)  # into a column slice, as a fused layer's shard
    gguf_dequantize(_layout(packed, qtype, planar), qtype, n, k, torch.float32, planar=planar, out=out[:, 2 : 2 + k])
    _assert_bit_exact(out[:, 2 : 2 + k], expected)
    assert (out[:, :2] == 7).all() and (out[:, 2 + k :] == 7).all()


@interpreted
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matmul_tiles_hold_the_reference_values_exactly(qtype, random_packed):
    """x = the identity (tensor-core tiles) or one of its rows (the elementwise GEMV): the products
    are the weights the fp32 reference dequantizes, value for value (``decode_weights`` rounds
    ``q * scale`` once, as the reference does, then subtracts the offset)."""
    n, k = 8, 256 if _block_size(qtype) == 256 else 64
    packed = torch.from_numpy(random_packed(qtype, n, k, seed=int(qtype) + 40))
    expected = dequantize(packed, qtype, (n, k)).T
    nb = max(1, 256 // _block_size(qtype))
    weight = to_planar(packed, qtype)
    tiles = gguf_matmul(
        torch.eye(k),
        weight,
        qtype,
        n,
        k,
        planar=True,
        config=GGUFKernelConfig(block_m=64, block_n=16, blocks_per_step=nb),
    )
    assert expected.abs().max() > 0 and torch.equal(tiles, expected)
    row = gguf_matmul(
        torch.eye(k)[5:6],
        weight,
        qtype,
        n,
        k,
        planar=True,
        config=GGUFKernelConfig(block_m=1, block_n=16, blocks_per_step=nb),
    )
    assert torch.equal(row, expected[5:6])


def _uses_gemv(qtype, planar, rows, n, k, config) -> bool:
    total_blocks = n * k // _block_size(qtype)
    return (
        isinstance(config, (GemvConfig, MmqConfig))
        or (rows == 1 and planar and config is None and gemv_supported(qtype, k, total_blocks))
        or (config is None and mmq_takes(qtype, rows, k, total_blocks, planar))  # the int8 MMQ: test_gguf_mmq.py
    )


def _check_matmul(qtype, planar, rows, n, k, seed, random_packed, config=None):
    """Against dequantize-then-matmul in fp64; the integer GEMV's against the same of x rounded as
    it rounds x (:func:`quantize_x_reference`, an independent torch form)."""
    packed = _weights(qtype, n, k, seed, random_packed)
    weight = dequantize(packed, qtype, (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x_used = quantize_x_reference(x) if _uses_gemv(qtype, planar, rows, n, k, config) else x
    assert not torch.equal(x_used, x) or x_used is x
    expected = x_used.double() @ weight.double().T
    got = gguf_matmul(x, _layout(packed, qtype, planar), qtype, n, k, planar=planar, config=config)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@interpreted
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 64])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_matmul_matches_dequantize_then_matmul_for_every_row_count(qtype, rows, random_packed):
    # odd N (partial N tile), K = 3 blocks (partial K step for 32-value types); 2+ rows: the int8 MMQ by
    # default, and the bf16 tile kernel (exact in x) when its setting is asked for
    k = 3 * _block_size(qtype) if _block_size(qtype) == 256 else 96
    _check_matmul(qtype, True, rows, 37, k, rows, random_packed)
    if rows > 1:
        _check_matmul(qtype, True, rows, 37, k, rows, random_packed, config=matmul_config(qtype, 37, k, rows))


@interpreted
@pytest.mark.parametrize("qtype", [t for t in TYPES if t not in (Q.Q8_0, Q.Q4_K, Q.Q6_K)], ids=lambda q: q.name)
def test_matmul_of_every_other_type_in_both_forms_and_layouts(qtype, random_packed):
    k = 2 * _block_size(qtype) if _block_size(qtype) == 256 else 288
    for planar in (False, True):
        _check_matmul(qtype, planar, 1, 21, k, int(qtype), random_packed)
        _check_matmul(qtype, planar, 5, 21, k, int(qtype) + 1, random_packed)


@interpreted
@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_split_k_partials_sum_to_the_same_result(split_k, random_packed):
    # 5 blocks over 3 or 8 splits leaves splits with one block or none (they store zeros)
    for block_m in (1, 16):
        config = GGUFKernelConfig(block_m=block_m, block_n=16, blocks_per_step=1, split_k=split_k)
        _check_matmul(Q.Q4_K, True, 2 if block_m > 1 else 1, 23, 5 * 256, split_k, random_packed, config)
        _check_matmul(Q.Q8_0, False, 1, 23, 5 * 32, split_k, random_packed, config)


@interpreted
@pytest.mark.parametrize("planar", [False, True], ids=["gguf", "planar"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda q: q.name)
def test_gemv_with_x_shared_across_rows_matches_dequantize_then_matmul(qtype, planar, random_packed):
    # partial N tile, a partial K step for 32-value types, and K split with an empty split
    nb = 1 if _block_size(qtype) == 256 else 2
    k = 3 * _block_size(qtype)
    for split_k in (1, 4):
        config = GGUFKernelConfig(block_m=1, block_n=16, blocks_per_step=nb, split_k=split_k, shared_x=True)
        _check_matmul(qtype, planar, 1, 21, k, int(qtype) + split_k, random_packed, config)


@interpreted
@pytest.mark.parametrize("qtype", sorted(GEMV_TYPES, key=int), ids=lambda q: q.name)
def test_integer_gemv_in_every_launch_shape(qtype, random_packed):
    """Partial row tiles, superblocks per step that do not divide K (a partial last step) and K
    splits with an empty split; Q8_0 with a block count that is not a whole step."""
    k = 5 * 256 if qtype != Q.Q8_0 else 18 * 32
    for block_n, nb, split_k in ((16, 1, 1), (32, 2, 3), (16, 4, 1), (64, 4, 8)):
        _check_matmul(
            qtype,
            True,
            1,
            37,
            k,
            block_n + nb + split_k,
            random_packed,
            GemvConfig(block_n=block_n, blocks_per_step=nb, split_k=split_k),
        )


@interpreted
def test_one_row_runs_the_integer_gemv_by_default_and_the_exact_one_on_request(random_packed):
    """x rounded to int8 per 32 values differs from x by ~0.5 %: the default one-row path (integer)
    matches the rounded reference, not x's, and a GGUFKernelConfig still selects the exact GEMV;
    the GGUF file layout (not planar) and unaligned Q8_0 planes (odd block count) use the exact one."""
    n, k = 24, 512
    packed = _weights(Q.Q4_K, n, k, 3, random_packed)
    weight = dequantize(packed, Q.Q4_K, (n, k)).double()
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3))
    exact, rounded = x.double() @ weight.T, quantize_x_reference(x).double() @ weight.T
    scale = exact.abs().max()
    assert (exact - rounded).abs().max() > 1e-4 * scale  # the two references are told apart
    default = gguf_matmul(x, to_planar(packed, Q.Q4_K), Q.Q4_K, n, k, planar=True).double()
    assert (default - rounded).abs().max() < 1e-5 * scale
    elementwise = GGUFKernelConfig(block_m=1, block_n=16, blocks_per_step=1)
    for got in (
        gguf_matmul(x, to_planar(packed, Q.Q4_K), Q.Q4_K, n, k, planar=True, config=elementwise),
        gguf_matmul(x, packed.reshape(-1), Q.Q4_K, n, k),
    ):
        assert (got.double() - exact).abs().max() < 1e-5 * scale
    assert not gemv_supported(Q.Q8_0, 96, 37 * 3) and gemv_supported(Q.Q8_0, 96, 36 * 3)


def test_integer_gemv_refuses_what_it_cannot_multiply():
    with pytest.raises(ValueError, match="integer GEMV multiplies one row"):
        gguf_matmul(
            torch.zeros(2, 256), torch.zeros(288, dtype=torch.uint8), Q.Q4_K, 2, 256, planar=True, config=GemvConfig()
        )
    with pytest.raises(ValueError, match="GGUF-layout Q4_K"):
        gguf_matmul(torch.zeros(1, 256), torch.zeros(288, dtype=torch.uint8), Q.Q4_K, 2, 256, config=GemvConfig())
    with pytest.raises(ValueError, match="planar Q4_K, Q6_K, Q8_0 matrix; got 1 rows of a planar Q5_K"):
        gguf_matmul(
            torch.zeros(1, 256), torch.zeros(176, dtype=torch.uint8), Q.Q5_K, 1, 256, planar=True, config=GemvConfig()
        )


def test_integer_gemv_rule_splits_k_for_small_n():
    assert gemv_config(Q.Q4_K, 4096, 4096, 132) == GemvConfig(block_n=64, blocks_per_step=4, split_k=4)
    assert gemv_config(Q.Q4_K, 128256, 4096, 132).split_k == 1
    assert gemv_config(Q.Q6_K, 4096, 14336, 132).split_k == 2  # 256 programs: 2 x 132 at two splits


def test_shared_x_is_refused_outside_the_gemv():
    with pytest.raises(ValueError, match="shared_x is a form of the 1-row GEMV"):
        GGUFKernelConfig(block_m=16, block_n=32, blocks_per_step=1, shared_x=True)


def test_static_config_rule():
    one = matmul_config(Q.Q4_K, 4096, 4096, 1)
    assert (one.block_m, one.blocks_per_step, one.split_k) == (1, 1, 4)  # 128 N blocks x 2 < 264 programs
    assert matmul_config(Q.Q8_0, 4096, 4096, 1).blocks_per_step == 8
    assert matmul_config(Q.Q4_K, 128256, 4096, 1).split_k == 1
    assert matmul_config(Q.Q4_K, 4096, 4096, 8).block_m == 16
    batch = matmul_config(Q.Q4_K, 4096, 4096, 64)  # 128 programs < 132 SMs: split in 2 (8 steps each)
    assert (batch.block_m, batch.block_n, batch.split_k, batch.num_warps) == (64, 32, 2, 8)
    assert matmul_config(Q.Q4_K, 4096, 4096, 16).block_n == 64 and matmul_config(Q.Q4_K, 4096, 4096, 16).num_warps == 4
    big = matmul_config(Q.Q6_K, 28672, 4096, 200)
    assert (big.block_m, big.block_n, big.split_k) == (64, 32, 1)
    assert not any(matmul_config(Q.Q4_K, 4096, 4096, rows).shared_x for rows in (1, 8, 64))  # opt-in


def test_a_tuned_setting_replaces_the_rule_for_its_device_shape_and_rows(monkeypatch):
    tuned = GGUFKernelConfig(block_m=16, block_n=16, blocks_per_step=2, split_k=3)
    monkeypatch.setitem(matmul_module.TUNED, ("cpu", "Q4_K", 4096, 4096, 8), tuned)
    cpu = torch.device("cpu")
    assert [kernel_config(Q.Q4_K, 4096, 4096, rows, cpu) for rows in (2, 8)] == [tuned, tuned]
    assert kernel_config(Q.Q4_K, 4096, 4096, 1, cpu) == matmul_config(Q.Q4_K, 4096, 4096, 1)
    assert kernel_config(Q.Q6_K, 4096, 4096, 8, cpu) == matmul_config(Q.Q6_K, 4096, 4096, 8)


def test_wrong_sizes_and_types_are_refused():
    with pytest.raises(ValueError, match="no GGUF kernel for IQ2_XXS"):
        gguf_matmul(torch.zeros(1, 256), torch.zeros(66, dtype=torch.uint8), Q.IQ2_XXS, 1, 256)
    with pytest.raises(ValueError, match=r"Q4_K \[2, 256\] needs 288 packed bytes"):
        gguf_matmul(torch.zeros(1, 256), torch.zeros(144, dtype=torch.uint8), Q.Q4_K, 2, 256)
    with pytest.raises(ValueError, match="not a whole number of 32-value blocks"):
        gguf_dequantize(torch.zeros(34, dtype=torch.uint8), Q.Q8_0, 1, 40, torch.float32)
    # a 4-bit [262144, 8192] head: its packed bytes fit 32-bit offsets, its 2**31 output values do not
    head = torch.empty(262144 * 8192 // 256 * 144, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="offsets are 32-bit"):
        gguf_dequantize(head, Q.Q4_K, 262144, 8192, torch.bfloat16)
    with pytest.raises(ValueError, match=r"block_m=1\) multiplies one row"):  # it would read row 0 only
        gguf_matmul(
            torch.zeros(3, 256),
            torch.zeros(144, dtype=torch.uint8),
            Q.Q4_K,
            1,
            256,
            config=GGUFKernelConfig(block_m=1, block_n=16, blocks_per_step=1),
        )


MATMUL = "fw_gguf.kernels.matmul:_matmul_kernel"


def _case(
    qtype, block_m, block_n, split_k, planar=True, warps=4, stages=3, out="*bf16", divisible_by_16=(), shared_x=False
):
    groups, size = GROUPS[qtype]
    nb = max(1, 256 // (groups * size))
    return HopperCompile(
        MATMUL,
        {"x_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": "*fp32" if split_k > 1 else out},
        dict(
            QTYPE=int(qtype),
            PLANAR=planar,
            G=groups,
            S=size,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            NB=nb,
            SPLIT_K=split_k,
            SHARED_X=shared_x,
        ),
        options=dict(num_warps=warps, num_stages=stages),
        divisible_by_16=divisible_by_16,
    )


def test_kernels_compile_for_hopper():
    cases = [
        _case(Q.Q4_K, 1, 32, 2),  # the decode GEMV, K split
        _case(Q.Q8_0, 1, 32, 1),
        _case(Q.Q6_K, 16, 32, 1, planar=False),  # 2-8 rows on tensor cores, the file's layout
        _case(Q.IQ4_XS, 64, 32, 1, warps=8, stages=2),  # batch tiles, as the rule launches them
        HopperCompile(
            "fw_gguf.kernels.matmul:_dequantize_kernel",
            {"w_ptr": "*u8", "out_ptr": "*bf16"},
            dict(QTYPE=int(Q.Q3_K), PLANAR=True, G=16, S=16, BLOCK_N=16, NB=1),
            options=dict(num_warps=4, enable_fp_fusion=False),
        ),
        HopperCompile(
            "fw_gguf.kernels.matmul:_sum_splits_kernel",
            {"partial_ptr": "*fp32", "out_ptr": "*bf16"},
            dict(SPLIT_K=4, BLOCK=1024),
            options=dict(num_warps=4),
        ),
    ]
    ptx = compile_for_hopper(cases)
    gemv = compile_for_hopper(
        [
            HopperCompile(
                "fw_gguf.kernels.gemv:_gemv_kernel",
                {"x_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32"},
                dict(QTYPE=int(qtype), BLOCK_N=32, NB=nb, SPLIT=split, EMULATE=False),
                options=dict(num_warps=4, num_stages=2),
                divisible_by_16=ALIGNED_WEIGHT,
            )
            for qtype, nb, split in ((Q.Q4_K, 2, False), (Q.Q6_K, 1, True), (Q.Q8_0, 4, True))
        ]
    )
    for text, split in zip(gemv, (False, True, True)):  # integer dot products, 16-byte weight loads
        assert "dp4a" in text and "ld.global.v4.b32" in text, text[:2000]
        assert ("atom.global.gpu.acq_rel.add" in text) == split  # the last split to arrive adds them
    assert all(".target sm_90" in text for text in ptx)
    assert all("mma" in text for text in ptx[2:4]) and "mma" not in ptx[0]
    assert "fma" not in ptx[4]  # dequantization rounds the product and the offset separately


# What a GPU launch of an aligned planar weight compiles: torch allocations are 256-byte aligned and
# T (blocks in all) is a multiple of 16 for model shapes, and Triton's launcher specializes on both.
# x is left unaligned, so that every 16-byte load in the PTX is one of the weight's.
ALIGNED_WEIGHT = ("w_ptr", "out_ptr", "T", "N", "K")


def _weight_loads(ptx: str) -> dict[str, int]:
    """``{form: count}`` of the global loads in ``ptx``; a ``cp.async`` form says its bytes."""
    counts: dict[str, int] = {}
    for form, operands in re.findall(r"(ld\.global[.\w]*|cp\.async\.c[ag]\.shared\.global)([^;]*);", ptx):
        key = form + (" " + str(int(operands.split(",")[2], 16)) if form.startswith("cp.async") else "")
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_planar_weight_bytes_are_read_with_16_byte_loads():
    """The quant bytes of an aligned planar weight come in ``ld.global.v4.b32`` (the GEMV) or 16-byte
    ``cp.async`` (the tensor-core tiles): none byte by byte. The GEMV's count is at least the
    quant bytes each of its 128 threads reads (Q6_K reads each ql / qh byte once per element it
    holds, so twice or four times that)."""
    types = (Q.Q8_0, Q.Q4_K, Q.Q6_K)
    quant_bytes = {Q.Q8_0: 32 * 8 * 32, Q.Q4_K: 32 * 128, Q.Q6_K: 32 * 192}  # BLOCK_N rows x NB blocks
    cases = [_case(t, 1, 32, 1, divisible_by_16=ALIGNED_WEIGHT) for t in types]
    cases += [_case(t, 16, 32, 1, divisible_by_16=ALIGNED_WEIGHT) for t in types]
    ptx = compile_for_hopper(cases)
    for qtype, gemv, dot in zip(types, ptx[:3], ptx[3:]):
        gemv_loads, dot_loads = _weight_loads(gemv), _weight_loads(dot)
        assert "ld.global.b8" not in gemv_loads and "ld.global.b8" not in dot_loads, (qtype.name, gemv_loads, dot_loads)
        assert gemv_loads.get("ld.global.v4.b32", 0) >= quant_bytes[qtype] // 128 // 16, (qtype.name, gemv_loads)
        assert dot_loads.get("cp.async.cg.shared.global 16", 0) >= quant_bytes[qtype] // 2 // 128 // 16, (
            qtype.name,
            dot_loads,
        )


def test_alignment_facts_must_name_kernel_arguments():
    with pytest.raises(ValueError, match=r"has no arguments \['w'\] to compile as multiples of 16"):
        compile_for_hopper([_case(Q.Q8_0, 1, 32, 1, divisible_by_16=("w",))])


def test_shared_x_gemv_reads_x_once_per_program():
    """With x aligned too, the per-row GEMV reads x in each row's threads (8 more 16-byte loads a
    thread than the weight's alone), the shared form once per program (at most 4 bytes a thread),
    through shared memory; the weight's 16-byte loads are the same in both."""
    types = (Q.Q8_0, Q.Q4_K, Q.Q6_K)
    aligned = ALIGNED_WEIGHT + ("x_ptr",)
    ptx = compile_for_hopper(
        [
            _case(t, 1, 32, 1, divisible_by_16=d, shared_x=shared)
            for shared, d in ((False, ALIGNED_WEIGHT), (False, aligned), (True, aligned))
            for t in types
        ]
    )
    for index, qtype in enumerate(types):
        weight_only, per_row, shared = (_weight_loads(ptx[index + 3 * form]) for form in range(3))
        wide = weight_only["ld.global.v4.b32"]
        assert per_row["ld.global.v4.b32"] == wide + 8, (qtype.name, weight_only, per_row)  # 256 x 32 bf16 / 128
        assert shared["ld.global.v4.b32"] == wide and shared.get("ld.global.b32", 0) >= 1, (qtype.name, shared)
        assert "st.shared" in ptx[index + 6]


@interpreted
def test_method_merges_same_type_shards_and_launches_once_per_group(gemma3_gguf_path, monkeypatch):
    """Gemma 3's qkv_proj (Q4_K q and k beside a different v type) through the method's kernel
    path, in the file's layout and after the GPU's load-time merge of q and k into one planar
    matrix, against dequantize-then-matmul; the file's bytes stay recoverable shard by shard."""
    from fw_gguf import method

    from framework import LLM

    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")
    model = LLM(str(gemma3_gguf_path), num_blocks=16).engine.core.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    types = [t.name for t in qkv.gguf_types]
    assert types[0] == types[1] != types[2], types
    expected_weight = qkv.linear_method.dequantized(qkv, torch.float32)
    x = torch.randn(2, 1, qkv.gguf_in_features, generator=torch.Generator().manual_seed(0))
    expected = (x.double() @ expected_weight.double().T).float()
    tol = dict(rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    launches = []
    real = matmul_module.gguf_matmul
    monkeypatch.setattr(
        matmul_module,
        "gguf_matmul",
        lambda x, w, qtype, n, *a, **kw: launches.append(n) or real(x, w, qtype, n, *a, **kw),
    )
    torch.testing.assert_close(method.linear_packed(qkv, x), expected, **tol)
    assert launches == qkv.gguf_rows  # one per shard in the file's layout
    file_bytes = [getattr(qkv, f"gguf_weight_{i}").clone() for i in range(3)]
    # the tile kernel, exact in x (planar Q8_0 / Q4_K / Q6_K take the int8 MMQ by default: test_gguf_mmq.py)
    monkeypatch.setattr(mmq_module, "MMQ_ENABLED", False)
    qkv.linear_method._to_kernel_layout(qkv)
    assert qkv.gguf_groups == [(0, 2), (2, 3)] and qkv.gguf_planar == [True] * 3 and qkv.gguf_weight_1 is None
    assert qkv.gguf_weight_0.shape == (qkv.gguf_rows[0] + qkv.gguf_rows[1], file_bytes[0].shape[1])
    assert all(torch.equal(qkv.linear_method.file_blocks(qkv, i), file_bytes[i]) for i in range(3))
    assert torch.equal(qkv.linear_method.dequantized(qkv, torch.float32), expected_weight)
    launches.clear()
    torch.testing.assert_close(method.linear_packed(qkv, x), expected, **tol)
    assert launches == [qkv.gguf_rows[0] + qkv.gguf_rows[1], qkv.gguf_rows[2]]
    monkeypatch.setattr(method, "DEQUANTIZE_MIN_ROWS", 2)  # the dequantize-then-cuBLAS form
    torch.testing.assert_close(method.linear_packed(qkv, x), expected, **tol)
