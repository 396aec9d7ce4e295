"""GGUF MoE expert stacks load lazily: each tensor-parallel rank dequantizes only its intermediate
features of every expert, straight into the model's dtype (no full fp32 copy of the stack).

The reference is ``fw_gguf.dequant.dequantize`` of the whole tensor in fp32 (itself bit-exact with
gguf-py), sliced and cast: the lazy path must give exactly those values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fw_gguf import dequant
from fw_gguf.dequant import dequantize, dequantize_slice
from fw_gguf.lazy import GGUFTensorSlice
from fw_gguf.reader import TensorInfo
from gguf import GGMLQuantizationType as Q

from framework.layers.fused_moe import FusedMoE

EXPERTS, HIDDEN = 4, 256


def packed_stack(random_packed, qtype: Q, rows: int, cols: int, seed: int) -> TensorInfo:
    """A random ``[EXPERTS, rows, cols]`` GGUF tensor as the reader gives it."""
    data = torch.from_numpy(random_packed(qtype, EXPERTS * rows, cols, seed=seed).copy()).view(EXPERTS, rows, -1)
    return TensorInfo(f"blk.0.ffn_x_exps.{seed}", qtype, (EXPERTS, rows, cols), data, Path("test.gguf"), 0)


def full_values(info: TensorInfo) -> torch.Tensor:
    return dequantize(info.data, info.qtype, info.shape, torch.float32)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.F16, Q.BF16, Q.F32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_slice_dequantizes_to_the_values_of_the_whole_tensor(random_packed, qtype, dtype):
    info = packed_stack(random_packed, qtype, 24, 512, seed=3)
    expected = full_values(info)
    # leading dims sliced, columns inside one block, across blocks, unaligned at both ends, whole
    for bounds in [
        ((1, 3), (5, 17), (0, 512)),
        ((0, 4), (0, 24), (40, 300)),
        ((2, 3), (23, 24), (257, 258)),
        ((0, 4), (0, 24), (256, 512)),
    ]:
        values = dequantize_slice(info.data, info.qtype, bounds, dtype)
        want = expected[tuple(slice(low, high) for low, high in bounds)].to(dtype)
        assert values.dtype == dtype and torch.equal(values, want), bounds


@pytest.mark.parametrize(("qtype", "width"), [(Q.Q8_0, 96), (Q.Q4_K, 512)])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_fused_moe_ranks_dequantize_only_their_features_in_the_model_dtype(
    random_packed, monkeypatch, qtype, width, tp_size
):
    """Every rank's w13 / w2 equal the whole dequantized stacks' slices in bf16; the values a rank
    decodes are its share, the down projection's rows rounded out to whole blocks (96 / 4 = 24
    features of 32-value Q8_0 blocks; 512 / 4 = 128 of 256-value Q4_K blocks)."""
    gate, up = (
        packed_stack(random_packed, Q.Q8_0, width, HIDDEN, 1),
        packed_stack(random_packed, qtype, width, HIDDEN, 2),
    )
    down = packed_stack(random_packed, qtype, HIDDEN, width, 4)
    decoded = []
    real_dequantize = dequant.dequantize
    monkeypatch.setattr(
        dequant,
        "dequantize",
        lambda data, q, shape, dtype=torch.float32: (
            decoded.append(torch.Size(shape).numel()) or real_dequantize(data, q, shape, dtype)
        ),
    )
    share, block = width // tp_size, dequant.GGML_QUANT_SIZES[qtype][0]
    for rank in range(tp_size):
        layer = FusedMoE(
            EXPERTS, 2, HIDDEN, width, renormalize=True, params_dtype=torch.bfloat16, tp_size=tp_size, tp_rank=rank
        )
        decoded.clear()
        for param, info, shard in (
            (layer.w13_weight, gate, "w1"),
            (layer.w13_weight, up, "w3"),
            (layer.w2_weight, down, "w2"),
        ):
            layer.weight_loader(param, GGUFTensorSlice(info), shard)
        features = slice(rank * share, (rank + 1) * share)
        w13 = torch.cat([full_values(gate)[:, features], full_values(up)[:, features]], dim=1).to(torch.bfloat16)
        assert layer.w13_weight.dtype == torch.bfloat16 and torch.equal(layer.w13_weight, w13)
        assert torch.equal(layer.w2_weight, full_values(down)[:, :, features].to(torch.bfloat16))
        assert layer.missing_weights() == []
        down_columns = -(-(features.stop) // block) * block - features.start // block * block
        assert sum(decoded) == EXPERTS * (2 * share * HIDDEN + HIDDEN * down_columns)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0])
def test_expert_slices_decode_on_the_parameters_device_bit_exact(random_packed, qtype):
    """On the GPU only the packed bytes of a rank's slice cross to the device, decoded there."""
    width = 512
    gate, up = (
        packed_stack(random_packed, qtype, width, HIDDEN, 1),
        packed_stack(random_packed, qtype, width, HIDDEN, 2),
    )
    down = packed_stack(random_packed, qtype, HIDDEN, width, 4)
    with torch.device("cuda"):
        layer = FusedMoE(EXPERTS, 2, HIDDEN, width, renormalize=True, params_dtype=torch.bfloat16, tp_size=4, tp_rank=1)
    for param, info, shard in (
        (layer.w13_weight, gate, "w1"),
        (layer.w13_weight, up, "w3"),
        (layer.w2_weight, down, "w2"),
    ):
        layer.weight_loader(param, GGUFTensorSlice(info), shard)
    features = slice(128, 256)
    w13 = torch.cat([full_values(gate)[:, features], full_values(up)[:, features]], dim=1).to(torch.bfloat16)
    assert torch.equal(layer.w13_weight.cpu(), w13)
    assert torch.equal(layer.w2_weight.cpu(), full_values(down)[:, :, features].to(torch.bfloat16))
