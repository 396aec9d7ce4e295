"""The gguf quant methods through framework.testing's conformance kits: every linear layer kind and
FusedMoE, TP 1/2/4, bf16 and fp16, against gguf-py's own dequantization of the same bytes."""

from __future__ import annotations

import itertools

import gguf
import pytest
import torch
from fw_gguf.method import GGUFQuantConfig
from fw_gguf.moe import GGUFFusedMoEMethod
from gguf import GGMLQuantizationType as Q

from framework.testing import check_linear_method, check_moe_method

#: Types gguf-py can quantize (from normal values); the K-quants get random blocks with modest scales.
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
# The kit makes eight weights (q/k/v and gate/up among them, so fused shards mix types); two
# orders cover every type between the packed run and the dequantized-at-load run.
LINEAR_TYPES = (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q4_1, Q.Q5_K, Q.Q2_K, Q.Q3_K)
LINEAR_TYPES_AT_LOAD = (Q.Q4_0, Q.Q5_1, Q.Q6_K, Q.Q3_K, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.Q5_0)
MOE_TYPES = (Q.Q4_K, Q.Q8_0, Q.Q6_K)  # gate, up, down: as Q4_K_M files mix them


class GGUFScheme:
    """Each weight in the next type of ``types``, of a trained model's magnitude (fp16 activations stay
    finite through an expert); values as gguf-py decodes the bytes."""

    block_size = 256  # K-quant super-blocks; every type's block divides it

    def __init__(self, types, random_packed) -> None:
        self.types, self.random_packed = itertools.cycle(types), random_packed
        self.tensor_types: dict[str, str] = {}

    def make_weight(self, name, shape, generator):
        qtype = next(self.types)
        rows, cols = int(torch.tensor(shape[:-1]).prod()), shape[-1]
        if qtype in QUANTIZABLE:
            values = (0.05 * torch.randn(rows, cols, generator=generator)).numpy()  # a trained model's scale
            packed = gguf.quants.quantize(values, qtype)
        else:
            seed = int(torch.randint(0, 2**31, (), generator=generator))
            packed = self.random_packed(qtype, rows, cols, seed=seed, scale_exponents=(-3, -2))
        self.tensor_types[name] = qtype.name
        reference = torch.from_numpy(gguf.quants.dequantize(packed, qtype).copy()).reshape(shape)
        return {name: torch.from_numpy(packed.copy()).reshape(*shape[:-1], -1)}, reference

    def quant_config(self, tensors):
        return GGUFQuantConfig.from_config({"tensor_types": dict(self.tensor_types)})


@pytest.mark.parametrize(
    ("keep_packed", "cpu_packed", "types"),
    [("1", "1", LINEAR_TYPES), ("0", "0", LINEAR_TYPES_AT_LOAD), ("0", "1", LINEAR_TYPES_AT_LOAD)],
    ids=["packed", "dequantized-at-load", "cpu-kernels"],
)
def test_gguf_linear_method_passes_the_conformance_kit(keep_packed, cpu_packed, types, random_packed, monkeypatch):
    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", keep_packed)
    monkeypatch.setenv("FW_GGUF_CPU_PACKED", cpu_packed)
    scheme = GGUFScheme(types, random_packed)
    cases = check_linear_method(scheme)
    assert "qkv_proj tp=4 rank=3 float16" in cases
    assert set(scheme.tensor_types.values()) == {t.name for t in types}  # every type was exercised


def test_gguf_experts_kept_packed_equal_dequantize_then_moe(random_packed, monkeypatch):
    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")
    scheme = GGUFScheme(MOE_TYPES, random_packed)
    # 1 and 4 tokens take the gather path; TP=2 slicing is the same code as TP=4 (and costs CPU minutes)
    cases = check_moe_method(scheme, num_experts=8, num_tokens=(1, 4, 64, 512), tp_sizes=(1, 4))
    assert "experts tp=4 rank=3 bfloat16" in cases
    from framework.layers.fused_moe import FusedMoE

    # what the kit checked: the three stacks as the file's bytes, each in its own type
    layer = FusedMoE(
        8,
        2,
        256,
        1024,
        renormalize=True,
        quant_config=scheme.quant_config({}),
        prefix="layer.experts",
        tp_size=1,
        tp_rank=0,
    )
    assert isinstance(layer.quant_method, GGUFFusedMoEMethod)
    assert [getattr(layer, f"gguf_{s}").shape for s in ("w1", "w3", "w2")] == [
        (8, 1024, 144),
        (8, 1024, 272),
        (8, 256, 840),
    ]  # Q4_K / Q8_0 rows of 256, Q6_K rows of 1024


def test_packed_down_experts_that_cannot_split_into_whole_blocks_are_refused(monkeypatch):
    from framework.errors import ConfigError
    from framework.layers.fused_moe import FusedMoE

    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")
    config = GGUFQuantConfig({f"m.experts.{p}.weight": "Q4_K" for p in ("gate_proj", "up_proj", "down_proj")})
    with pytest.raises(
        ConfigError,
        match=r"m\.experts: 384 intermediate features per rank are not a whole number of "
        r"Q4_K blocks of 256",
    ):
        FusedMoE(4, 2, 256, 768, renormalize=True, quant_config=config, prefix="m.experts", tp_size=2, tp_rank=0)


@pytest.mark.gpu
def test_gguf_methods_pass_the_conformance_kits_in_cuda_graphs(random_packed):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_linear_method(GGUFScheme(LINEAR_TYPES, random_packed), device="cuda", tp_sizes=(1, 2))
    check_moe_method(GGUFScheme(MOE_TYPES, random_packed), device="cuda", tp_sizes=(1, 2))
