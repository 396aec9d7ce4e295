"""Checkpoints fw cannot run are refused with a ConfigError that says what is valid, before any
weight is read: bit widths, group sizes and formats that are not built, an AWQ model in a dtype the
kernel cannot take on the GPU, sizes a format cannot pack; and a g_idx that names groups the
scales do not have, when the layer is loaded."""

from __future__ import annotations

import pytest
import torch
import transformers
from fw_gptq.config import AWQConfig, CompressedTensorsConfig, GPTQConfig
from schemes import FormatScheme
from tiny_checkpoints import quantize_checkpoint

from framework import LLM
from framework.errors import ConfigError
from framework.testing import write_tiny_model


@pytest.mark.parametrize(
    ("config_cls", "config", "message"),
    [
        (GPTQConfig, {"bits": 3, "group_size": 128}, "3-bit weights are not supported; supported bits: 4, 8"),
        (GPTQConfig, {"bits": 4, "group_size": 256}, "group size 256 is not supported; supported: 32, 64, 128, -1"),
        (GPTQConfig, {"bits": 4, "group_size": 128, "checkpoint_format": "exllama"}, "checkpoint_format 'exllama'"),
        (GPTQConfig, {"bits": 8, "group_size": 128, "is_marlin_format": True}, "only 4-bit symmetric weights"),
        (AWQConfig, {"bits": 8, "group_size": 128}, "8-bit weights are not supported; supported bits: 4"),
        (AWQConfig, {"bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
        (CompressedTensorsConfig, {"format": "float-quantized"}, "format 'float-quantized' is not supported"),
        (
            CompressedTensorsConfig,
            {
                "format": "pack-quantized",
                "config_groups": {
                    "g": {
                        "weights": {"num_bits": 4, "strategy": "group", "group_size": 128},
                        "input_activations": {"num_bits": 8},
                    }
                },
            },
            "quantized input activations are not supported",
        ),
    ],
)
def test_unsupported_settings_are_config_errors_naming_what_is_valid(config_cls, config, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        config_cls.from_config(config)


def test_awq_in_float32_on_the_gpu_is_refused_before_loading():
    class Model:
        dtype = torch.float32

    config = AWQConfig.from_config({"bits": 4, "group_size": 128})
    with pytest.raises(ConfigError, match="activations in bfloat16, float16 on cuda, not float32"):
        config.verify(Model(), torch.device("cuda"))
    config.verify(Model(), torch.device("cpu"))  # the CPU computes in float32


def test_a_rank_whose_inputs_are_not_whole_groups_is_refused_at_build():
    from framework.layers import RowParallelLinear

    config = GPTQConfig.from_config(FormatScheme("gptq", 4, 64).config())
    with pytest.raises(ConfigError, match="96 input features are not a whole number of groups of 64"):
        RowParallelLinear(192, 64, quant_config=config, tp_size=2, tp_rank=0)


def test_a_short_last_group_loads_on_one_device(tmp_path):
    """576 inputs in groups of 128 (SmolLM2): GPTQ tools write a last group of 64; so does this 96 in 64."""
    from framework import SamplingParams
    from framework.testing import reference_greedy

    reference = write_tiny_model(
        tmp_path,
        transformers.LlamaConfig(
            vocab_size=160,
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=1,
            num_attention_heads=3,
            num_key_value_heads=1,
        ),
    )
    quantize_checkpoint(tmp_path, reference, FormatScheme("gptq", 4, 64))
    with LLM(str(tmp_path), device="cpu", dtype="float32", num_blocks=8) as llm:
        ids = llm.generate(
            {"prompt_token_ids": [5, 9, 33]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        )
    assert ids[0].outputs[0].token_ids == reference_greedy(reference, [5, 9, 33], 6)


def test_a_g_idx_naming_missing_groups_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    reference = write_tiny_model(
        tmp_path,
        transformers.LlamaConfig(
            vocab_size=160,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    )
    quantize_checkpoint(tmp_path, reference, FormatScheme("gptq", 4, 32, act_order=True))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name] + 4  # groups 4..11 of 8
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"mlp.down_proj.*g_idx names groups 4\.\.11 but the weight has 8 groups"):
        LLM(str(tmp_path), device="cpu", dtype="float32", num_blocks=8)
