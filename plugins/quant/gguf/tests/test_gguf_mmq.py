"""fw_gguf.kernels.mmq (the int8 tensor-core MMQ) under the Triton interpreter, against
dequantize-then-matmul of x rounded as documented (``quantize_x_reference``); its dispatch; the
method's prefill through it; and sm_90 compilation of every setting the rule gives at the
Llama-3-8B and Qwen3-30B-A3B shapes."""

from __future__ import annotations

import itertools
import re
import types

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from framework.testing import HopperCompile, compile_for_hopper, interpreted, require_triton

require_triton()

from fw_gguf.dequant import dequantize  # noqa: E402
from fw_gguf.kernels import mmq  # noqa: E402
from fw_gguf.kernels.gemv import quantize_x_reference  # noqa: E402
from fw_gguf.kernels.layout import to_planar  # noqa: E402
from fw_gguf.kernels.matmul import gguf_matmul  # noqa: E402
from fw_gguf.kernels.mmq import MMQ_TYPES, MmqConfig, mmq_config, mmq_takes, quantize_rows  # noqa: E402

TYPES = sorted(MMQ_TYPES, key=int)
# N is never a multiple of the tiles; Q8_0's K is not whole 256-value steps (its last step is masked)
SHAPES = {Q.Q8_0: (40, 96), Q.Q4_K: (40, 512), Q.Q6_K: (24, 512)}


def _matrix(qtype, random_packed, seed):
    n, k = SHAPES[qtype]
    packed = torch.from_numpy(random_packed(qtype, n, k, seed=seed))
    return to_planar(packed, qtype), dequantize(packed, qtype, (n, k)), n, k


def _expected(x, reference):
    return quantize_x_reference(x).double() @ reference.double().T


def _assert_close(got, expected):
    # fp32 accumulation of exact integer group sums: far inside the ~1e-2 that x itself would move it
    assert expected.abs().max() > 0
    error = ((got.double() - expected).abs().max() / expected.abs().max()).item()
    assert error < 1e-5, error


@interpreted
def test_quantize_rows_is_the_documented_rounding():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 1e-3, 30, 0, 2])[:, None]
    x[4, 40:64] = 0.0  # a group of zeros stays zero (scale 0)
    xq, dx, sx = quantize_rows(x)
    assert xq.dtype == torch.int8 and dx.shape == sx.shape == (5, 3)
    got = (xq.float().view(5, 3, 32) * dx[..., None]).view(5, 96)
    assert torch.equal(got, quantize_x_reference(x))
    assert torch.equal(sx, xq.int().view(5, 3, 32).sum(-1))
    assert xq.abs().max() == 127


@interpreted
@pytest.mark.parametrize("rows", [2, 17, 64])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_mmq_matches_dequantize_then_matmul_of_rounded_x(qtype, rows, random_packed, monkeypatch):
    """The dispatch (no config) of 2..64 rows, with the row limit raised past the default 16: the rule's
    tiles, N and rows not multiples of them."""
    monkeypatch.setattr(mmq, "MMQ_MAX_ROWS", 64)
    planar, reference, n, k = _matrix(qtype, random_packed, seed=int(qtype) + rows)
    assert mmq_takes(qtype, rows, k, planar.numel() // gguf.GGML_QUANT_SIZES[qtype][1], True)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    _assert_close(gguf_matmul(x, planar, qtype, n, k, planar=True), _expected(x, reference))


@interpreted
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_mmq_split_k_and_small_tiles_write_a_column_slice(qtype, random_packed):
    """K split in two (one split of Q8_0's 96 values is empty), 16 x 16 tiles, into a strided output."""
    planar, reference, n, k = _matrix(qtype, random_packed, seed=int(qtype))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    out = torch.full((3, n + 8), 7.0)
    config = MmqConfig(block_m=16, block_n=16, split_k=2)
    got = gguf_matmul(x, planar, qtype, n, k, planar=True, config=config, out=out[:, 4 : 4 + n])
    _assert_close(got, _expected(x, reference))
    assert (out[:, :4] == 7).all() and (out[:, 4 + n :] == 7).all()


@interpreted
def test_method_prefill_takes_the_mmq_instead_of_dequantizing(random_packed, monkeypatch):
    """A fused layer of a Q4_K and a Q6_K shard at prefill size: no dequantization, x rounded per 32."""
    from fw_gguf import method
    from fw_gguf.kernels import matmul

    k, shard_rows, qtypes = 256, (24, 16), (Q.Q4_K, Q.Q6_K)
    packed = [torch.from_numpy(random_packed(t, r, k, seed=i)) for i, (t, r) in enumerate(zip(qtypes, shard_rows))]
    layer = types.SimpleNamespace(
        gguf_in_features=k,
        gguf_rows=list(shard_rows),
        gguf_types=list(qtypes),
        gguf_groups=[(0, 1), (1, 2)],
        gguf_planar=[True, True],
        gguf_weight_0=to_planar(packed[0], qtypes[0]),
        gguf_weight_1=to_planar(packed[1], qtypes[1]),
    )
    reference = torch.cat([dequantize(p, t, (r, k)) for p, t, r in zip(packed, qtypes, shard_rows)])
    monkeypatch.setattr(method, "DEQUANTIZE_MIN_ROWS", 4)
    monkeypatch.setattr(matmul, "gguf_dequantize", None)  # would raise if the method dequantized
    x = torch.randn(1, 5, k, generator=torch.Generator().manual_seed(2))
    got = method.linear_packed(layer, x)
    assert got.shape == (1, 5, 40)
    _assert_close(got[0], _expected(x[0], reference))


def test_dispatch_and_refusals(monkeypatch):
    assert mmq.MMQ_MAX_ROWS == 16  # the default: faster than the tiles at 16 rows, slower at 64 (H200)
    assert mmq_takes(Q.Q4_K, 2, 4096, 16 * 4096, True) and mmq_takes(Q.Q8_0, 16, 96, 3 * 40, True)
    assert not mmq_takes(Q.Q4_K, 1, 4096, 16 * 4096, True)  # one row: the integer GEMV
    assert not mmq_takes(Q.Q4_K, 17, 4096, 16 * 4096, True)  # past MMQ_MAX_ROWS
    assert not mmq_takes(Q.Q4_K, 8, 4096, 16 * 4096, False)  # the file's layout
    assert not mmq_takes(Q.Q5_K, 8, 4096, 16 * 4096, True)  # no MMQ for the type
    monkeypatch.setattr(mmq, "MMQ_ENABLED", False)
    assert not mmq_takes(Q.Q4_K, 8, 4096, 16 * 4096, True)
    with pytest.raises(ValueError, match="int8 MMQ multiplies a planar Q4_K, Q6_K, Q8_0 matrix; got a GGUF-layout"):
        gguf_matmul(torch.zeros(2, 256), torch.zeros(144, dtype=torch.uint8), Q.Q4_K, 1, 256, config=MmqConfig())
    with pytest.raises(ValueError, match="at least 16 x 16"):
        MmqConfig(block_m=8)


def test_mmq_rule_splits_k_for_few_programs():
    assert mmq_config(Q.Q4_K, 4096, 4096, 64, 132) == MmqConfig(64, 64, split_k=4)  # 64 programs, 16 steps
    assert mmq_config(Q.Q4_K, 4096, 4096, 512, 132).split_k == 1  # 512 programs
    assert mmq_config(Q.Q4_K, 28672, 4096, 16, 132) == MmqConfig(16, 64, split_k=1)
    assert mmq_config(Q.Q6_K, 4096, 14336, 32, 132).block_m == 32


#: ``(N, K)`` of the dense weights gguf_matmul multiplies: Llama-3-8B (qkv, o, gate_up, down, head)
#: and Qwen3-30B-A3B (qkv, o, head; its experts run the MoE kernel).
MODEL_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
MODEL_SHAPES += [(5120, 2048), (2048, 4096), (151936, 2048)]
ROWS = (2, 16, 17, 32, 33, 64, 128, 256, 512)
ALIGNED = ("xq_ptr", "w_ptr", "out_ptr", "T", "K", "N")


def _rule_settings() -> list[tuple[Q, MmqConfig]]:
    """Every ``(type, setting)`` the rule gives at the model shapes for 2..512 rows."""
    settings = {
        (qtype, mmq_config(qtype, n, k, rows, 132))
        for qtype, (n, k), rows in itertools.product(TYPES, MODEL_SHAPES, ROWS)
    }
    return sorted(settings, key=lambda item: (int(item[0]), item[1].block_m, item[1].split_k))


def _mmq_case(qtype: Q, config: MmqConfig) -> HopperCompile:
    return HopperCompile(
        "fw_gguf.kernels.mmq:_mmq_kernel",
        {
            "xq_ptr": "*i8",
            "dx_ptr": "*fp32",
            "sx_ptr": "*i32",
            "w_ptr": "*u8",
            "out_ptr": "*fp32" if config.split_k > 1 else "*bf16",
        },
        dict(QTYPE=int(qtype), BLOCK_M=config.block_m, BLOCK_N=config.block_n, SPLIT_K=config.split_k),
        options=dict(num_warps=config.num_warps, num_stages=config.num_stages),
        divisible_by_16=ALIGNED,
    )


def _assert_int8_mma_and_wide_loads(settings, ptx) -> None:
    assert len(ptx) == len(settings) and all(".target sm_90" in text for text in ptx)
    for (qtype, config), text in zip(settings, ptx):
        assert re.search(r"mma[.\w]*\.s8\.s8", text), (qtype.name, config)  # int8 tensor-core MMAs
        assert "ld.global.b8" not in text and "cvt.rn.f32.s32" not in text, (qtype.name, config)
        assert "cp.async" in text, (qtype.name, config)  # 16-byte copies into shared memory


def test_mmq_compiles_for_hopper_on_int8_mma():
    """Each type at the prefill tile and the smallest K-split one (the CPU budget's share of the
    rule's 27 settings; ``test_every_rule_setting_compiles_for_hopper`` compiles them all), and the
    quantizer: int8 MMAs, no byte-wide global loads, no slow int -> float conversions."""
    settings = [(qtype, MmqConfig(64, 64, split_k=1)) for qtype in TYPES] + [(Q.Q4_K, MmqConfig(16, 64, split_k=4))]
    assert all(setting in _rule_settings() for setting in settings)
    quantizer = HopperCompile(
        "fw_gguf.kernels.mmq:_quantize_rows_kernel",
        {"x_ptr": "*bf16", "xq_ptr": "*i8", "dx_ptr": "*fp32", "sx_ptr": "*i32"},
        dict(BLOCK_G=32),
        options=dict(num_warps=4),
    )
    ptx = compile_for_hopper([_mmq_case(*setting) for setting in settings] + [quantizer])
    _assert_int8_mma_and_wide_loads(settings, ptx[:-1])
    assert ".target sm_90" in ptx[-1]


@pytest.mark.gpu
def test_every_rule_setting_compiles_for_hopper():
    """All 27 settings of the rule at the Llama-3-8B and Qwen3-30B-A3B shapes (~4 s of ptxas each:
    run where the CPUs are many, with the GPU tests)."""
    settings = _rule_settings()
    assert len(settings) == 27
    _assert_int8_mma_and_wide_loads(settings, compile_for_hopper([_mmq_case(*setting) for setting in settings]))
