"""The ``--isq`` seam: names checked before anything loads, listed when wrong; a checkpoint that is
already quantized refused naming its format; the flag on the CLI; the stream quantizing only what
the method takes, on the way to the loaders."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from typer.testing import CliRunner

from framework import isq
from framework.engine.args import EngineArgs
from framework.engine.builder import EngineBuilder
from framework.errors import ConfigError, UnknownNameError
from framework.testing import write_tiny_model

CONFIG = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def test_an_unknown_isq_type_lists_the_valid_ones():
    with pytest.raises(UnknownNameError) as caught:
        EngineArgs.from_options(model="x", device="cpu", isq="q4km").check_names()
    message = str(caught.value)
    assert "--isq" in message and "'q4km'" in message
    for name in ("q4_0", "q8_0", "q2k", "q4k", "q6k", "int4", "int8"):
        assert name in message


def test_every_isq_type_belongs_to_one_method():
    methods = {name: spec.name for name, spec in isq.isq_methods().items()}
    assert methods["q4k"] == "gguf" and methods["q5_1"] == "gguf" and methods["int4"] == "gptq"


def test_isq_and_quantization_together_are_refused():
    with pytest.raises(ConfigError, match="leave --quantization gguf out"):
        EngineArgs.from_options(model="x", device="cpu", isq="q4k", quantization="gguf").check_names()


def test_isq_on_an_already_quantized_checkpoint_names_its_format(tmp_path):
    write_tiny_model(tmp_path, transformers.LlamaConfig(**CONFIG))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"already quantized \(gptq\).*bf16/fp16/fp32 checkpoint"):
        EngineBuilder(str(tmp_path), device="cpu", isq="q8_0").load_model()


def test_isq_on_a_gguf_file_is_refused(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_context_length(64)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(8)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 32).numpy(), raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    builder = EngineBuilder(str(tmp_path / "m.gguf"), device="cpu", isq="q4k")
    builder.open_source()
    with pytest.raises(ConfigError, match=r"already quantized \(gguf\)"):
        isq.refuse_quantized_source(builder.source, "q4k", "m.gguf")


class _HalvingConfig:
    """A stand-in method: 'quantizes' names ending in ``.a`` to a half-size int8 tensor."""

    def quantize_weight(self, name, weight):
        if not name.endswith(".a"):
            return None
        return [(name + "_q", weight[:, : weight.shape[1] // 2].to(torch.int8))]


def test_quantize_stream_replaces_what_the_method_takes_and_passes_the_rest():
    weights = [
        ("m.a", torch.ones(4, 8)),
        ("m.b", torch.ones(4, 8)),
        ("m.norm", torch.ones(8)),
        ("m.ids", torch.ones(4, 8, dtype=torch.int64)),
    ]
    report = isq.IsqReport("fake")
    out = dict(isq.quantize_stream(iter(weights), _HalvingConfig(), torch.device("cpu"), report))
    assert list(out) == ["m.a_q", "m.b", "m.norm", "m.ids"]
    assert out["m.a_q"].dtype == torch.int8 and out["m.a_q"].shape == (4, 4)
    assert report.num_quantized == 1 and report.source_bytes == 4 * 8 * 4 and report.quantized_bytes == 16
    assert report.describe().startswith("--isq fake: quantized 1 tensors")


def test_isq_flag_is_on_serve_generate_and_bench():
    from cli.main import build_app

    app = build_app()
    for command in ("serve", "generate", "bench"):
        result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert "--isq" in result.output, command
