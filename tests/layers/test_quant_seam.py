"""The quantization seam: one dispatch for every layer kind, per-shard scales on fused layers,
expert tensors with any suffix, dequantize(), declared capabilities, and the conformance kits
(run here on the unquantized methods and on a small int8 format with one scale per tensor)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from framework import ops
from framework.errors import ConfigError
from framework.layers import LinearBase, QKVParallelLinear, set_weight_attrs
from framework.layers.attention import Attention
from framework.layers.fused_moe import FusedMoE
from framework.quantization import (
    FusedMoEMethod,
    LinearMethod,
    QuantConfig,
    build_quant_config,
    verify_quant_methods,
)
from framework.testing import check_linear_method, check_moe_method


class Int8Method(LinearMethod):
    """int8 ``qweight`` with one float32 scale per checkpoint tensor: ``weight_scale`` keeps one per fused shard."""

    def create_weights(
        self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype
    ):
        qweight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=torch.int8), requires_grad=False
        )
        set_weight_attrs(qweight, {"input_dim": 1, "output_dim": 0, "weight_loader": layer.weight_loader})
        scale = nn.Parameter(torch.empty(len(output_partition_sizes), dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, {"per_shard": True, "weight_loader": layer.weight_loader})
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("weight_scale", scale)

    def dequantize(self, layer):
        sizes = torch.tensor(layer.output_partition_sizes, device=layer.weight_scale.device)
        return (layer.qweight.float() * layer.weight_scale.repeat_interleave(sizes)[:, None]).to(layer.params_dtype)

    def apply(self, layer, x, bias=None):
        return F.linear(x, self.dequantize(layer).to(x.dtype), bias)


class Int8MoEMethod(FusedMoEMethod):
    """The experts as int8 ``w13_qweight`` / ``w2_qweight`` with a scale per expert and projection
    (``w13_weight_scale [E, 2]``: gate, up)."""

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype):
        width = intermediate_size_per_partition
        params = {
            "w13_qweight": (torch.empty(num_experts, 2 * width, hidden_size, dtype=torch.int8), {"feature_dim": -2}),
            "w13_weight_scale": (torch.empty(num_experts, 2, dtype=torch.float32), {"per_shard": True}),
            "w2_qweight": (torch.empty(num_experts, hidden_size, width, dtype=torch.int8), {"feature_dim": -1}),
            "w2_weight_scale": (torch.empty(num_experts, dtype=torch.float32), {}),
        }
        for name, (tensor, attrs) in params.items():
            param = nn.Parameter(tensor, requires_grad=False)
            set_weight_attrs(
                param, {"weight_loader": layer.weight_loader, "moe_projection": name[: name.index("_")], **attrs}
            )
            layer.register_parameter(name, param)

    def dequantize(self, layer):
        width = layer.intermediate_size_per_partition
        w13 = layer.w13_qweight.float() * layer.w13_weight_scale.repeat_interleave(width, dim=1)[..., None]
        w2 = layer.w2_qweight.float() * layer.w2_weight_scale[:, None, None]
        return w13.to(layer.params_dtype), w2.to(layer.params_dtype)

    def apply(self, layer, hidden, topk_weights, topk_ids):
        w13, w2 = self.dequantize(layer)
        return ops.fused_moe(hidden, w13.to(hidden.dtype), w2.to(hidden.dtype), topk_weights, topk_ids)


class Int8Config(QuantConfig):
    supported_act_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    @classmethod
    def get_name(cls):
        return "int8-test"

    def get_quant_method(self, layer, prefix):
        self.asked.append((type(layer).__name__, prefix))
        if isinstance(layer, LinearBase):
            return Int8Method()
        return Int8MoEMethod() if isinstance(layer, FusedMoE) else None

    @classmethod
    def from_config(cls, config, model_config=None):
        return cls()


class Int8Scheme:
    """Random int8 values and per-tensor (per expert for stacks) scales; the reference is their product."""

    block_size = 32

    def make_weight(self, name, shape, generator):
        qweight = torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)
        scale = 0.01 * (0.5 + torch.rand(shape[:-2] or (), generator=generator))
        base = name.removesuffix("weight")
        return {f"{base}qweight": qweight, f"{base}weight_scale": scale}, qweight.float() * scale[..., None, None]

    def quant_config(self, tensors):
        return Int8Config()


class DenseScheme:
    """No quantization: the conformance kits on the unquantized methods."""

    block_size = 32

    def make_weight(self, name, shape, generator):
        weight = torch.randn(shape, generator=generator)
        return {name: weight}, weight

    def quant_config(self, tensors):
        return None


def test_fused_qkv_keeps_one_scale_per_shard():
    """q, k and v each keep their per-tensor scale (the last shard used to overwrite the others)."""
    config = Int8Config()
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=config, prefix="attn.qkv_proj", tp_size=1, tp_rank=0)
    for shard, scale in zip("qkv", (0.5, 2.0, 3.0), strict=True):
        layer.weight_loader(layer.weight_scale, torch.tensor(scale), shard)
    assert layer.weight_scale.tolist() == [0.5, 2.0, 3.0]


def test_shards_that_disagree_on_a_shared_per_tensor_value_are_refused():
    """A scale without ``per_shard`` is shared by the shards: differing values are an error, not
    a silent overwrite by the last shard."""
    from framework.layers import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(
        32, [16, 16], quant_config=Int8Config(), prefix="mlp.gate_up_proj", tp_size=1, tp_rank=0
    )
    layer.weight_scale = nn.Parameter(torch.empty(()), requires_grad=False)  # one value for both shards
    set_weight_attrs(layer.weight_scale, {"weight_loader": layer.weight_loader})
    layer.weight_loader(layer.weight_scale, torch.tensor(0.5), 0)
    layer.weight_loader(layer.weight_scale, torch.tensor(0.5), 1)  # the same value: fine
    with pytest.raises(ValueError, match=r"mlp\.gate_up_proj: shard 1 holds a different value .* needs per_shard=True"):
        layer.weight_loader(layer.weight_scale, torch.tensor(2.0), 1)


def test_moe_gate_and_up_that_disagree_on_a_shared_value_are_refused():
    """The MoE loader keeps the linear layers' rule: a w13 value without ``feature_dim`` or
    ``per_shard`` is shared by gate and up, so differing values are an error, not an overwrite."""
    from framework.layers import FusedMoE

    layer = FusedMoE(2, 1, 16, 8, renormalize=True, prefix="mlp.experts", tp_size=1, tp_rank=0)
    scale = nn.Parameter(torch.empty(2), requires_grad=False)
    set_weight_attrs(scale, {"weight_loader": layer.weight_loader, "moe_projection": "w13"})
    layer.weight_loader(scale, torch.tensor(0.5), "w1", 0)
    layer.weight_loader(scale, torch.tensor(0.5), "w3", 0)  # the same value: fine
    layer.weight_loader(scale, torch.tensor(4.0), "w1", 1)  # another expert's entry
    with pytest.raises(ValueError, match=r"mlp\.experts: the up projection holds a different value"):
        layer.weight_loader(scale, torch.tensor(2.0), "w3", 1)
    assert scale.tolist() == [0.5, 4.0]


def test_int8_linear_method_with_per_shard_scales_passes_the_conformance_kit():
    cases = check_linear_method(Int8Scheme(), dtypes=(torch.bfloat16, torch.float16), num_rows=(1, 7, 64, 512))
    assert "qkv_proj tp=4 rank=3 float16" in cases and "gate_up_proj tp=2 rank=1 bfloat16" in cases


def test_int8_moe_method_loads_qweight_and_scale_tensors_and_passes_the_conformance_kit():
    cases = check_moe_method(Int8Scheme(), dtypes=(torch.bfloat16, torch.float16))
    assert "experts tp=4 rank=2 bfloat16" in cases


def test_unquantized_methods_pass_the_conformance_kits():
    check_linear_method(DenseScheme(), dtypes=(torch.float32,), num_rows=(1, 64), tp_sizes=(1, 2))
    check_moe_method(DenseScheme(), dtypes=(torch.float32,), num_tokens=(1, 64), tp_sizes=(1, 2))


def test_the_kit_fails_a_method_that_drops_a_shard_scale():
    class LastScaleWins(Int8Method):
        def dequantize(self, layer):  # every shard scaled like the last one
            return (layer.qweight.float() * layer.weight_scale[-1]).to(layer.params_dtype)

    class Config(Int8Config):
        def get_quant_method(self, layer, prefix):
            return LastScaleWins() if isinstance(layer, LinearBase) else None

    class Scheme(Int8Scheme):
        def quant_config(self, tensors):
            return Config()

    with pytest.raises(AssertionError, match="gate_up_proj tp=1 rank=0 float32"):
        check_linear_method(Scheme(), dtypes=(torch.float32,), num_rows=(1,), tp_sizes=(1,))


def test_the_kit_says_when_the_schemes_reference_outputs_overflow_the_dtype():
    class Huge(DenseScheme):
        def make_weight(self, name, shape, generator):
            weight = 1000 * torch.randn(shape, generator=generator)  # outputs far beyond 65504
            return {name: weight}, weight

    with pytest.raises(AssertionError, match=r"reference reaches .* beyond torch.float16's largest value 65504"):
        check_moe_method(Huge(), dtypes=(torch.float16,), num_tokens=(1,), tp_sizes=(1,))


def _rounded_to_int8(x, group, levels=127):
    """An independent form of int8 rounding per ``group`` features (scale max|x|/127, half away from 0);
    fewer ``levels``: a coarser rounding."""
    g = x.float().reshape(*x.shape[:-1], -1, group)
    step = g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / levels
    return ((g / step).abs().add(0.5).floor() * (g / step).sign() * step).reshape(x.shape)


@pytest.mark.parametrize("declared", [True, False])
def test_the_kit_allows_declared_activation_rounding_and_only_that(declared):
    """A method multiplying int8-rounded activations (as llama.cpp-style integer GEMVs do) passes in
    float32 when it declares the rounding, fails when it does not; rounding coarser than it declares
    fails too."""

    class RoundsX(Int8Method):
        def __init__(self, levels, declares):
            self.levels, self.declares = levels, declares

        def apply(self, layer, x, bias=None):
            return super().apply(layer, _rounded_to_int8(x, 32, self.levels).to(x.dtype), bias)

        def activation_group(self, layer, x):
            return 32 if self.declares else None

    def run(levels, declares):
        class Config(Int8Config):
            def get_quant_method(self, layer, prefix):
                return RoundsX(levels, declares) if isinstance(layer, LinearBase) else None

        class Scheme(Int8Scheme):
            def quant_config(self, tensors):
                return Config()

        return check_linear_method(Scheme(), dtypes=(torch.float32,), num_rows=(1, 7), tp_sizes=(1,))

    if declared:
        assert "qkv_proj tp=1 rank=0 float32" in run(127, True)
        with pytest.raises(AssertionError, match="beyond the declared activation rounding"):
            run(7, True)  # 4-bit steps, 18x coarser than the int8 it declares
    else:
        with pytest.raises(AssertionError, match=r"max error .* \(allowed 0.0001 in torch.float32\)"):
            run(127, False)


def test_quant_config_is_asked_for_attention_layers_and_returns_none_by_default():
    config = Int8Config()
    attention = Attention(0, 4, 2, 16, 0.25, quant_config=config, prefix="model.layers.0.self_attn.attn")
    assert config.asked == [("Attention", "model.layers.0.self_attn.attn")] and attention.quant_method is None


def test_unquantized_linear_dequantize_is_its_weight():
    from framework.layers import ColumnParallelLinear

    layer = ColumnParallelLinear(8, 6, tp_size=1, tp_rank=0)
    nn.init.normal_(layer.weight)
    assert layer.quant_method.dequantize(layer) is layer.weight


def test_a_method_for_the_wrong_layer_kind_is_refused():
    class Confused(Int8Config):
        def get_quant_method(self, layer, prefix):
            return Int8Method()

    with pytest.raises(TypeError, match="experts: Confused.get_quant_method returned Int8Method for a FusedMoE layer"):
        FusedMoE(4, 2, 32, 64, renormalize=True, quant_config=Confused(), prefix="experts", tp_size=1, tp_rank=0)
    with pytest.raises(TypeError, match="attn: Confused.get_quant_method returned Int8Method for an attention layer"):
        Attention(0, 4, 2, 16, 0.25, quant_config=Confused(), prefix="attn")


def _model_config(dtype):
    from framework.config import ModelConfig

    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
    }
    return ModelConfig.from_hf_config(hf, dtype=dtype)


def test_an_unsupported_activation_dtype_is_a_config_error_naming_the_supported_ones():
    class HalfOnly(Int8Config):
        supported_act_dtypes = frozenset({torch.float16})

    with pytest.raises(ConfigError, match=r"'int8-test' does not support activations in float32; supported: float16"):
        build_quant_config(HalfOnly, {}, _model_config(torch.float32), torch.device("cpu"))
    assert isinstance(build_quant_config(HalfOnly, {}, _model_config(torch.float16), torch.device("cpu")), HalfOnly)


def test_from_config_without_model_config_still_builds():
    class Legacy(Int8Config):
        @classmethod
        def from_config(cls, config):
            return cls()

    assert isinstance(build_quant_config(Legacy, {}, _model_config(torch.float32), torch.device("cpu")), Legacy)


def test_a_layer_method_that_cannot_run_on_the_device_is_a_config_error_naming_the_layer():
    class CudaOnly(Int8Method):
        supported_device_types = frozenset({"cuda"})

    class Config(Int8Config):
        def get_quant_method(self, layer, prefix):
            return CudaOnly() if prefix.endswith("down_proj") else None

    from framework.layers import RowParallelLinear

    model = nn.Module()
    model.down_proj = RowParallelLinear(64, 32, quant_config=Config(), prefix="down_proj", tp_size=1, tp_rank=0)
    with pytest.raises(ConfigError, match=r"down_proj's CudaOnly does not run on cpu; supported devices: cuda"):
        verify_quant_methods(model, torch.float32, torch.device("cpu"))
    verify_quant_methods(model, torch.float32, torch.device("cuda"))


@pytest.mark.parametrize("num_tokens", [1, 3, 40])  # 3 * 2 <= 8 experts: the gather path; 40: the per-expert loop
def test_quantized_fused_moe_reference_equals_fused_moe_on_the_dequantized_experts(num_tokens):
    generator = torch.Generator().manual_seed(3)
    experts, hidden, inter, top_k = 8, 32, 48, 2

    def packed(rows, cols):
        q = torch.randint(-127, 128, (experts, rows, cols), generator=generator, dtype=torch.int8)
        scales = 0.01 + 0.01 * torch.rand(experts, generator=generator)
        decode = lambda data, s, dtype: (data.float() * s[:, None, None]).to(dtype)  # noqa: E731
        return ops.PackedExperts(q, scales, "test:int8", cols, decode), decode(q, scales, torch.float32)

    (w1, gate), (w3, up), (w2, down) = packed(inter, hidden), packed(inter, hidden), packed(hidden, inter)
    x = torch.randn(num_tokens, hidden, generator=generator)
    logits = torch.randn(num_tokens, experts, generator=generator)
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, -1), top_k)
    got = ops.quantized_fused_moe(x, w1, w3, w2, topk_weights, topk_ids.int())
    want = ops.fused_moe(x, torch.cat([gate, up], dim=1), down, topk_weights, topk_ids.int())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
