"""Qwen2-MoE and Qwen3-MoE from GGUF files (experts stacked per projection, as llama.cpp writes them).

A tiny random model is written twice, as safetensors (transformers' ``save_pretrained``) and as a
GGUF laid out like llama.cpp's converter output (``ffn_gate_exps`` ``[experts, width, hidden]``,
``ffn_gate_inp``, the shared-expert tensors, a dense layer's ``ffn_gate``); both load through fw.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from framework import LLM, SamplingParams
from framework.testing import capture_logits, check_logits_parity, interpreted, reference_greedy, write_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
import gguf_test_writer  # noqa: E402

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    tie_word_embeddings=False,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=96,
    rope_theta=10000.0,
)
CONFIGS = {
    "qwen2moe": lambda: transformers.Qwen2MoeConfig(**SMALL, shared_expert_intermediate_size=64, mlp_only_layers=[1]),
    "qwen3moe": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=32, norm_topk_prob=True),
}
PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 53))]

_ATTENTION = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
}
_SHARED = {"gate_proj": "ffn_gate_shexp", "up_proj": "ffn_up_shexp", "down_proj": "ffn_down_shexp"}


def gguf_tensors(model) -> dict[str, tuple[str, int | None, torch.Tensor]]:
    """transformers' state dict under llama.cpp's GGUF names and layouts:
    ``{gguf name: (HF name, chunk of it along dim 1 or None, tensor)}``."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = (name, None, tensor)
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = (name, None, tensor)
        elif name == "lm_head.weight":
            tensors["output.weight"] = (name, None, tensor)
        else:
            block, kind, rest = f"blk.{parts[2]}", parts[3], parts[4:]
            if kind in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"{block}.{'attn_norm' if kind == 'input_layernorm' else 'ffn_norm'}.weight"] = (
                    name,
                    None,
                    tensor,
                )
            elif kind == "self_attn":
                tensors[f"{block}.{_ATTENTION[rest[0]]}.{rest[1]}"] = (name, None, tensor)
            elif rest[0] == "experts" and rest[1] == "gate_up_proj":  # [E, 2I, H] -> gate and up stacks
                gate, up = tensor.chunk(2, dim=1)
                tensors[f"{block}.ffn_gate_exps.weight"] = (name, 0, gate)
                tensors[f"{block}.ffn_up_exps.weight"] = (name, 1, up)
            elif rest[0] == "experts":
                tensors[f"{block}.ffn_down_exps.weight"] = (name, None, tensor)
            elif rest[0] == "gate":
                tensors[f"{block}.ffn_gate_inp.weight"] = (name, None, tensor)
            elif rest[0] == "shared_expert_gate":
                tensors[f"{block}.ffn_gate_inp_shexp.weight"] = (name, None, tensor[0])  # llama.cpp: a [hidden] vector
            elif rest[0] == "shared_expert":
                tensors[f"{block}.{_SHARED[rest[1]]}.weight"] = (name, None, tensor)
            else:  # a dense layer's mlp.gate_proj / up_proj / down_proj
                tensors[f"{block}.ffn_{rest[0].removesuffix('_proj')}.weight"] = (name, None, tensor)
    return tensors


def hf_state_from(model, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model``'s state dict with the values a GGUF file holds (``stored``: GGUF name -> values)."""
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for gguf_name, (hf_name, chunk, _) in gguf_tensors(model).items():
        target = state[hf_name] if chunk is None else state[hf_name].chunk(2, dim=1)[chunk]
        target.copy_(stored[gguf_name].reshape(target.shape))
    return state


def write_gguf(path, arch: str, model, quantized: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Write ``model`` as a GGUF of ``arch``; tensors whose name contains one of ``quantized`` as
    Q8_0. Returns the values the file holds (dequantized), under the GGUF names."""
    config = model.config

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(10000.0)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)

    tensors = {name: tensor for name, (_, _, tensor) in gguf_tensors(model).items()}
    return gguf_test_writer.write_gguf(path, arch, tensors, metadata, config.vocab_size, quantized)


def engine_logits(path, prompts) -> torch.Tensor:
    llm = LLM(str(path), num_blocks=32, prefill_chunk_size=8, max_num_batched_tokens=16)
    records = capture_logits(llm)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1))
    return torch.stack([records[key] for key in sorted(records)])


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_moe(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = write_tiny_model(folder / "safetensors", CONFIGS[request.param]())
    return request.param, folder, reference


def test_gguf_moe_gives_the_logits_of_the_safetensors_checkpoint(tiny_moe):
    arch, folder, reference = tiny_moe
    write_gguf(folder / "model-f32.gguf", arch, reference)
    llm = LLM(str(folder / "model-f32.gguf"), num_blocks=16)
    assert llm.engine.model_config.architecture == type(reference).__name__
    layers = llm.engine.core.runner.model.model.layers
    assert [hasattr(layer.mlp, "experts") for layer in layers] == [
        hasattr(layer.mlp, "experts") for layer in reference.model.layers
    ]
    from_gguf = engine_logits(folder / "model-f32.gguf", PROMPTS)
    from_safetensors = engine_logits(folder / "safetensors", PROMPTS)
    torch.testing.assert_close(from_gguf, from_safetensors, rtol=1e-5, atol=1e-5)


def test_quantized_router_and_experts_match_transformers_on_the_same_values(tiny_moe, monkeypatch, check_kept_packed):
    """Q8_0 router and shared expert kept packed by the gguf LinearMethod and the Q8_0 expert stacks
    by the gguf FusedMoEMethod (``FW_GGUF_KEEP_PACKED``, the GPU path): the file's bytes, no dense copy."""
    from fw_gguf.moe import GGUFFusedMoEMethod

    from framework.layers.fused_moe import FusedMoE

    arch, folder, reference = tiny_moe
    stored = write_gguf(folder / "model-q8.gguf", arch, reference, quantized=("ffn_gate_inp", "_exps", "_shexp"))
    state = hf_state_from(reference, stored)
    down = "model.layers.0.mlp.experts.down_proj"
    assert not torch.equal(state[down], reference.state_dict()[down])  # quantization changed the values
    dequantized = gguf_test_writer.model_holding(reference, state)  # transformers holding exactly the file's values
    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")
    model = check_logits_parity(folder / "model-q8.gguf", dequantized, PROMPTS).engine.core.runner.model
    packed = check_kept_packed(model)
    quantized = {
        name
        for name, module in model.named_modules()
        if name in packed and {t.name for t in module.gguf_types} == {"Q8_0"}
    }
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse and {f"model.layers.{i}.mlp.gate" for i in sparse} <= quantized
    if arch == "qwen2moe":
        assert {
            f"model.layers.{i}.mlp.shared_expert.{p}" for i in sparse for p in ("gate_up_proj", "down_proj")
        } <= quantized
    experts = [module for module in model.modules() if isinstance(module, FusedMoE)]
    assert len(experts) == len(sparse)
    for index, layer in zip(sparse, experts, strict=True):
        assert isinstance(layer.quant_method, GGUFFusedMoEMethod)
        assert not [name for name, t in layer.named_parameters() if t.numel()]  # placeholders only
        for shard, projection in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            packed = getattr(layer, f"gguf_{shard}")
            assert packed.dtype == torch.uint8
            values = gguf.quants.dequantize(packed.numpy(), Q.Q8_0)  # gguf-py's own decoding of the kept bytes
            torch.testing.assert_close(
                torch.from_numpy(values), stored[f"blk.{index}.ffn_{projection}_exps.weight"], rtol=0, atol=0
            )


def test_quantized_moe_at_tp2_gives_the_greedy_ids_of_transformers(tiny_moe):
    """Tensor parallelism (gloo, 2 CPU ranks): the Q8_0 shared expert sharded by packed rows and
    blocks, the dequantized expert stacks sliced along their intermediate features per rank."""
    arch, folder, reference = tiny_moe
    stored = write_gguf(folder / "model-q8-tp.gguf", arch, reference, quantized=("ffn_gate_inp", "_exps", "_shexp"))
    dequantized = gguf_test_writer.model_holding(reference, hf_state_from(reference, stored))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(folder / "model-q8-tp.gguf"), device="cpu", num_blocks=16, tensor_parallel_size=2) as llm:
        assert llm.engine.summary["tensor_parallel_size"] == 2
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)]
    assert ids == [reference_greedy(dequantized, p, greedy.max_tokens) for p in PROMPTS]


def test_quantized_experts_load_lazily_into_the_model_dtype(tiny_moe):
    """The ``*_exps`` stacks come out of the format as lazy slices and land in a bf16 engine's
    FusedMoE as the file's values rounded once to bf16 (no fp32 copy of a whole stack)."""
    from fw_gguf.format import GGUFFormat
    from fw_gguf.lazy import GGUFTensorSlice

    arch, folder, reference = tiny_moe
    path = folder / "model-q8-bf16.gguf"
    stored = write_gguf(path, arch, reference, quantized=("ffn_gate_inp", "_exps", "_shexp"))
    lazy = {name for name, tensor in GGUFFormat(path).iter_weights() if isinstance(tensor, GGUFTensorSlice)}
    sparse = [i for i, layer in enumerate(reference.model.layers) if hasattr(layer.mlp, "experts")]
    assert lazy == {
        f"model.layers.{i}.mlp.experts.{p}.weight" for i in sparse for p in ("gate_proj", "up_proj", "down_proj")
    }
    llm = LLM(str(path), dtype="bf16", num_blocks=16)
    for i in sparse:
        experts = llm.engine.core.runner.model.model.layers[i].mlp.experts
        w13 = torch.cat([stored[f"blk.{i}.ffn_gate_exps.weight"], stored[f"blk.{i}.ffn_up_exps.weight"]], dim=1)
        assert experts.w13_weight.dtype == torch.bfloat16
        assert torch.equal(experts.w13_weight, w13.to(torch.bfloat16))
        assert torch.equal(experts.w2_weight, stored[f"blk.{i}.ffn_down_exps.weight"].to(torch.bfloat16))


@pytest.mark.gpu
def test_packed_experts_in_cuda_graphs_give_the_greedy_ids_of_transformers(tiny_moe):
    """On the GPU the Q8_0 expert stacks stay packed (GGUFFusedMoEMethod) through CUDA-graphed
    decode steps: one sequence (the per-pair GEMV) and six at once (more pairs than experts: every
    expert's bytes read by fw_gguf's Triton kernel) give transformers' greedy ids on the file's values."""
    from fw_gguf.moe import GGUFFusedMoEMethod

    from framework.layers.fused_moe import FusedMoE

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    arch, folder, reference = tiny_moe
    stored = write_gguf(folder / "model-q8-gpu.gguf", arch, reference, quantized=("ffn_gate_inp", "_exps", "_shexp"))
    dequantized = gguf_test_writer.model_holding(reference, hf_state_from(reference, stored))
    prompts = [*PROMPTS, *([3 + i, 17, 29 + i] for i in range(4))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(folder / "model-q8-gpu.gguf"), device="cuda", dtype="f32", num_blocks=64)
    assert "decode graphs" in llm.engine.summary["cuda_graphs"]
    experts = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(isinstance(e.quant_method, GGUFFusedMoEMethod) for e in experts)
    # fw_gguf's Triton kernel on planar stacks (graph-safe for any batch: no dequantize-everything path)
    assert all(e.gguf_planar and e.quant_method.fused_moe.__module__ == "fw_gguf.kernels.moe" for e in experts)
    for batch in ([prompts[0]], prompts):
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in batch], greedy)]
        assert ids == [reference_greedy(dequantized, p, greedy.max_tokens) for p in batch]


@interpreted
def test_packed_experts_through_the_triton_kernel_give_the_logits_of_the_reference_op(tmp_path, monkeypatch):
    """The engine's MoE layers on fw_gguf's Triton ``quantized_fused_moe`` (interpreted here and
    forced by ``FW_KERNELS``; CUDA picks it itself) over packed Q8_0 stacks: the logits the torch
    reference op gives on the same stacks."""
    from framework.layers.fused_moe import FusedMoE

    reference = write_tiny_model(tmp_path / "safetensors", CONFIGS["qwen3moe"]())
    path = tmp_path / "model-q8-experts.gguf"
    write_gguf(path, "qwen3moe", reference, quantized=("_exps",))
    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")
    expected = engine_logits(path, PROMPTS[:1])
    monkeypatch.setenv("FW_KERNELS", "quantized_fused_moe=triton_gguf")
    llm = LLM(str(path), num_blocks=32, prefill_chunk_size=8, max_num_batched_tokens=16)
    experts = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(e.quant_method.fused_moe.__module__ == "fw_gguf.kernels.moe" for e in experts)
    records = capture_logits(llm)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=1))
    torch.testing.assert_close(torch.stack([records[key] for key in sorted(records)]), expected, rtol=1e-4, atol=1e-4)
