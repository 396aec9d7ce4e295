"""Model sources: sharded safetensors, the Hugging Face cache offline, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from framework import LLM, SamplingParams
from framework.config import resolve_dtype
from framework.errors import ConfigError, ModelLoadError
from framework.quantization import QuantConfig
from framework.testing import write_tiny_model

TINY = transformers.LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = {"prompt_token_ids": [3, 5, 7, 11, 13]}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path, TINY)
    return path


@pytest.fixture(scope="module")
def expected_ids(tiny_dir):
    return LLM(str(tiny_dir), num_blocks=16).generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def test_sharded_safetensors_with_index_load_the_same_model(tiny_dir, tmp_path, expected_ids):
    for item in tiny_dir.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, tmp_path / item.name)
    tensors = load_file(tiny_dir / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n].contiguous() for n in part}, tmp_path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert LLM(str(tmp_path), num_blocks=16).generate(PROMPT, GREEDY)[0].outputs[0].token_ids == expected_ids
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        LLM(str(tmp_path), num_blocks=16)


def test_hub_repo_loads_from_the_cache_offline(tiny_dir, tmp_path, monkeypatch, expected_ids):
    """A repo id resolves through huggingface_hub's cache layout with HF_HUB_OFFLINE=1."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--fwtest--tiny-llama"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for item in tiny_dir.iterdir():
        shutil.copy(item, snapshot / item.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert LLM("fwtest/tiny-llama", num_blocks=16).generate(PROMPT, GREEDY)[0].outputs[0].token_ids == expected_ids
    with pytest.raises(ModelLoadError, match="'fwtest/not-cached' is not in the local Hugging Face cache"):
        LLM("fwtest/not-cached")


def test_missing_and_unrecognised_sources_say_what_is_wrong(tmp_path):
    with pytest.raises(ModelLoadError, match="neither an existing path nor a Hugging Face repo id"):
        LLM("./no/such/dir")
    with pytest.raises(ModelLoadError, match="no installed weight format recognises it"):
        LLM(str(tmp_path))
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(None, weights=str(tmp_path / "missing"))


def test_unknown_architecture_lists_the_valid_ones(tiny_dir, tmp_path):
    for item in tiny_dir.iterdir():
        shutil.copy(item, tmp_path / item.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["NopeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unknown model architecture 'NopeForCausalLM'; valid: .*LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_unknown_attention_backend_lists_the_valid_ones(tiny_dir):
    with pytest.raises(ConfigError, match="unknown attention backend 'flash'; valid: .*torch"):
        LLM(str(tiny_dir), attention_backend="flash")


def test_dtype_selection():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, "bfloat16") == torch.float32
    assert resolve_dtype("auto", gpu, "float16") == torch.float16
    assert resolve_dtype("auto", gpu, "float32") == torch.bfloat16
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(ConfigError, match="valid: bf16, f16, f32"):
        resolve_dtype("f8", cpu)


def test_bf16_engine_runs_on_cpu(tiny_dir):
    llm = LLM(str(tiny_dir), num_blocks=16, dtype="bf16")
    assert llm.engine.model_config.dtype == torch.bfloat16
    assert len(llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids) == 8


def test_chat_template_renders_and_generates(tmp_path):
    template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t9{% endif %}"
    write_tiny_model(tmp_path, TINY, chat_template=template)
    llm = LLM(str(tmp_path), num_blocks=16)
    assert llm.tokenizer.apply_chat_template([{"role": "t3", "content": "t4 t5"}]) == "t3 t4 t5 t9"
    result = llm.chat([{"role": "t3", "content": "t4 t5"}], GREEDY)[0]
    assert result.prompt_token_ids == [3, 4, 5, 9]
    assert (
        result.outputs[0].token_ids == llm.generate({"prompt_token_ids": [3, 4, 5, 9]}, GREEDY)[0].outputs[0].token_ids
    )


def test_cli_generate_and_bench(tiny_dir, tmp_path, expected_ids):
    from typer.testing import CliRunner

    from cli.main import build_app

    app = build_app()
    result = CliRunner().invoke(
        app, ["generate", "t3 t5 t7 t11 t13", "--m", str(tiny_dir), "--max-tokens", "8", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["token_ids"] == expected_ids
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--m",
            str(tiny_dir),
            "--num-prompts",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--output-json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["output_tokens"] == 16 and report["output_tokens_per_s"] > 0
    assert "out tok/s" in result.output
    result = CliRunner().invoke(app, ["generate", "hi", "--m", "./missing-model"])
    assert result.exit_code == 2 and "neither an existing path" in result.output


def test_dummy_load_format_fills_every_parameter_through_the_name_mapping(tmp_path):
    config = transformers.LlamaConfig(**{**TINY.to_dict(), "architectures": ["LlamaForCausalLM"]})
    (tmp_path / "config.json").write_text(config.to_json_string())
    llm = LLM(str(tmp_path), load_format="dummy", num_blocks=16, device="cpu")
    model = llm.engine.core.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert qkv.shape == (3 * 32, 32) and 0.01 < qkv.std().item() < 0.04
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    assert len(llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids) == 8
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path / "empty"), load_format="dummy")


def test_yarn_scaling_factor_extends_the_context_like_transformers(tiny_dir):
    from framework.testing import capture_logits, reference_logits

    llm = LLM(str(tiny_dir), num_blocks=32, yarn_scaling_factor=4.0)
    assert llm.engine.model_config.max_model_len == 4 * TINY.max_position_embeddings
    records = capture_logits(llm)
    prompt = [int(t) for t in torch.randint(2, 64, (40,), generator=torch.Generator().manual_seed(3))]
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    scaled = transformers.LlamaConfig(
        **{
            **TINY.to_dict(),
            "max_position_embeddings": 4 * TINY.max_position_embeddings,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": TINY.max_position_embeddings,
            },
        }
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, config=scaled, dtype=torch.float32).eval()
    expected = reference_logits(reference, prompt)
    got = torch.stack([records[("0-0", p)] for p in range(len(prompt))])
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    with pytest.raises(ConfigError, match="must be > 1"):
        LLM(str(tiny_dir), yarn_scaling_factor=0.5)


def test_device_ordinals_flag():
    from cli.options import device_from_ordinals

    assert device_from_ordinals("1", None) == "cuda:1"
    with pytest.raises(ConfigError, match="tensor parallelism"):
        device_from_ordinals("0,1", None)
    with pytest.raises(ConfigError, match="GPU ordinals"):
        device_from_ordinals("gpu0", None)


class HalfOnlyConfig(QuantConfig):
    """A quantization that computes in float16 only; records the model config it was built with."""

    supported_act_dtypes = frozenset({torch.float16})
    built_with: list = []

    @classmethod
    def get_name(cls):
        return "halfonly"

    def get_quant_method(self, layer, prefix):
        return None

    @classmethod
    def from_config(cls, config, model_config=None):
        cls.built_with.append(model_config)
        return cls()


def test_a_quantization_that_cannot_run_the_dtype_fails_before_any_weight_is_read(
    tiny_dir, register_fw_plugin, monkeypatch
):
    from framework import hookimpl
    from framework.loader.safetensors_format import SafetensorsFormat
    from framework.specs import QuantMethodSpec

    class Plugin:
        @hookimpl
        def register_quantization_methods(self):
            return [QuantMethodSpec(name="halfonly", impl=f"{__name__}:HalfOnlyConfig", description="test")]

    register_fw_plugin(Plugin(), name="halfonly")
    monkeypatch.setattr(SafetensorsFormat, "iter_weights", lambda self: pytest.fail("a weight was read"))
    with pytest.raises(
        ConfigError,
        match=r"quantization 'halfonly' does not support activations in float32; "
        r"supported: float16 \(choose one with --dtype\)",
    ):
        LLM(str(tiny_dir), dtype="fp32", quantization="halfonly", num_blocks=16)
    assert HalfOnlyConfig.built_with[-1].dtype == torch.float32  # from_config saw the model config
