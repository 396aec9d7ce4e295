"""fw's packers (what ``fw quantize`` writes) give the bytes of the independent writers: the
AutoGPTQ / AutoAWQ / Marlin formulas re-implemented in reference_formats, and compressed-tensors'
own pack_to_int32 / unpack_from_int32 from PyPI; and fw's unpackers invert them."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from fw_gptq.packing import (
    IntWeight,
    pack_awq,
    pack_compressed,
    pack_gptq,
    pack_marlin,
    unpack_awq,
    unpack_compressed,
    unpack_gptq,
    unpack_marlin,
)
from reference_formats import random_int_weight, write_awq, write_compressed, write_gptq, write_marlin


def draw(bits, group, symmetric, act_order=False, n=128, k=256):
    q, scales, zeros, g_idx, w = random_int_weight(
        n, k, bits, group, symmetric, act_order, torch.Generator().manual_seed(7)
    )
    weight = IntWeight(
        q.to(torch.uint8),
        scales,
        None if zeros is None else zeros.to(torch.uint8),
        g_idx if act_order else None,
        bits,
        k if group == -1 else group,
    )
    return q, scales, zeros, g_idx, w, weight


@pytest.mark.parametrize(
    ("bits", "group", "symmetric", "act_order", "v2"),
    [(4, 128, True, False, False), (4, 32, False, True, False), (8, 64, False, False, True)],
)
def test_gptq_packing_matches_the_autogptq_formula(bits, group, symmetric, act_order, v2):
    q, scales, zeros, g_idx, w, weight = draw(bits, group, symmetric, act_order)
    written = write_gptq(q, scales, zeros, g_idx, bits, v2=v2)
    ours = pack_gptq(weight, zero_offset=0 if v2 else 1)
    for name in ("qweight", "qzeros", "g_idx"):
        assert torch.equal(ours[name], written[name]), name
    back = unpack_gptq(
        written["qweight"],
        written["qzeros"],
        written["scales"],
        written["g_idx"] if act_order else None,
        bits,
        group,
        zero_offset=0 if v2 else 1,
    )
    torch.testing.assert_close(back.dequantize(), w)


def test_awq_packing_matches_the_autoawq_order():
    q, scales, zeros, g_idx, w, weight = draw(4, 128, False)
    written = write_awq(q, scales, zeros)
    ours = pack_awq(weight)
    assert torch.equal(ours["qweight"], written["qweight"]) and torch.equal(ours["qzeros"], written["qzeros"])
    torch.testing.assert_close(
        unpack_awq(written["qweight"], written["qzeros"], written["scales"], 128).dequantize(), w
    )


@pytest.mark.parametrize(("bits", "group", "symmetric"), [(4, 128, True), (4, 32, False), (8, -1, False)])
def test_compressed_tensors_packing_matches_the_library(bits, group, symmetric):
    q, scales, zeros, g_idx, w, weight = draw(bits, group, symmetric)
    written = write_compressed(q, scales, zeros, bits, dtype=torch.float32)
    ours = pack_compressed(weight, dtype=torch.float32)
    assert torch.equal(ours["weight_packed"], written["weight_packed"])
    signed = unpack_from_int32(ours["weight_packed"], bits, torch.Size([128, 256]), packed_dim=1)
    assert torch.equal(signed.long() + 2 ** (bits - 1), q.t())  # the library reads our bytes back
    if not symmetric:
        assert torch.equal(ours["weight_zero_point"], written["weight_zero_point"])
    back = unpack_compressed(
        written["weight_packed"],
        written["weight_scale"],
        written.get("weight_zero_point"),
        None,
        bits,
        256 if group == -1 else group,
    )
    torch.testing.assert_close(back.dequantize(), w)


@pytest.mark.parametrize("group", [128, -1])
def test_marlin_packing_matches_the_marlin_layer_pack(group):
    q, scales, zeros, g_idx, w, weight = draw(4, group, True)
    written = write_marlin(q, scales)
    ours = pack_marlin(weight)
    assert torch.equal(ours["B"], written["B"]) and torch.equal(ours["s"], written["s"])
    torch.testing.assert_close(
        unpack_marlin(written["B"], written["s"].float(), 256 if group == -1 else group).dequantize(), w
    )


def test_gptq_v1_refuses_a_zero_point_it_cannot_store():
    _, _, _, _, _, weight = draw(4, 128, False)
    zeros = weight.zeros.clone()
    zeros[0, 0] = 0
    with pytest.raises(ValueError, match="use gptq_v2"):
        pack_gptq(weight._replace(zeros=zeros))
