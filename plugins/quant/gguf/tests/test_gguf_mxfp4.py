"""GGUF's MXFP4 type (ggml type 39): the torch dequantization against a reference written from
llama.cpp's C code (``dequantize_row_mxfp4``, ``ggml_e8m0_to_fp32_half``, ``kvalues_mxfp4``),
against gguf-py, and against fw_fp4's decoding of the same values in gpt-oss's checkpoint layout."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
import torch
from fw_gguf.dequant import SUPPORTED_TYPES, dequantize
from fw_gguf.gpt_oss import to_checkpoint_mxfp4
from gguf import GGMLQuantizationType as Q

#: ggml-common.h's kvalues_mxfp4: the e2m1 values doubled (int8), code 8 a plain zero.
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_to_fp32_half(e: int) -> np.float32:
    """ggml-impl.h: the fp32 with bits ``0x00200000 << e`` below 2, else exponent field ``e - 1``."""
    bits = (0x00200000 << e) if e < 2 else ((e - 1) << 23)
    return np.float32(struct.unpack("<f", struct.pack("<I", bits))[0])


def dequantize_row_mxfp4(row: bytes) -> np.ndarray:
    """ggml-quants.c's loop, element by element: per block of 17 bytes, ``y[j] = kvalues[qs[j] & 0xf] * d``
    and ``y[j + 16] = kvalues[qs[j] >> 4] * d`` in fp32."""
    out = np.empty(len(row) // 17 * 32, dtype=np.float32)
    with np.errstate(over="ignore"):
        for block in range(len(row) // 17):
            e, qs = row[17 * block], row[17 * block + 1 : 17 * block + 17]
            d = e8m0_to_fp32_half(e)
            for j in range(16):
                out[32 * block + j] = np.float32(KVALUES_MXFP4[qs[j] & 0x0F]) * d
                out[32 * block + j + 16] = np.float32(KVALUES_MXFP4[qs[j] >> 4]) * d
    return out


@pytest.fixture(scope="module")
def every_scale_and_code() -> np.ndarray:
    """256 blocks: block b has scale byte b (0, 1: subnormal halves; 255: ggml's 2^127) and random codes
    covering all 16 in each nibble position."""
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:16, 1:] = np.arange(16, dtype=np.uint8)[:, None] * 0x11  # code c in both nibbles of block c
    return blocks


def test_mxfp4_is_a_supported_type():
    assert Q.MXFP4 in SUPPORTED_TYPES and gguf.GGML_QUANT_SIZES[Q.MXFP4] == (32, 17)


def test_mxfp4_dequantization_is_bit_exact_with_the_c_reference(every_scale_and_code):
    data = every_scale_and_code.reshape(8, 32 * 17)  # 8 rows of 1024 values
    ours = dequantize(torch.from_numpy(data), Q.MXFP4, (8, 1024)).numpy()
    reference = np.stack([dequantize_row_mxfp4(row.tobytes()) for row in data])
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))  # also the signs of zeros, infs
    assert np.isinf(ours).any() and (ours[ours != 0].__abs__().min() < 2.0**-126)  # 2^127 * 12 and subnormals
    with np.errstate(over="ignore"):
        gguf_py = gguf.quants.dequantize(data, Q.MXFP4)
    assert np.array_equal(ours.view(np.uint32), gguf_py.view(np.uint32))


def test_mxfp4_equals_fw_fp4s_decoding_of_the_checkpoint_layout(every_scale_and_code):
    fp4_formats = pytest.importorskip("fw_fp4.formats")
    data = torch.from_numpy(every_scale_and_code[: fp4_formats.MAX_SCALE_BYTE + 1]).reshape(1, -1)  # fw_fp4's range
    blocks, scales = to_checkpoint_mxfp4(data)
    assert blocks.shape == (1, data.shape[1] // 17, 16) and torch.equal(scales[0], data[0, ::17])
    theirs = fp4_formats.dequantize_mxfp4(blocks, fp4_formats.fold_scale_bias(scales, "test"), torch.float32)
    ours = dequantize(data, Q.MXFP4, (1, blocks.shape[1] * 32))
    assert torch.equal(ours, theirs)
    # bit for bit but for code 8, which ggml reads as +0 (kvalues) and fw_fp4 as e2m1's -0
    differ = ours.view(torch.int32) != theirs.view(torch.int32)
    assert differ.any() and not ours[differ].any() and torch.signbit(theirs[differ]).all()


def test_checkpoint_layout_interleaves_the_two_halves_of_each_block():
    # block: scale 130, qs[i] = code i (low) | code 15 - i (high): values 0..15 then 31..16's codes
    qs = bytes((i | ((15 - i) << 4)) for i in range(16))
    blocks, scales = to_checkpoint_mxfp4(torch.tensor(list(bytes([130]) + qs), dtype=torch.uint8))
    codes = [c for byte in blocks[0].tolist() for c in (byte & 15, byte >> 4)]
    assert scales.tolist() == [130] and codes == [*range(16), *range(15, -1, -1)]
