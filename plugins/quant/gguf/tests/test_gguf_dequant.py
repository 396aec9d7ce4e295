"""fw_gguf.dequant against gguf-py's numpy reference, bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from fw_gguf import dequant
from fw_gguf.dequant import SUPPORTED_TYPES, UnsupportedQuantTypeError, bytes_per_row, dequantize
from gguf import GGMLQuantizationType as Q

# types gguf-py can quantize, so real-looking blocks can come from real-looking floats
QUANTIZABLE = [Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]


def _reference(packed: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(packed, qtype), dtype=np.float32))


def _assert_bit_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.isfinite(expected).all() and expected.abs().sum() > 0  # a meaningful comparison
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


def _cols(qtype: Q) -> int:
    return 2 * gguf.GGML_QUANT_SIZES[qtype][0] if qtype not in (Q.F32, Q.F16, Q.BF16) else 48


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=int), ids=lambda q: q.name)
def test_random_blocks_dequantize_bit_exact_with_gguf_py(qtype, random_packed):
    packed = random_packed(qtype, rows=37, cols=_cols(qtype), seed=int(qtype))
    shape = (37, _cols(qtype))
    _assert_bit_exact(dequantize(torch.from_numpy(packed), qtype, shape), _reference(packed, qtype))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_quantized_floats_dequantize_bit_exact_with_gguf_py(qtype):
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((16, 128)) * rng.uniform(1e-3, 10, (16, 1))).astype(np.float32)
    packed = gguf.quants.quantize(values, qtype)
    _assert_bit_exact(dequantize(torch.from_numpy(packed), int(qtype), (16, 128)), _reference(packed, qtype))


def test_flat_input_and_other_dtypes_give_the_same_values(random_packed):
    packed = random_packed(Q.Q4_K, rows=5, cols=512, seed=3)
    expected = _reference(packed, Q.Q4_K)
    flat = torch.from_numpy(packed).reshape(-1)
    _assert_bit_exact(dequantize(flat, Q.Q4_K, (5, 512)), expected)
    assert torch.equal(dequantize(flat, Q.Q4_K, (5, 512), dtype=torch.bfloat16), expected.to(torch.bfloat16))
    assert torch.equal(dequantize(flat, Q.Q4_K, (5, 2, 256)), expected.reshape(5, 2, 256))


def test_large_tensor_is_dequantized_in_chunks_with_identical_values(monkeypatch, random_packed):
    packed = random_packed(Q.Q6_K, rows=12, cols=1024, seed=4)
    monkeypatch.setattr(dequant, "_MAX_CHUNK_ELEMENTS", 1000)  # 3 blocks per step, 16 steps
    _assert_bit_exact(dequantize(torch.from_numpy(packed), Q.Q6_K, (12, 1024)), _reference(packed, Q.Q6_K))


def test_iq_type_raises_a_clear_error():
    data = torch.zeros(66, dtype=torch.uint8)
    with pytest.raises(
        UnsupportedQuantTypeError, match=r"IQ2_XXS is not supported by fw; supported: F32, F16, BF16, Q4_0"
    ):
        dequantize(data, Q.IQ2_XXS, (256,))
    with pytest.raises(UnsupportedQuantTypeError, match=r"type id 9999 is unknown"):
        dequantize(data, 9999, (256,))
    assert Q.IQ3_S not in SUPPORTED_TYPES and isinstance(UnsupportedQuantTypeError("x"), ValueError)


def test_byte_count_and_row_size_are_checked():
    assert bytes_per_row(Q.Q4_K, 512) == 288 and bytes_per_row(Q.F16, 3) == 6 and bytes_per_row(Q.IQ2_XXS, 256) == 66
    with pytest.raises(ValueError, match="multiple of 32"):
        bytes_per_row(Q.Q8_0, 40)
    with pytest.raises(ValueError, match="needs 68 bytes, got 67"):
        dequantize(torch.zeros(67, dtype=torch.uint8), Q.Q8_0, (2, 32))
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(4), Q.F32, (4,))


def _present_types(gguf_file) -> dict[Q, list]:
    by_type: dict[Q, list] = {}
    for info in gguf_file.tensors.values():
        by_type.setdefault(info.qtype, []).append(info)
    return by_type


def test_every_quant_type_of_the_real_files_is_supported(real_gguf):
    assert set(_present_types(real_gguf)) <= SUPPORTED_TYPES


def test_real_tensors_dequantize_bit_exact_with_gguf_py(real_gguf):
    # per type: first, middle and last tensor; at most 2048 rows each (rows are independent blocks)
    for qtype, infos in _present_types(real_gguf).items():
        for info in {id(i): i for i in (infos[0], infos[len(infos) // 2], infos[-1])}.values():
            rows = info.data.reshape(-1, info.data.shape[-1])[:2048]
            shape = (rows.shape[0], info.shape[-1])
            expected = _reference(rows.numpy(), qtype)
            _assert_bit_exact(dequantize(rows, qtype, shape), expected)
    # and one whole tensor through TensorInfo, in its own shape
    info = next(i for i in real_gguf.tensors.values() if i.name.endswith("attn_k.weight"))
    expected = _reference(info.data.numpy(), info.qtype).reshape(info.shape)
    _assert_bit_exact(info.dequantize(), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=int), ids=lambda q: q.name)
def test_cuda_dequantize_bit_exact_with_gguf_py(qtype, chunked, random_packed, monkeypatch):
    if chunked:
        monkeypatch.setattr(dequant, "_MAX_CHUNK_ELEMENTS", 4096)
    shape = (301, 4 * _cols(qtype))
    packed = random_packed(qtype, *shape, seed=100 + int(qtype))
    out = dequantize(torch.from_numpy(packed).cuda(), qtype, shape)
    assert out.device.type == "cuda"
    _assert_bit_exact(out.cpu(), _reference(packed, qtype))
    bf16 = dequantize(torch.from_numpy(packed).cuda(), qtype, shape, dtype=torch.bfloat16)
    assert torch.equal(bf16.cpu(), _reference(packed, qtype).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=int), ids=lambda q: q.name)
def test_dequantize_builds_no_tensor_from_host_values(qtype, random_packed, monkeypatch):
    # torch.tensor(list, device=cuda) is a host-to-device copy, which CUDA-graph capture refuses
    packed = torch.from_numpy(random_packed(qtype, rows=3, cols=_cols(qtype), seed=7))
    expected = dequantize(packed, qtype, (3, _cols(qtype)))

    def refuse(*args, **kwargs):
        raise AssertionError("dequantize built a tensor from host values")

    monkeypatch.setattr(torch, "tensor", refuse)
    monkeypatch.setattr(torch, "as_tensor", refuse)
    _assert_bit_exact(dequantize(packed, qtype, (3, _cols(qtype))), expected)
