"""fw_gguf.config against transformers' reading of the same GGUF files."""

from __future__ import annotations

import gguf
import pytest
import torch
from fw_gguf.config import (
    hf_config_from_gguf,
    norm_weight_offset,
    qk_unpermute_heads,
    qk_unpermute_index,
    tensor_name_map,
    unpermute_qk,
)
from fw_gguf.dequant import dequantize
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

# what transformers' config holds beyond config.json's model description (paths, the unk id)
_NOT_COMPARED = {"_name_or_path", "_model_name_or_path", "architectures", "unk_token_id", "sliding_window_pattern"}


def test_config_matches_transformers(real_gguf, hf_reference):
    _, reference = hf_reference(real_gguf.path)
    ours = hf_config_from_gguf(real_gguf.metadata, real_gguf.tensors)
    # every value transformers derives, after its own config class normalises ours (rope_parameters)
    rebuilt = AutoConfig.for_model(**ours).to_dict()
    expected = {k: v for k, v in reference.to_dict().items() if k not in _NOT_COMPARED}
    assert {k: rebuilt.get(k) for k in expected} == expected
    # and the raw dict says the same in config.json terms
    fields = [
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ]
    assert {f: ours[f] for f in fields} == {f: getattr(reference, f) for f in fields}
    rope = reference.rope_parameters
    assert ours["rope_theta"] == rope.get("full_attention", rope)["rope_theta"] and ours["rope_scaling"] is None


def test_smollm2_config_values(smollm2_gguf):
    config = hf_config_from_gguf(smollm2_gguf.metadata, smollm2_gguf.tensors)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_act"] == "silu"
    assert (config["head_dim"], config["num_key_value_heads"], config["rope_theta"]) == (64, 3, 100000.0)
    assert config["tie_word_embeddings"] is True and config["attention_bias"] is False


def test_gemma3_config_values(gemma3_gguf):
    config = hf_config_from_gguf(gemma3_gguf.metadata, gemma3_gguf.tensors)
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10000.0)
    assert (config["sliding_window"], config["sliding_window_pattern"], config["query_pre_attn_scalar"]) == (
        512,
        6,
        256,
    )
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert config["final_logit_softcapping"] is None and config["hidden_activation"] == "gelu_pytorch_tanh"
    assert "tie_word_embeddings" not in hf_config_from_gguf(gemma3_gguf.metadata)


def test_gemma2_conventions_and_rope_scaling_from_metadata():
    md = {
        "general.architecture": "gemma2",
        "gemma2.embedding_length": 4608,
        "gemma2.block_count": 46,
        "gemma2.feed_forward_length": 36864,
        "gemma2.attention.head_count": 32,
        "gemma2.attention.head_count_kv": 16,
        "gemma2.attention.key_length": 128,
        "gemma2.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma2.context_length": 8192,
        "gemma2.attention.sliding_window": 4096,
        "gemma2.vocab_size": 256000,
        "gemma2.final_logit_softcapping": 30.0,
        "gemma2.attn_logit_softcapping": 50.0,
        "gemma2.rope.scaling.type": "linear",
        "gemma2.rope.scaling.factor": 8.0,
    }
    config = hf_config_from_gguf(md)
    assert config["query_pre_attn_scalar"] == 144  # 27B: hidden / heads, as llama.cpp and HF's config.json
    assert config["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (config["final_logit_softcapping"], config["attn_logit_softcapping"]) == (30.0, 50.0)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0} and config["rope_theta"] == 10000.0
    with pytest.raises(ValueError, match="'mamba' is not supported by fw_gguf; supported: llama, qwen2"):
        hf_config_from_gguf({"general.architecture": "mamba"})
    with pytest.raises(KeyError, match="lacks gemma2.embedding_length"):
        hf_config_from_gguf({k: v for k, v in md.items() if k != "gemma2.embedding_length"})


def test_tensor_name_map_covers_both_files_and_matches_transformers_models(real_gguf):
    config = hf_config_from_gguf(real_gguf.metadata, real_gguf.tensors)
    names = tensor_name_map(real_gguf.architecture, config["num_hidden_layers"])
    assert set(real_gguf.tensors) <= set(names)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    hf_names = {names[n] for n in real_gguf.tensors}
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    assert hf_names == expected
    # gguf-py's own HF -> GGUF table agrees, name by name
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == real_gguf.architecture)
    gguf_map = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for gguf_name in real_gguf.tensors:
        base, suffix = names[gguf_name].rsplit(".", 1)
        assert gguf_map.get_name(base) + "." + suffix == gguf_name


def test_unpermute_qk_on_packed_rows_equals_unpermute_after_dequant(smollm2_gguf):
    md = smollm2_gguf.metadata
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for name, heads in (("blk.3.attn_q.weight", 9), ("blk.3.attn_k.weight", 3)):
        info = smollm2_gguf.tensors[name]
        assert qk_unpermute_heads(md, name) == heads
        unpacked_then_permuted = unpermute_qk(info.dequantize(), heads)
        permuted_then_unpacked = dequantize(unpermute_qk(info.data, heads), info.qtype, info.shape)
        assert torch.equal(permuted_then_unpacked, unpacked_then_permuted)
        # the same rows as transformers' reverse permutation of the dequantized weight
        reference = processor.process(weights=info.dequantize().numpy(), name=name).weights
        assert torch.equal(unpacked_then_permuted, torch.from_numpy(reference))
        assert not torch.equal(unpacked_then_permuted, info.dequantize())
    assert qk_unpermute_heads(md, "blk.3.attn_v.weight") is None


def test_unpermute_index_layout_and_which_models_need_it(gemma3_gguf):
    # one head of 8 rows: gguf stores the rotary halves interleaved
    assert qk_unpermute_index(8, 1).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert qk_unpermute_index(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    bias = torch.arange(8.0)
    assert unpermute_qk(bias, 2).tolist() == [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]
    with pytest.raises(ValueError, match="do not split into 3 heads"):
        qk_unpermute_index(8, 3)
    for arch in ("qwen2", "qwen3", "gemma3", "phi3"):
        assert qk_unpermute_heads({"general.architecture": arch}, "blk.0.attn_q.weight") is None
    assert qk_unpermute_heads(gemma3_gguf.metadata, "blk.0.attn_q.weight") is None


def test_norm_weight_offset_for_gemma_only():
    assert [norm_weight_offset(a) for a in ("gemma2", "gemma3", "llama", "qwen3")] == [1.0, 1.0, 0.0, 0.0]
