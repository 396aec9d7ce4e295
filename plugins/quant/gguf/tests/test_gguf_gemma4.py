"""Gemma 4 text (`gemma4`) from GGUF files laid out as llama.cpp's converter writes them.

One tiny random Gemma 4 keeps every switch live: sliding (head 16, 2 KV heads) and full layers
(head 32, 1 KV head, keys as values: no `attn_v`), proportional RoPE on the full layers (a
`rope_freqs` mask of ones and 1e30s), the last two layers sharing K/V with double-wide MLPs (a
per-layer `feed_forward_length`), per-layer inputs, the MoE branch (fused `ffn_gate_up_exps`,
the router's scale and per-expert scale as `ffn_gate_inp.scale` / `ffn_down_exps.scale`),
random `layer_output_scale`s and final-logit soft-capping. fw's logits from the F32 file equal
transformers'; a Q8_0 file (experts kept packed, the key projection also filling the values)
gives the greedy ids of transformers holding the file's values.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from framework import LLM, SamplingParams
from framework.errors import ModelLoadError
from framework.testing import (
    PARITY_PROMPTS,
    check_logits_parity,
    random_causal_lm,
    reference_greedy,
    tiny_gemma4_text,
)

sys.path.insert(0, str(Path(__file__).parent))
from gguf_test_writer import model_holding, write_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = tiny_gemma4_text(
    shared_kv=True, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32
)
TYPES = CONFIG["layer_types"]
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
_LAYER = {
    "layer_scalar": "layer_output_scale.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
}


def gguf_names(model) -> dict[str, str]:
    """HF name -> llama.cpp name of every tensor the converter writes (a tied head is not written)."""
    names = {}
    for name in model.state_dict():
        if name in _GLOBAL:
            names[name] = _GLOBAL[name]
        elif name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            names[name] = f"blk.{index}.{_LAYER[rest]}"
    return names


def gguf_tensors(model) -> dict[str, torch.Tensor]:
    """transformers' state dict under llama.cpp's names, plus the converter's `rope_freqs` mask."""
    state = model.state_dict()
    tensors = {gguf: state[hf] for hf, gguf in gguf_names(model).items()}
    config = model.config
    head_dim, params = CONFIG["global_head_dim"], config.rope_parameters["full_attention"]
    rotated = int(head_dim * params["partial_rotary_factor"] / 2)
    tensors["rope_freqs.weight"] = torch.tensor([1.0] * rotated + [1e30] * (head_dim // 2 - rotated))
    return tensors


def metadata(config, skip: str | None = None):
    """The converter's `gemma4.*` keys for ``config`` (one left out when ``skip`` names it)."""
    c = CONFIG  # transformers' Gemma 4 config hides the per-layer values behind per_layer_config
    num_layers, first_shared = c["num_hidden_layers"], c["num_hidden_layers"] - c["num_kv_shared_layers"]
    is_swa = [t == "sliding_attention" for t in TYPES]
    keys = {
        "block_count": num_layers,
        "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"],
        "feed_forward_length": [c["intermediate_size"] * (2 if i >= first_shared else 1) for i in range(num_layers)],
        "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": [
            c["num_key_value_heads"] if swa else c["num_global_key_value_heads"] for swa in is_swa
        ],
        "attention.key_length": c["global_head_dim"],
        "attention.value_length": c["global_head_dim"],
        "attention.key_length_swa": c["head_dim"],
        "attention.value_length_swa": c["head_dim"],
        "rope.dimension_count": c["global_head_dim"],
        "rope.dimension_count_swa": c["head_dim"],
        "attention.sliding_window": c["sliding_window"],
        "attention.shared_kv_layers": c["num_kv_shared_layers"],
        "embedding_length_per_layer_input": c["hidden_size_per_layer_input"],
        "expert_count": c["num_experts"],
        "expert_used_count": c["top_k_experts"],
        "expert_feed_forward_length": c["moe_intermediate_size"],
    }

    def add(writer) -> None:
        for name, value in keys.items():
            if name == skip:
                continue
            if isinstance(value, list):
                writer.add_array(f"gemma4.{name}", value)
            else:
                writer.add_uint32(f"gemma4.{name}", value)
        if skip != "attention.sliding_window_pattern":
            writer.add_array("gemma4.attention.sliding_window_pattern", is_swa)
        params = config.rope_parameters
        writer.add_float32("gemma4.rope.freq_base", params["full_attention"]["rope_theta"])
        writer.add_float32("gemma4.rope.freq_base_swa", params["sliding_attention"]["rope_theta"])
        writer.add_float32("gemma4.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
        writer.add_float32("gemma4.final_logit_softcapping", c["final_logit_softcapping"])

    return add


@pytest.fixture(scope="module")
def reference():
    """Random norms, and ``layer_scalar``s and the routers' scales in [0.5, 1.5] (ones in a fresh model)."""
    model = random_causal_lm(transformers.Gemma4TextConfig(**CONFIG))
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers:
            for param in (layer.layer_scalar, layer.router.scale, layer.router.per_expert_scale):
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
    return model


def write(path, reference, quantized: tuple[str, ...] = (), skip: str | None = None) -> dict[str, torch.Tensor]:
    config = reference.config
    return write_gguf(path, "gemma4", gguf_tensors(reference), metadata(config, skip), CONFIG["vocab_size"], quantized)


def test_f32_gguf_gives_the_logits_of_transformers(reference, tmp_path):
    write(tmp_path / "model-f32.gguf", reference)
    llm = check_logits_parity(tmp_path / "model-f32.gguf", reference, PARITY_PROMPTS[:2])
    assert llm.engine.model_config.architecture == "Gemma4ForCausalLM"
    layers = llm.engine.core.runner.model.model.layers
    assert [layer.self_attn.head_size for layer in layers] == [16, 32, 16, 16, 32]
    assert [layer.layer.kv_mode for layer in layers] == [None, "store", "store", "reuse", "reuse"]
    assert all(layer.layer.k_eq_v == (t == "full_attention") for layer, t in zip(layers, TYPES, strict=True))
    assert torch.equal(layers[2].moe.router.per_expert_scale, reference.model.layers[2].router.per_expert_scale)


#: What the Q8_0 file quantizes: the experts, the router, the MLPs, and the q / k / o projections.
QUANTIZED = ("_exps.weight", "ffn_gate_inp.weight", "ffn_up.", "ffn_down.", "attn_q.", "attn_k.", "attn_output")


def test_q8_experts_stay_packed_and_give_the_greedy_ids_of_the_files_values(
    reference, tmp_path, monkeypatch, check_kept_packed
):
    path = tmp_path / "model-q8.gguf"
    stored = write(path, reference, QUANTIZED)
    names = gguf_names(reference)
    dequantized = model_holding(reference, {hf: stored[gguf] for hf, gguf in names.items()})
    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")
    llm = LLM(str(path), num_blocks=16, prefill_chunk_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS[:2]], greedy)
    assert [r.outputs[0].token_ids for r in results] == [
        reference_greedy(dequantized, p, greedy.max_tokens) for p in PARITY_PROMPTS[:2]
    ]
    packed = check_kept_packed(llm.engine.core.runner.model)
    assert {"model.layers.1.self_attn.qkv_proj", "model.layers.0.moe.router.proj"} <= set(packed)
    from fw_gguf.moe import GGUFFusedMoEMethod

    assert isinstance(llm.engine.core.runner.model.model.layers[0].moe.experts.quant_method, GGUFFusedMoEMethod)


@pytest.mark.parametrize("skip", ["attention.sliding_window_pattern", "attention.key_length_swa"])
def test_missing_required_metadata_is_named(reference, tmp_path, skip):
    write(tmp_path / "bad.gguf", reference, skip=skip)
    with pytest.raises(ModelLoadError, match=f"gemma4.{skip}"):
        LLM(str(tmp_path / "bad.gguf"), num_blocks=16)


def test_rope_freqs_mask_gives_the_partial_rotary_factor():
    from fw_gguf.gemma4 import proportional_rotary_factor

    assert proportional_rotary_factor([1.0] * 4 + [1e30] * 12, 32) == 0.25
    assert proportional_rotary_factor([1.0] * 16, 32) == 1.0
    for factors in ([1e30] * 4 + [1.0] * 12, [1.0] * 4 + [8.0] * 12, [1.0] * 8):
        with pytest.raises(ValueError, match="rope_freqs"):
            proportional_rotary_factor(factors, 32)


@pytest.mark.gpu
def test_gpu_packed_geglu_experts_in_cuda_graphs_give_the_greedy_ids_of_the_files_values(reference, tmp_path):
    """On the GPU the Q8_0 GeGLU experts stay packed (GGUFFusedMoEMethod) through CUDA-graphed
    decode steps; one sequence and six at once."""
    from fw_gguf.moe import GGUFFusedMoEMethod

    path = tmp_path / "model-q8.gguf"
    stored = write(path, reference, QUANTIZED)
    dequantized = model_holding(reference, {hf: stored[gguf] for hf, gguf in gguf_names(reference).items()})
    prompts = [*PARITY_PROMPTS[:2], *([3 + i, 17, 29 + i] for i in range(4))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(path), device="cuda", dtype="f32", num_blocks=64)
    assert "decode graphs" in llm.engine.summary["cuda_graphs"]
    layers = llm.engine.core.runner.model.model.layers
    assert all(isinstance(layer.moe.experts.quant_method, GGUFFusedMoEMethod) for layer in layers)
    for batch in ([prompts[0]], prompts):
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in batch], greedy)]
        assert ids == [reference_greedy(dequantized, p, greedy.max_tokens) for p in batch]
