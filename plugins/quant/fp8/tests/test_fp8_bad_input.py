"""FP8 settings fw cannot run are refused with a ConfigError naming what is supported, before any
weight is read: other block sizes and formats, static scales on block weights, W8A8 asked for on a
device without FP8 tensor cores; and a compressed-tensors FP8 checkpoint goes to this plugin."""

from __future__ import annotations

import pytest
import torch
from fw_fp8.config import CompressedTensorsFp8Config, Fp8Config, ModelOptFp8Config
from fw_fp8.hooks import resolve_quantization_method
from tiny_fp8_checkpoints import compressed_tensors_config

from framework.errors import ConfigError


@pytest.mark.parametrize(
    ("config_cls", "config", "message"),
    [
        (
            Fp8Config,
            {"quant_method": "fp8", "weight_block_size": [64, 64]},
            r"weight block size \[64, 64\] is not supported; supported: \[128, 128\]",
        ),
        (Fp8Config, {"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported; supported: e4m3"),
        (
            Fp8Config,
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "'static' with weight_block_size is not supported",
        ),
        (ModelOptFp8Config, {"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo 'NVFP4' is not supported"),
    ],
)
def test_unsupported_settings_are_config_errors_naming_what_is_valid(config_cls, config, message):
    with pytest.raises(ConfigError, match=message):
        config_cls.from_config(config)


def test_compressed_tensors_block_size_is_checked():
    config = compressed_tensors_config("block", False)
    config["config_groups"]["group_0"]["weights"]["block_structure"] = [128, 64]
    with pytest.raises(ConfigError, match=r"supported: \[128, 128\]"):
        CompressedTensorsFp8Config.from_config(config)


def test_w8a8_asked_for_on_a_cpu_without_the_interpreter_is_refused(monkeypatch):
    class Model:
        dtype = torch.bfloat16

    monkeypatch.setenv("FW_FP8_KERNEL", "w8a8")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(
        ConfigError, match=r"needs FP8 tensor cores \(CUDA sm_89\+.*supported here: FW_FP8_KERNEL=w8a16"
    ):
        config.verify(Model(), torch.device("cpu"))
    monkeypatch.setenv("FW_FP8_KERNEL", "fast")
    with pytest.raises(ConfigError, match="FW_FP8_KERNEL='fast' is not a choice; valid: auto, w8a16, w8a8"):
        config.verify(Model(), torch.device("cpu"))


def test_a_compressed_tensors_fp8_checkpoint_resolves_to_this_plugin():
    assert resolve_quantization_method(compressed_tensors_config("channel", False), None) == "compressed-tensors-fp8"
    integer = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4}}},
    }
    assert resolve_quantization_method(integer, None) is None


def test_a_split_that_cuts_a_weight_block_is_refused_at_build():
    from framework.layers import RowParallelLinear

    config = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError, match="each rank's 96 input features \\(of 192\\) to be whole blocks of 128"):
        RowParallelLinear(192, 64, quant_config=config, tp_size=2, tp_rank=0)
