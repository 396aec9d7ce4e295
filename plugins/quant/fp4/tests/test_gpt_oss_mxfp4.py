"""gpt-oss with MXFP4 experts through the whole engine against transformers (which dequantizes the
checkpoint's MXFP4 experts on the CPU): logits and greedy ids, and the method's bad-input errors."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_gpt_oss import tiny_gpt_oss_config, write_mxfp4_gpt_oss

from framework import LLM
from framework.errors import ConfigError
from framework.testing import PARITY_PROMPTS, check_greedy_parity, check_logits_parity, tiny_model_fixture

tiny = tiny_model_fixture({"gpt_oss_mxfp4": tiny_gpt_oss_config}, write=write_mxfp4_gpt_oss)


def test_batched_chunked_prefill_logits_match_transformers(tiny):
    check_logits_parity(*tiny, PARITY_PROMPTS)


def test_greedy_tokens_match_transformers_with_chunked_prefill(tiny):
    # (prefix caching and preemption do not depend on the expert format: the bf16 gpt-oss suite runs them)
    check_greedy_parity(*tiny, PARITY_PROMPTS)


def test_experts_stay_mxfp4_and_the_rest_bf16(tiny):
    path, _ = tiny
    model = LLM(str(path), num_blocks=16).engine.core.runner.model
    experts = model.model.layers[0].mlp.experts
    assert type(experts.quant_method).__name__ == "Mxfp4FusedMoEMethod"
    assert experts.mxfp4_w13.dtype == torch.uint8 and tuple(experts.mxfp4_w13.shape) == (8, 128, 32)
    assert not hasattr(experts, "w13_weight")  # packed, never expanded
    assert model.model.layers[0].self_attn.qkv_proj.quant_method.__class__.__name__ == "UnquantizedLinearMethod"


def _rewrite_config(path, **quantization):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(quantization)
    (path / "config.json").write_text(json.dumps(config))


def test_unknown_group_size_or_scale_format_is_a_clear_error(tmp_path):
    write_mxfp4_gpt_oss(tmp_path)
    _rewrite_config(tmp_path, group_size=16)
    with pytest.raises(ConfigError, match="group size 16 is not supported; MXFP4 has one e8m0 scale per 32"):
        LLM(str(tmp_path), num_blocks=16)
    _rewrite_config(tmp_path, group_size=32, scale_format="e4m3")
    with pytest.raises(ConfigError, match="scale format 'e4m3' is not supported"):
        LLM(str(tmp_path), num_blocks=16)


def test_experts_whose_width_is_not_whole_blocks_are_refused(tmp_path):
    write_mxfp4_gpt_oss(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 48  # 1.5 blocks of 32 per expert row
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="intermediate size per rank 48 is not a multiple of MXFP4's block of 32"):
        LLM(str(tmp_path), num_blocks=16)
