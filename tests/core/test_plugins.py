"""Plugin loading: allow/block lists, broken plugins, unknown hooks, firstresult overrides."""

from __future__ import annotations

import sys
import types

import pytest

from framework import hookimpl, plugins, registries
from framework.errors import DuplicateNameError, PluginError, UnknownNameError
from framework.specs import AttentionBackendSpec, KernelSpec


def _fake_entry_points(monkeypatch, modules: dict[str, str]):
    """Make importlib.metadata report entry points named -> module path in group fw."""
    from importlib import metadata

    real = metadata.entry_points
    eps = [metadata.EntryPoint(name=name, value=value, group="fw") for name, value in modules.items()]

    def entry_points(**kwargs):
        if kwargs.get("group") == "fw":
            return metadata.EntryPoints(eps)
        return real(**kwargs)

    monkeypatch.setattr(metadata, "entry_points", entry_points)


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@pytest.fixture
def three_plugins(monkeypatch, fresh_plugins):
    @hookimpl
    def register_kernels():
        return [KernelSpec(op="rms_norm", name="alpha", impl="x:y", priority=5)]

    @hookimpl
    def register_kernels_b():
        return [KernelSpec(op="rms_norm", name="beta", impl="x:y", priority=1)]

    register_kernels_b.__name__ = "register_kernels"
    monkeypatch.setitem(sys.modules, "fwtest_alpha", _module("fwtest_alpha", register_kernels=register_kernels))
    monkeypatch.setitem(sys.modules, "fwtest_beta", _module("fwtest_beta", register_kernels=register_kernels_b))
    _fake_entry_points(monkeypatch, {"alpha": "fwtest_alpha", "beta": "fwtest_beta", "broken": "fwtest_does_not_exist"})
    return fresh_plugins


def _names():
    return [info.name for info in plugins.loaded_plugins()]


def test_all_entry_points_load_and_broken_plugin_is_reported_by_name(three_plugins):
    assert _names() == ["core", "alpha", "beta"]
    (error,) = plugins.load_errors()
    assert error.name == "broken"
    assert "'broken'" in error.error and "fwtest_does_not_exist" in error.error and "ModuleNotFoundError" in error.error
    assert registries.kernels().names() == sorted(
        [
            "rms_norm/alpha",
            "rms_norm/beta",
            "rms_norm/torch",
            "fused_add_rms_norm/torch",
            "silu_and_mul/torch",
            "gelu_tanh_and_mul/torch",
            "rotary_embedding/torch",
            "qk_norm_rotary_embedding/torch",
            "fused_moe/torch",
            "quantized_fused_moe/torch",
            "moe_align_block_size/torch",
            "linear/torch",
            "causal_conv1d/torch",
            "gated_delta_rule/torch",
            "gdn_gating/torch",
            "select_experts/torch",
            "sigmoid_gate_mul/torch",
            "rms_norm_gated/torch",
        ]
    )


def test_allow_list_loads_only_named_plugins(three_plugins, monkeypatch):
    monkeypatch.setenv("FW_PLUGINS", "beta")
    assert _names() == ["core", "beta"]
    assert plugins.load_errors() == []


def test_block_list_hides_named_plugins(three_plugins, monkeypatch):
    monkeypatch.setenv("FW_DISABLE_PLUGINS", "alpha, broken")
    assert _names() == ["core", "beta"]


def test_autoload_can_be_disabled(three_plugins, monkeypatch):
    monkeypatch.setenv("FW_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert _names() == ["core"]


def test_load_plugins_is_idempotent(three_plugins):
    first = plugins.load_plugins()
    assert plugins.load_plugins() is first
    assert _names() == ["core", "alpha", "beta"]


def test_kernel_selection_takes_highest_priority_available(three_plugins):
    from framework.platform import Platform

    platform = Platform("cpu")
    assert registries.kernels(platform).select("rms_norm", platform).name == "alpha"
    assert registries.kernels(platform).select("rms_norm", platform, "beta").name == "beta"


def test_unknown_hook_is_an_error_naming_the_plugin(fresh_plugins):
    class Misspelled:
        @hookimpl
        def register_kernals(self):
            return []

    with pytest.raises(PluginError) as info:
        plugins.register_plugin(Misspelled(), "typo_plugin")
    message = str(info.value)
    assert "'typo_plugin'" in message and "register_kernals" in message and "register_kernels" in message
    assert "typo_plugin" not in _names()


def test_hook_with_unknown_argument_is_an_error_naming_the_plugin(fresh_plugins):
    class BadArgs:
        @hookimpl
        def register_kernels(self, colour):
            return []

    with pytest.raises(PluginError, match="'bad_args'.*colour"):
        plugins.register_plugin(BadArgs(), "bad_args")


def test_duplicate_names_are_rejected_naming_both_plugins(register_fw_plugin):
    class Twin:
        @hookimpl
        def register_attention_backends(self):
            return [AttentionBackendSpec(name="torch", impl="x:y")]

    register_fw_plugin(Twin(), "twin")
    with pytest.raises(DuplicateNameError) as info:
        registries.attention_backends()
    assert "'torch_attention'" in str(info.value) and "'twin'" in str(info.value)


def test_unknown_name_lists_valid_names():
    with pytest.raises(UnknownNameError) as info:
        registries.attention_backends().get("tritonn")
    assert "'tritonn'" in str(info.value) and "valid: flashinfer, torch, torch_sdpa, triton" in str(info.value)


def test_register_hook_must_return_specs_of_its_kind(register_fw_plugin):
    class Wrong:
        @hookimpl
        def register_weight_formats(self):
            return [KernelSpec(op="x", name="y", impl="a:b")]

    register_fw_plugin(Wrong(), "wrong")
    with pytest.raises(PluginError, match="'wrong'.*WeightFormatSpec"):
        registries.weight_formats()


def test_plugin_overrides_firstresult_default(register_fw_plugin):
    candidates = [
        AttentionBackendSpec(name="fast", impl="x:y", priority=9),
        AttentionBackendSpec(name="torch", impl="x:y"),
    ]
    assert (
        plugins.call_first(
            "select_attention_backend", candidates=candidates, requested=None, model_config=None, platform=None
        )
        == "fast"
    )
    assert (
        plugins.call_first(
            "select_attention_backend", candidates=candidates, requested="torch", model_config=None, platform=None
        )
        == "torch"
    )

    class AlwaysTorch:
        @hookimpl
        def select_attention_backend(self, candidates):
            return candidates[-1].name

    register_fw_plugin(AlwaysTorch(), "always_torch")
    assert (
        plugins.call_first(
            "select_attention_backend", candidates=candidates, requested=None, model_config=None, platform=None
        )
        == "torch"
    )


def test_quantization_default_resolution_and_override(register_fw_plugin):
    call = lambda **kw: plugins.call_first("resolve_quantization_method", model_config=None, platform=None, **kw)  # noqa: E731
    assert call(quantization_config=None, requested=None) is None
    assert call(quantization_config={"quant_method": "gptq"}, requested=None) == "gptq"
    assert call(quantization_config={"quant_method": "gptq"}, requested="isq") == "isq"

    class PreferMarlin:
        @hookimpl
        def resolve_quantization_method(self, quantization_config):
            return "marlin" if quantization_config and quantization_config.get("quant_method") == "gptq" else None

    register_fw_plugin(PreferMarlin(), "marlin")
    assert call(quantization_config={"quant_method": "gptq"}, requested=None) == "marlin"
    assert call(quantization_config={"quant_method": "awq"}, requested=None) == "awq"


def test_default_parsers_default_is_none():
    assert plugins.call_first("default_parsers", model_config=None, chat_template=None) == {
        "tool": None,
        "reasoning": None,
    }


def test_lifecycle_hooks_run_in_every_plugin(register_fw_plugin):
    seen = []

    class Lifecycle:
        def __init__(self, tag):
            self.tag = tag

        @hookimpl
        def startup(self, engine):
            seen.append(("startup", self.tag, engine))

        @hookimpl
        def shutdown(self, engine):
            seen.append(("shutdown", self.tag, engine))

    register_fw_plugin(Lifecycle("a"), "life_a")
    register_fw_plugin(Lifecycle("b"), "life_b")
    plugins.call_all("startup", engine="E")
    plugins.call_all("shutdown", engine="E")
    assert sorted(seen) == sorted(
        [("startup", "a", "E"), ("startup", "b", "E"), ("shutdown", "a", "E"), ("shutdown", "b", "E")]
    )


def test_route_and_app_init_hooks_collect_from_plugins(register_fw_plugin):
    class Routes:
        @hookimpl
        def register_routes(self):
            return ["route-a"]

        @hookimpl
        def app_init(self, app_config):
            app_config["touched"] = True

    register_fw_plugin(Routes(), "routes")
    assert plugins.call_all("register_routes") == [["route-a"]]
    config: dict = {}
    plugins.call_all("app_init", app_config=config)
    assert config == {"touched": True}


def test_registries_cover_every_register_hook():
    register_hooks = {
        name
        for name in plugins.hook_names()
        if name.startswith("register_") and name not in ("register_routes", "register_commands")
    }
    assert register_hooks == set(registries.REGISTRY_HOOKS)


def test_spec_reports_reasons_it_cannot_run():
    from framework.platform import Platform

    spec = AttentionBackendSpec(
        name="fi", impl="x:y", devices=("cuda",), requires=("surely_not_installed_pkg",), min_compute_capability=(9, 0)
    )
    assert spec.unavailable_reasons(Platform("cuda", compute_capability=(8, 0))) == [
        "package 'surely_not_installed_pkg' is not installed",
        "needs compute capability >= 9.0, device has 8.0",
    ]
    assert spec.unavailable_reasons(Platform("cpu"))[0] == "needs device cuda, this machine has cpu"


def test_every_register_hook_fills_its_registry(register_fw_plugin):
    from framework.specs import KVCacheDtypeSpec, ModelSpec, ParserSpec, QuantMethodSpec, WeightFormatSpec

    class Everything:
        @hookimpl
        def register_model_architectures(self, platform):
            return [ModelSpec(name="TestForCausalLM", impl="x:y")]

        @hookimpl
        def register_weight_formats(self):
            return [WeightFormatSpec(name="testfmt", impl="x:y")]

        @hookimpl
        def register_quantization_methods(self):
            return [QuantMethodSpec(name="testq", impl="x:y")]

        @hookimpl
        def register_kv_cache_dtypes(self):
            return [KVCacheDtypeSpec(name="test8", bits=8, backends=("torch",))]

        @hookimpl
        def register_attention_backends(self, platform):
            return [AttentionBackendSpec(name="testattn", impl="x:y")]

        @hookimpl
        def register_kernels(self, platform):
            return [KernelSpec(op="silu_and_mul", name="test", impl="x:y")]

        @hookimpl
        def register_tool_parsers(self):
            return [ParserSpec(name="testtool", kind="tool", impl="x:y")]

        @hookimpl
        def register_reasoning_parsers(self):
            return [ParserSpec(name="testthink", kind="reasoning", impl="x:y")]

    register_fw_plugin(Everything(), "everything")
    expected = {
        registries.model_architectures: "TestForCausalLM",
        registries.weight_formats: "testfmt",
        registries.quantization_methods: "testq",
        registries.kv_cache_dtypes: "test8",
        registries.attention_backends: "testattn",
        registries.kernels: "silu_and_mul/test",
        registries.tool_parsers: "testtool",
        registries.reasoning_parsers: "testthink",
    }
    for get, key in expected.items():
        assert get().plugin_of(key) == "everything"
