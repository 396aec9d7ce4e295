"""Layers resolve their ops through the kernel registry once, at construction."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from framework import hookimpl, ops
from framework.kernels import kernels_for
from framework.layers import GeluTanhAndMul, ReplicatedLinear, RMSNorm, SiluAndMul
from framework.layers.rotary import RotaryEmbedding, get_rope
from framework.plugins import unregister_plugin
from framework.specs import KernelSpec

OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_embedding", "linear")


def install_fake_kernels(monkeypatch, register_fw_plugin) -> list[str]:
    """Register a plugin whose kernels (priority 10) record their calls and defer to the reference ops."""
    calls: list[str] = []
    module = types.ModuleType("fw_fake_kernels")
    for op in OPS:

        def kernel(*args, _op=op, **kwargs):
            calls.append(_op)
            return getattr(ops, _op)(*args, **kwargs)

        setattr(module, op, kernel)
    monkeypatch.setitem(sys.modules, "fw_fake_kernels", module)

    class FakeKernelsPlugin:
        @hookimpl
        def register_kernels(self):
            return [KernelSpec(op=op, name="fake", impl=f"fw_fake_kernels:{op}", priority=10) for op in OPS]

    register_fw_plugin(FakeKernelsPlugin(), name="fake-kernels")
    return calls


@pytest.fixture
def fake_kernels(monkeypatch, register_fw_plugin):
    return install_fake_kernels(monkeypatch, register_fw_plugin)


def test_layers_call_the_highest_priority_kernel(fake_kernels):
    x = torch.randn(3, 8)
    norm = RMSNorm(8)
    norm(x)
    norm(x, torch.randn(3, 8))
    SiluAndMul()(x)
    GeluTanhAndMul()(x)
    RotaryEmbedding(4, 4, 16, 10000.0)(torch.arange(3), x, x)
    ReplicatedLinear(8, 4)(x)  # the unquantized linear method's matmul
    assert fake_kernels == list(OPS)


def test_fw_kernels_forces_the_reference_kernel(fake_kernels, monkeypatch):
    monkeypatch.setenv("FW_KERNELS", "rms_norm=torch,linear=torch")
    RMSNorm(8)(torch.randn(2, 8))
    SiluAndMul()(torch.randn(2, 8))
    ReplicatedLinear(8, 4)(torch.randn(2, 8))
    assert fake_kernels == ["silu_and_mul"]


def test_layers_built_after_the_plugin_is_removed_use_the_reference_again(fake_kernels):
    unregister_plugin("fake-kernels")
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x = torch.randn(2, 8)
    torch.testing.assert_close(norm(x), ops.rms_norm(x, norm.weight, 1e-6), rtol=0, atol=0)
    assert fake_kernels == []


def test_rmsnorm_layer_matches_reference_with_gemma_offset():
    norm = RMSNorm(8, eps=1e-6, offset=1.0)
    assert torch.equal(norm.weight, torch.zeros(8))  # (1 + 0): the identity scale
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x, residual = torch.randn(4, 8), torch.randn(4, 8)
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(out, ops.rms_norm(x + residual, norm.weight, 1e-6, 1.0), rtol=0, atol=0)


def test_get_rope_builds_a_new_module_when_the_plugins_change(monkeypatch, register_fw_plugin):
    before = get_rope(8, 8, 32, 10000.0)
    calls = install_fake_kernels(monkeypatch, register_fw_plugin)
    after = get_rope(8, 8, 32, 10000.0)
    assert after is not before and after is get_rope(8, 8, 32, 10000.0)
    q, k = torch.randn(3, 16), torch.randn(3, 8)
    for got, expected in zip(after(torch.arange(3), q, k), before(torch.arange(3), q, k), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert calls == ["rotary_embedding"]


def test_a_linear_method_subclass_with_its_own_create_weights_still_multiplies():
    """A plugin's method that subclasses UnquantizedLinearMethod and never calls its create_weights
    (as plugins did before the ``linear`` op existed) keeps ``F.linear``."""
    from framework.layers.linear import UnquantizedLinearMethod

    class OwnWeights(UnquantizedLinearMethod):
        def create_weights(
            self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype
        ):
            weight = torch.nn.Parameter(
                torch.randn(sum(output_partition_sizes), input_size_per_partition), requires_grad=False
            )
            layer.register_parameter("weight", weight)

    layer = torch.nn.Module()
    method = OwnWeights()
    method.create_weights(layer, 8, [5], 8, 5, torch.float32)
    x = torch.randn(3, 8)
    torch.testing.assert_close(method.apply(layer, x), torch.nn.functional.linear(x, layer.weight), rtol=0, atol=0)


def test_a_preferred_implementation_wins_where_it_runs_and_fw_kernels_still_forces(monkeypatch, register_fw_plugin):
    """``get_kernel(op, prefer=name)``: a quant method's own kernel of a shared op, ahead of a
    higher-priority one for another format, where it can run; the best one elsewhere."""
    from framework.kernels import get_kernel

    module = types.ModuleType("fw_fake_moe_kernels")
    module.other_format = lambda *args: "other"
    module.this_format = lambda *args: "this"
    module.cuda_only = lambda *args: "cuda"
    monkeypatch.setitem(sys.modules, "fw_fake_moe_kernels", module)

    class FakeMoEKernels:
        @hookimpl
        def register_kernels(self):
            op = "quantized_fused_moe"
            return [
                KernelSpec(op=op, name="other", impl="fw_fake_moe_kernels:other_format", priority=10),
                KernelSpec(op=op, name="this", impl="fw_fake_moe_kernels:this_format", priority=5),
                KernelSpec(op=op, name="cuda", impl="fw_fake_moe_kernels:cuda_only", priority=5, devices=("cuda",)),
            ]

    register_fw_plugin(FakeMoEKernels(), name="fake-moe-kernels")
    with kernels_for("cpu"):
        assert get_kernel("quantized_fused_moe")() == "other"
        assert get_kernel("quantized_fused_moe", prefer="this")() == "this"
        assert get_kernel("quantized_fused_moe", prefer="cuda")() == "other"  # cannot run on the CPU
        assert get_kernel("quantized_fused_moe", prefer="unregistered")() == "other"
        monkeypatch.setenv("FW_KERNELS", "quantized_fused_moe=torch")
        assert get_kernel("quantized_fused_moe", prefer="this") is ops.quantized_fused_moe
