"""``EngineArgs``: one declaration of every engine option, reachable with one default from
``fw serve``, ``EngineBuilder`` and ``LLM``; every validated option refused before any download;
the option semantics issue 33 adds (chunking off, vLLM's memory budget, quantization checks,
out-of-memory hints)."""

from __future__ import annotations

import json
import typing

import click
import pytest
import torch
import transformers
import typer
from typer.testing import CliRunner

from framework import LLM, EngineArgs, EngineBuilder, SamplingParams
from framework.engine import kv_cache_sizing, model_loading
from framework.engine.args import engine_fields, flag_of
from framework.errors import ConfigError
from framework.testing import reference_greedy, write_tiny_model

#: a non-default value for every field that builds on this CPU machine (with the options beside it)
SAMPLES: dict[str, tuple[object, dict]] = {
    "model": ("some/repo", {}),
    "weights": ("/some/dir", {}),
    "file": ("x.gguf", {}),
    "mmproj": ("mmproj-F16.gguf", {}),
    "revision": ("main", {}),
    "load_format": ("safetensors", {}),
    "quantization": ("gguf", {}),
    "isq": ("q4k", {}),
    "dtype": ("bf16", {}),
    "max_model_len": (128, {}),
    "yarn_scaling_factor": (2.0, {}),
    "seed": (7, {}),
    "device": ("cpu", {}),
    "device_ids": ([0], {}),
    "attention_backend": ("torch", {}),
    "enable_cuda_graphs": (False, {}),
    "async_scheduling": (True, {}),
    "block_size": (32, {}),
    "kv_fraction": (0.5, {}),
    "gpu_memory_utilization": (0.8, {"device": "cuda"}),
    "mem_mb": (64, {}),
    "num_blocks": (9, {}),
    "kv_cache_dtype": ("fp8", {}),
    "enable_prefix_caching": (False, {}),
    "prefix_cache_max_tokens": (100, {}),
    "max_num_seqs": (4, {}),
    "max_num_batched_tokens": (512, {}),
    "prefill_chunk_size": (0, {}),
    "tensor_parallel_size": (1, {}),
    "num_nodes": (2, {"tensor_parallel_size": 2}),
    "node_rank": (1, {"num_nodes": 2, "tensor_parallel_size": 2}),
    "master_addr": ("10.0.0.1", {}),
    "master_port": (29600, {}),
    "rendezvous_timeout": (10.0, {}),
    "distributed_timeout": (20.0, {}),
    "all_reduce": ("nccl", {}),
}

#: (options, the flag the error names): each fails in EngineArgs, before any file is opened
BAD_VALUES = [
    ({"dtype": "int3"}, "--dtype"),
    ({"device": "tpu"}, "--device"),
    ({"attention_backend": "nope"}, "--attention-backend"),
    ({"load_format": "pickle"}, "--load-format"),
    ({"quantization": "q3-nonexistent"}, "--quantization"),
    ({"all_reduce": "custom"}, "--all-reduce"),
    ({"block_size": 12}, "--block-size"),
    ({"kv_fraction": 1.5}, "--kv-fraction"),
    ({"gpu_memory_utilization": 0.0}, "--gpu-memory-utilization"),
    ({"gpu_memory_utilization": 0.5, "device": "cpu"}, "--gpu-memory-utilization"),
    ({"mem_mb": 0}, "--mem"),
    ({"num_blocks": 0}, "--num-blocks"),
    ({"max_num_seqs": 0}, "--max-num-seqs"),
    ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"),
    ({"prefill_chunk_size": -1}, "--prefill-chunk-size"),
    ({"max_model_len": 0}, "--max-model-len"),
    ({"yarn_scaling_factor": 1.0}, "--yarn-scaling-factor"),
    ({"prefix_cache_max_tokens": -1}, "--prefix-cache-max-tokens"),
    ({"tensor_parallel_size": 3}, "tensor-parallel size"),
    ({"num_nodes": 0}, "--num-nodes"),
    ({"node_rank": 1}, "--node-rank"),
    ({"master_port": 70000}, "--master-port"),
    ({"rendezvous_timeout": 0.0}, "--rendezvous-timeout"),
    ({"distributed_timeout": -1.0}, "--distributed-timeout"),
    ({"device_ids": [0, 0]}, "--d"),
    ({"max_num_seqs": "many"}, "--max-num-seqs"),
]


def _serve_command() -> click.Command:
    from cli import serve_cmd

    app = typer.Typer()
    app.command("serve")(serve_cmd.serve)
    app.command("other")(lambda: None)
    return typer.main.get_command(app).commands["serve"]


def test_every_field_is_a_serve_flag_with_the_fields_default():
    params = {param.name: param for param in _serve_command().params}
    help_text = CliRunner().invoke(_serve_app(), ["serve", "--help"], env={"COLUMNS": "400"}).output
    for name, (_, meta, default) in engine_fields().items():
        flag = flag_of(name)
        assert flag in help_text, f"{name}: {flag} is not in fw serve --help"
        negated = meta.extra["negate"]
        param = params[flag.lstrip("-").replace("-", "_") if negated else name]
        assert flag in param.opts, (name, param.opts)
        assert (not param.default if negated else param.default) == default, (name, param.default, default)


def _serve_app() -> typer.Typer:
    from cli import serve_cmd

    app = typer.Typer()
    app.command("serve")(serve_cmd.serve)
    app.command("other")(lambda: None)
    return app


@pytest.mark.parametrize("name", list(engine_fields()))
def test_every_field_reaches_the_builder_and_llm(name, monkeypatch):
    value, beside = SAMPLES[name]
    options = {**beside, name: value}
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    builder = EngineBuilder(**options)
    assert getattr(builder.args, name) == value
    assert builder.args == EngineArgs.from_options(**options)  # everything else at the one default
    seen = []

    def build(self):
        seen.append(self.args)
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(EngineBuilder, "build", build)
    with pytest.raises(RuntimeError, match="stop before loading"):
        LLM(**options)
    assert seen == [builder.args]


def test_the_defaults_are_the_same_everywhere():
    assert EngineBuilder(device="cpu").args == EngineArgs(device="cpu") == EngineArgs.from_options(device="cpu")
    args = EngineArgs.from_options(model="m", max_num_seqs=3)
    assert EngineArgs.from_json(args.to_json()) == args  # the engine process and the workers get it as JSON


@pytest.mark.parametrize(("options", "flag"), BAD_VALUES, ids=[str(o) for o, _ in BAD_VALUES])
def test_a_bad_value_fails_before_the_model_is_opened(options, flag, monkeypatch):
    monkeypatch.setattr(model_loading, "resolve_local_path", lambda *args: pytest.fail("the model was looked up"))
    with pytest.raises(ConfigError) as error:
        LLM("HuggingFaceTB/no-such-model", **options)
    assert flag in str(error.value)
    if len(options) == 1:  # the message says what was given
        (value,) = options.values()
        assert repr(value) in str(error.value) or str(value) in str(error.value)


def _bounded_fields() -> set[str]:
    """The EngineArgs fields whose type carries a numeric bound (``ge``/``gt``/``le``/``lt``), at any depth."""
    import msgspec

    def metas(hint):
        for arg in typing.get_args(hint):
            if isinstance(arg, msgspec.Meta):
                yield arg
            else:
                yield from metas(arg)

    hints = typing.get_type_hints(EngineArgs, include_extras=True)
    bounds = ("ge", "gt", "le", "lt")
    return {name for name, hint in hints.items() if any(getattr(m, b) is not None for m in metas(hint) for b in bounds)}


def test_every_bounded_option_has_a_bad_value_case():
    """A new option with bounds gets its case in BAD_VALUES (so its refusal before loading is tested)."""
    bounded = _bounded_fields()
    assert {"max_num_seqs", "kv_fraction", "master_port"} <= bounded  # the walk finds nested bounds
    assert bounded <= {name for options, _ in BAD_VALUES for name in options}


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        ({"dtype": "int3"}, "--dtype"),
        ({"block_size": 12}, "--block-size"),
        ({"attention_backend": "nope"}, "--attention-backend"),
        ({"load_format": "pickle"}, "--load-format"),
    ],
)
def test_fw_serve_refuses_a_bad_engine_flag_before_starting_the_server(options, flag, monkeypatch):
    from framework.server import launcher

    monkeypatch.setattr(launcher, "run_server", lambda *args, **kwargs: pytest.fail("the server started"))
    ((name, value),) = options.items()
    result = CliRunner().invoke(_serve_app(), ["serve", "some/repo", flag, str(value)])
    assert result.exit_code == 2 and flag in result.output and str(value) in result.output, result.output


def test_serve_takes_the_model_as_an_argument_and_the_vllm_flag_names(monkeypatch):
    from framework.server import launcher

    calls = []
    monkeypatch.setattr(launcher, "run_server", lambda *args, **kwargs: calls.append(args) or 0)
    runner = CliRunner()
    result = runner.invoke(
        _serve_app(),
        [
            "serve",
            "./my-model",
            "--tool-call-parser",
            "hermes",
            "--gpu-memory-utilization",
            "0.8",
            "--device",
            "cuda",
            "--block-size",
            "32",
            "--max-num-batched-tokens",
            "4096",
            "--quantization",
            "gguf",
        ],
    )
    assert result.exit_code == 0, result.output
    ((engine_kwargs, config, _),) = calls
    assert engine_kwargs["model"] == "./my-model" and config.served_model_names == ["./my-model"]
    assert config.tool_parser == "hermes"
    assert (
        engine_kwargs["gpu_memory_utilization"],
        engine_kwargs["block_size"],
        engine_kwargs["max_num_batched_tokens"],
        engine_kwargs["quantization"],
    ) == (0.8, 32, 4096, "gguf")
    same = runner.invoke(_serve_app(), ["serve", "./my-model", "--m", "./my-model"])
    assert same.exit_code == 0, same.output
    both = runner.invoke(_serve_app(), ["serve", "./my-model", "--m", "./other"])
    assert both.exit_code == 2 and "disagree" in both.output


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return path, write_tiny_model(path, config)


def test_prefill_chunk_size_zero_computes_a_prompt_in_one_step(tiny_llama):
    path, reference = tiny_llama
    prompt = list(range(3, 43))  # 40 tokens
    llm = LLM(str(path), device="cpu", num_blocks=16, prefill_chunk_size=0)
    scheduler = llm.engine.core.scheduler.config
    assert scheduler.prefill_chunk_size == 64 and scheduler.max_num_batched_tokens >= 64  # the context length
    steps = []
    original = llm.engine.core.runner.launch

    def launch(batch, *args, **kwargs):
        steps.append(list(batch.num_new_tokens))
        return original(batch, *args, **kwargs)

    llm.engine.core.runner.launch = launch
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert steps[0] == [40]  # the whole prompt in the first step
    assert out.outputs[0].token_ids == reference_greedy(reference, prompt, 4)
    llm.close()
    with pytest.raises(
        ConfigError, match="--prefill-chunk-size 0 .* --max-num-batched-tokens 32 is below the context length 64"
    ):
        LLM(str(path), device="cpu", num_blocks=16, prefill_chunk_size=0, max_num_batched_tokens=32)


def test_a_quantization_the_checkpoint_does_not_declare_is_refused_before_weights_load(
    tiny_llama, tmp_path, monkeypatch, register_fw_plugin
):
    import shutil

    from framework.loader.safetensors_format import SafetensorsFormat

    path, _ = tiny_llama
    quantized = tmp_path / "declares-gguf"
    shutil.copytree(path, quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gguf"}}))
    monkeypatch.setattr(SafetensorsFormat, "iter_weights", lambda self: pytest.fail("a weight was read"))
    from framework import hookimpl
    from framework.specs import QuantMethodSpec

    class Plugin:
        @hookimpl
        def register_quantization_methods(self):
            return [QuantMethodSpec(name="other", impl="x:Y", description="a second method, for this test")]

    register_fw_plugin(Plugin(), name="other-quant")
    with pytest.raises(
        ConfigError,
        match="--quantization other disagrees with the checkpoint .* quantized with 'gguf'.* give --quantization gguf",
    ):
        LLM(str(quantized), device="cpu", num_blocks=16, quantization="other")


@pytest.mark.parametrize(
    ("step", "target", "flag"),
    [
        ("allocating the KV cache", (kv_cache_sizing, "allocate_kv_caches"), "--gpu-memory-utilization"),
        ("loading the weights", (model_loading.model_loader, "load_weights"), "--tp"),
    ],
)
def test_out_of_memory_at_start_up_names_the_flag_to_change(tiny_llama, monkeypatch, step, target, flag):
    path, _ = tiny_llama

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(*target, out_of_memory)
    with pytest.raises(ConfigError, match=f"ran out of memory while {step} .*Tried to allocate 20.00 GiB") as error:
        LLM(str(path), device="cpu", num_blocks=16)
    assert flag in str(error.value)


def test_gpu_memory_utilization_budgets_the_whole_gpu(monkeypatch):
    from framework.config import CacheConfig

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * gib, 80 * gib))  # 50 GiB in use
    cuda = torch.device("cuda", 0)
    assert kv_cache_sizing.kv_budget_bytes(CacheConfig(gpu_memory_utilization=0.9), cuda) == 72 * gib - 50 * gib
    assert kv_cache_sizing.kv_budget_bytes(CacheConfig(kv_fraction=0.5), cuda) == 15 * gib  # of the free memory
    assert kv_cache_sizing.kv_budget_bytes(CacheConfig(gpu_memory_utilization=0.9, mem_mb=100), cuda) == 100 << 20
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization 0.5 leaves no room .* 50.0 of the GPU's 80.0 GiB"):
        kv_cache_sizing.kv_budget_bytes(CacheConfig(gpu_memory_utilization=0.5), cuda)
