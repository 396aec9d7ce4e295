"""DeepSeek-V3 (`deepseek2`), DeepSeek-V2 (`deepseek2`, softmax router) and GLM-4.5 (`glm4moe`)
from GGUF files laid out as llama.cpp's converter writes them.

A tiny random model (random score-correction biases) is written by transformers, then as a GGUF
from the same weights: experts stacked per projection, the router's bias as `exp_probs_b.bias`,
MLA's `kv_b_proj` split into `attn_k_b` (transposed per head) and `attn_v_b` (whole, as
`attn_kv_b`, in the DeepSeek-V2 file: llama.cpp's older layout), and for glm4moe an
MTP block counted in `block_count` (`nextn_predict_layers`). fw's logits from the GGUF equal
transformers' (fp32); a Q8_0 file keeps its experts and shared experts packed and gives the
greedy ids of transformers holding the file's values.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest
import torch
import transformers

from framework import LLM, SamplingParams
from framework.testing import PARITY_PROMPTS, check_logits_parity, reference_greedy, write_grouped_moe_model

sys.path.insert(0, str(Path(__file__).parent))
import gguf_test_writer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MLA = dict(
    kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=32, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4
)
SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    initializer_range=0.1,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
CONFIGS = {
    "deepseek2_v3": (
        "deepseek2",
        lambda: transformers.DeepseekV3Config(
            **SMALL,
            **MLA,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=YARN,
        ),
    ),
    "deepseek2_v2": (
        "deepseek2",
        lambda: transformers.DeepseekV2Config(
            **SMALL, **MLA, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.5
        ),
    ),
    "glm4moe": (
        "glm4moe",
        lambda: transformers.Glm4MoeConfig(
            **SMALL,
            num_key_value_heads=2,
            head_dim=16,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
            attention_bias=True,
        ),
    ),
}
_MLA_NAMES = {
    "q_proj": "attn_q",
    "q_a_proj": "attn_q_a",
    "q_b_proj": "attn_q_b",
    "q_a_layernorm": "attn_q_a_norm",
    "kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "kv_a_layernorm": "attn_kv_a_norm",
    "o_proj": "attn_output",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd",
    "model.norm.weight": "output_norm",
    "lm_head.weight": "output",
}
_GQA_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
}


def gguf_tensors(arch: str, model, sources: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """transformers' state dict under llama.cpp's names and layouts (llama.cpp's converter, by hand);
    ``sources`` (if given) receives ``{gguf name: HF name}`` of the tensors stored unchanged.
    DeepSeek-V2 files keep ``attn_kv_b`` whole (as llama.cpp wrote them before splitting it)."""
    config, tensors = model.config, {}
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        if name in _GLOBAL_NAMES:
            tensors[_GLOBAL_NAMES[name]] = tensor
            continue
        block, kind, rest = f"blk.{parts[2]}", parts[3], parts[4:]
        if kind == "input_layernorm":
            tensors[f"{block}.attn_norm.weight"] = tensor
        elif kind == "post_attention_layernorm":
            tensors[f"{block}.{'post_attention_norm' if arch == 'glm4moe' else 'ffn_norm'}.weight"] = tensor
        elif kind == "self_attn" and rest[0] == "kv_b_proj" and isinstance(config, transformers.DeepseekV2Config):
            tensors[f"{block}.attn_kv_b.weight"] = tensor
        elif kind == "self_attn" and rest[0] == "kv_b_proj":  # [H*(N+V), L] -> k_b [H, L, N], v_b [H, V, L]
            heads, nope = config.num_attention_heads, config.qk_nope_head_dim
            k_b, v_b = tensor.view(heads, nope + config.v_head_dim, -1).split([nope, config.v_head_dim], dim=1)
            tensors[f"{block}.attn_k_b.weight"], tensors[f"{block}.attn_v_b.weight"] = k_b.transpose(1, 2), v_b
        elif kind == "self_attn":
            tensors[f"{block}.{(_GQA_NAMES if arch == 'glm4moe' else _MLA_NAMES)[rest[0]]}.{rest[1]}"] = tensor
        elif rest[0] == "gate":
            tensors[f"{block}.{'ffn_gate_inp.weight' if rest[1] == 'weight' else 'exp_probs_b.bias'}"] = tensor
        elif rest[0] == "experts" and rest[1] == "gate_up_proj":
            tensors[f"{block}.ffn_gate_exps.weight"], tensors[f"{block}.ffn_up_exps.weight"] = tensor.chunk(2, dim=1)
        elif rest[0] == "experts":
            tensors[f"{block}.ffn_down_exps.weight"] = tensor
        elif rest[0] == "shared_experts":
            tensors[f"{block}.ffn_{rest[1].removesuffix('_proj')}_shexp.weight"] = tensor
        else:  # a dense layer's mlp
            tensors[f"{block}.ffn_{rest[0].removesuffix('_proj')}.weight"] = tensor
    tensors = {name if "." in name else f"{name}.weight": tensor for name, tensor in tensors.items()}
    if sources is not None:
        state = model.state_dict()
        sources.update(
            {
                gguf_name: hf_name
                for gguf_name, tensor in tensors.items()
                for hf_name, hf in state.items()
                if tensor.shape == hf.shape and tensor.data_ptr() == hf.data_ptr()
            }
        )
    return tensors


def write_gguf(path, arch: str, model, quantized: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """``model`` as a GGUF of ``arch`` (tensors whose name contains one of ``quantized`` as Q8_0);
    returns the values the file holds under the GGUF names."""
    config, tensors = model.config, gguf_tensors(arch, model)
    num_layers = config.num_hidden_layers
    if arch == "glm4moe":  # the MTP block llama.cpp keeps: counted in block_count, skipped by fw
        tensors.update(
            {
                name.replace(f"blk.{num_layers - 1}.", f"blk.{num_layers}."): t.clone()
                for name, t in tensors.items()
                if name.startswith(f"blk.{num_layers - 1}.")
            }
        )
        tensors[f"blk.{num_layers}.nextn.eh_proj.weight"] = torch.randn(config.hidden_size, 2 * config.hidden_size)
        num_layers += 1

    def metadata(writer: gguf.GGUFWriter) -> None:
        if arch == "glm4moe":
            writer.add_nextn_predict_layers(1)
        writer.add_block_count(num_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(10000.0)
        writer.add_expert_count(config.n_routed_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_leading_dense_block_count(config.first_k_dense_replace)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        if config.norm_topk_prob:
            writer.add_expert_weights_norm(True)
        if arch == "glm4moe":
            writer.add_head_count_kv(config.num_key_value_heads)
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
            writer.add_rope_dimension_count(config.head_dim // 2)
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        else:  # MLA written as llama.cpp writes it: one KV head of the latent
            writer.add_head_count_kv(1)
            writer.add_q_lora_rank(config.q_lora_rank)
            writer.add_kv_lora_rank(config.kv_lora_rank)
            writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
            writer.add_value_length(config.kv_lora_rank)
            writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
            writer.add_value_length_mla(config.v_head_dim)
            writer.add_rope_dimension_count(config.qk_rope_head_dim)
            if isinstance(config, transformers.DeepseekV3Config):
                writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
                writer.add_expert_group_count(config.n_group)
                writer.add_expert_group_used_count(config.topk_group)
                writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
                writer.add_rope_scaling_factor(YARN["factor"])
                writer.add_rope_scaling_orig_ctx_len(YARN["original_max_position_embeddings"])
                writer.add_rope_scaling_yarn_beta_fast(YARN["beta_fast"])
                writer.add_rope_scaling_yarn_beta_slow(YARN["beta_slow"])
                writer.add_rope_scaling_yarn_log_mul(0.1 * YARN["mscale_all_dim"])

    return gguf_test_writer.write_gguf(path, arch, tensors, metadata, config.vocab_size, quantized)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    arch, make_config = CONFIGS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return arch, folder, write_grouped_moe_model(folder / "safetensors", make_config())


def test_f32_gguf_gives_the_logits_of_transformers(tiny):
    arch, folder, reference = tiny
    write_gguf(folder / "model-f32.gguf", arch, reference)
    llm = check_logits_parity(folder / "model-f32.gguf", reference, PARITY_PROMPTS[:2])
    assert llm.engine.model_config.architecture == type(reference).__name__
    assert len(llm.engine.core.runner.model.model.layers) == reference.config.num_hidden_layers


#: What the Q8_0 files quantize: experts, shared experts, o_proj, MLA's split kv_b_proj and the router.
QUANTIZED = ("_exps", "_shexp", "attn_output", "attn_k_b", "attn_v_b", "ffn_gate_inp")


def file_values_reference(arch: str, reference, stored: dict[str, torch.Tensor]):
    """A transformers model of ``reference``'s config holding the values a GGUF file holds (``stored``)."""
    sources = {}
    gguf_tensors(arch, reference, sources)
    dequantized = transformers.AutoModelForCausalLM.from_config(
        reference.config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    state = dequantized.state_dict()
    for hf_name, tensor in reference.state_dict().items():
        state[hf_name].copy_(tensor)
    for gguf_name, hf_name in sources.items():  # the file's values wherever a tensor is stored unchanged
        state[hf_name].copy_(stored[gguf_name])
    if arch == "deepseek2":  # kv_b_proj from the (quantized) split halves, joined as fw joins them
        from fw_gguf.grouped_moe import kv_b_from_split

        for i in range(reference.config.num_hidden_layers):
            state[f"model.layers.{i}.self_attn.kv_b_proj.weight"].copy_(
                kv_b_from_split(stored[f"blk.{i}.attn_k_b.weight"], stored[f"blk.{i}.attn_v_b.weight"])
            )
    for i in range(1, reference.config.num_hidden_layers):  # expert stacks: chunks of one HF tensor
        prefix = f"model.layers.{i}.mlp.experts"
        state[f"{prefix}.gate_up_proj"].copy_(
            torch.cat([stored[f"blk.{i}.ffn_gate_exps.weight"], stored[f"blk.{i}.ffn_up_exps.weight"]], dim=1)
        )
        state[f"{prefix}.down_proj"].copy_(stored[f"blk.{i}.ffn_down_exps.weight"])
    assert not torch.equal(
        state["model.layers.1.mlp.experts.down_proj"], reference.state_dict()["model.layers.1.mlp.experts.down_proj"]
    )
    dequantized.load_state_dict(state)
    return dequantized


@pytest.mark.parametrize("tiny", ["deepseek2_v3", "glm4moe"], indirect=True)
def test_q8_experts_stay_packed_and_give_the_greedy_ids_of_the_files_values(tiny, monkeypatch, check_kept_packed):
    """Q8_0 experts and shared experts (kept packed, ``FW_GGUF_KEEP_PACKED``) and attention matrices;
    the router and MLA's joined kv_b_proj load as floats (fw keeps both unquantized). The sigmoid
    routers only: DeepSeek-V2's softmax router is the F32 test's (its experts load the same way)."""
    arch, folder, reference = tiny
    stored = write_gguf(folder / "model-q8.gguf", arch, reference, quantized=QUANTIZED)
    dequantized = file_values_reference(arch, reference, stored)
    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")
    llm = LLM(str(folder / "model-q8.gguf"), num_blocks=16, prefill_chunk_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS[:2]], greedy)
    expected = [reference_greedy(dequantized, p, greedy.max_tokens) for p in PARITY_PROMPTS[:2]]
    assert [r.outputs[0].token_ids for r in results] == expected
    model = llm.engine.core.runner.model
    packed = check_kept_packed(model)
    assert "model.layers.1.mlp.shared_experts.down_proj" in packed and "model.layers.0.self_attn.o_proj" in packed
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32


@pytest.mark.gpu
def test_glm4moe_packed_experts_in_cuda_graphs_give_the_greedy_ids_of_transformers(tmp_path):
    """On the GPU the Q8_0 expert stacks of a glm4moe file stay packed (GGUFFusedMoEMethod) through
    CUDA-graphed decode steps, the router in float32 beside them; one sequence and six at once."""
    from fw_gguf.moe import GGUFFusedMoEMethod

    from framework.layers.fused_moe import FusedMoE

    reference = write_grouped_moe_model(tmp_path / "safetensors", CONFIGS["glm4moe"][1]())
    stored = write_gguf(tmp_path / "model-q8.gguf", "glm4moe", reference, quantized=QUANTIZED)
    dequantized = file_values_reference("glm4moe", reference, stored)
    prompts = [*PARITY_PROMPTS[:2], *([3 + i, 17, 29 + i] for i in range(4))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(tmp_path / "model-q8.gguf"), device="cuda", dtype="f32", num_blocks=64)
    assert "decode graphs" in llm.engine.summary["cuda_graphs"]
    experts = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(isinstance(e.quant_method, GGUFFusedMoEMethod) for e in experts)
    for batch in ([prompts[0]], prompts):
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in batch], greedy)]
        assert ids == [reference_greedy(dequantized, p, greedy.max_tokens) for p in batch]
