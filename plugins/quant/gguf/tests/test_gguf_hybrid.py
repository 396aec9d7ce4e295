"""Qwen3.5 (`qwen35`), Qwen3.5-MoE (`qwen35moe`) and Qwen3-Next (`qwen3next`) from GGUF files laid
out as llama.cpp's converter writes them (`conversion/qwen.py`: `_LinearAttentionVReorderBase`,
`Qwen3NextModel`).

A tiny random model (grouped value heads: 4 over 2 key heads; randomised norms) is written by
transformers, then as a GGUF from the same weights by an independent writer that follows the
converter: Qwen3.5's value heads regrouped into tiled order (rows of the v part of `in_proj_qkv`
and of the conv, of `in_proj_z`, `in_proj_a/b`, `A_log`, `dt_bias`; columns of `out_proj`),
Qwen3-Next's `in_proj_qkvz` split into `attn_qkv` and `attn_gate`, `A_log` stored as
`-exp(A_log)`, `dt_bias` as `ssm_dt.bias`, the conv squeezed, every norm but the DeltaNet output
norm stored `1 + w`, the MoE's `gate_up_proj` split; names from gguf-py's own table; an MTP block
after the decoder's. fw's logits from the F32 file equal transformers'; a Q8_0 file (its matrices
and experts packed) gives the greedy ids of transformers holding the file's values. Qwen3.5's
`out_proj` stays packed with its tiled columns (its input gathered into their order), also where
8-wide value heads split Q8_0 blocks; Qwen3-Next's F32 `attn_gate` beside a Q8_0 `attn_qkv` makes
its `in_proj_qkvz` floats.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from framework import LLM, SamplingParams
from framework.testing import PARITY_PROMPTS, check_logits_parity, reference_greedy, write_randomised_model

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]
SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=3,
    layer_types=LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40)
CONFIGS = {
    "qwen35": lambda: transformers.Qwen3_5TextConfig(**SMALL, linear_value_head_dim=8, intermediate_size=96),
    "qwen35moe": lambda: transformers.Qwen3_5MoeTextConfig(**SMALL, **MOE, linear_value_head_dim=32),
    # every layer sparse: llama.cpp's qwen3next has no dense feed-forward (no mlp_only_layers)
    "qwen3next": lambda: transformers.Qwen3NextConfig(**SMALL, **MOE, linear_value_head_dim=8, intermediate_size=96),
}


def tiling(config, width: int) -> torch.Tensor:
    """The converter's `_reorder_v_heads`: value heads (``width`` rows each) grouped by key head
    ``[Hk, Hv/Hk, width]`` -> tiled ``[Hv/Hk, Hk, width]``, as a gather index: ``tiled = grouped[index]``."""
    num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
    return torch.arange(num_v * width).reshape(num_k, num_v // num_k, width).transpose(0, 1).reshape(-1)


def _reordered(config, name: str) -> tuple[int, torch.Tensor | None]:
    """``(dim, index)`` of `_LinearAttentionVReorderBase`'s value-head reordering of this tensor
    (Qwen3.5 only; index None: none)."""
    if not isinstance(config, (transformers.Qwen3_5TextConfig, transformers.Qwen3_5MoeTextConfig)):
        return 0, None
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    dv = config.linear_value_head_dim
    leaf = name.rsplit(".linear_attn.", 1)[-1]
    if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
        return 0, torch.cat([torch.arange(2 * key_dim), 2 * key_dim + tiling(config, dv)])
    if leaf == "in_proj_z.weight":
        return 0, tiling(config, dv)
    if leaf in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return 0, tiling(config, 1)
    if leaf == "out_proj.weight":
        return 1, tiling(config, dv)
    return 0, None


def _split_qkvz(config, tensor: torch.Tensor) -> tuple[list[torch.Tensor], Callable]:
    """Qwen3NextModel: ``in_proj_qkvz`` (per key head ``q, k, v, z``) -> ``attn_qkv`` (all q, all
    k, all v) and ``attn_gate`` (z); with the function that joins them back."""
    num_k, dk = config.linear_num_key_heads, config.linear_key_head_dim
    group = config.linear_num_value_heads // num_k * config.linear_value_head_dim
    sizes = [dk, dk, group, group]
    q, k, v, z = tensor.view(num_k, sum(sizes), -1).split(sizes, dim=1)

    def join(pieces: list[torch.Tensor]) -> torch.Tensor:
        qkv, gate = pieces
        q, k, v = (x.reshape(num_k, -1, qkv.shape[-1]) for x in qkv.split([num_k * dk, num_k * dk, num_k * group]))
        return torch.cat([q, k, v, gate.reshape(num_k, group, -1)], dim=1).reshape(-1, qkv.shape[-1])

    return [torch.cat([x.reshape(-1, tensor.shape[-1]) for x in (q, k, v)]), z.reshape(-1, tensor.shape[-1])], join


def converted(config, name: str, tensor: torch.Tensor) -> tuple[list[tuple[str, torch.Tensor]], Callable]:
    """``([(HF name as the converter names it, GGUF values)], back)`` for one HF tensor, ``back``
    taking the pieces' values to the HF tensor (the inverse of the converter's changes)."""
    dim, index = _reordered(config, name)
    values = tensor if index is None else tensor.index_select(dim, index)
    # Qwen3NextModel.modify_tensors
    shift = name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")
    if name.endswith(".A_log"):
        values = -torch.exp(values)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        values = values.squeeze()
    elif shift:
        values = values + 1

    def back(pieces: list[torch.Tensor]) -> torch.Tensor:
        value = torch.cat(pieces, dim=-2) if len(pieces) > 1 else pieces[0]  # the experts' gate and up
        if name.endswith(".A_log"):
            value = torch.log(-value)
        value = value.unsqueeze(1) if "conv1d" in name else value - 1 if shift else value
        return value if index is None else value.index_select(dim, torch.argsort(index))

    if name.endswith(".in_proj_qkvz.weight"):
        (qkv, gate), join = _split_qkvz(config, values)
        base = name.removesuffix(".in_proj_qkvz.weight")
        return [(f"{base}.in_proj_qkv.weight", qkv), (f"{base}.in_proj_z.weight", gate)], join
    if name.endswith("mlp.experts.gate_up_proj"):  # Qwen2MoeModel: gate_up split on dim -2
        gate, up = values.chunk(2, dim=-2)
        base = name.removesuffix(".gate_up_proj")
        return [(f"{base}.gate_proj.weight", gate), (f"{base}.up_proj.weight", up)], back
    if name.endswith("mlp.experts.down_proj"):
        name += ".weight"
    return [(name, values)], back


def is_quantized(arch: str, gguf_name: str, values: torch.Tensor) -> bool:
    """The Q8_0 file's packed tensors: 2-D matrices and expert stacks (rows of whole 32-blocks), not
    norms or the conv (as llama.cpp's quantizer leaves them); in the qwen3next file not `attn_gate`
    either (a type unlike `attn_qkv`'s: the two join into one float `in_proj_qkvz`)."""
    return (
        not (arch == "qwen3next" and "attn_gate" in gguf_name)
        and values.dim() >= 2
        and values.shape[-1] % 32 == 0
        and "norm" not in gguf_name
        and "conv1d" not in gguf_name
        and "ffn_gate_inp" not in gguf_name
    )


def write_gguf(path, arch: str, model, quantize: bool = False) -> dict[str, torch.Tensor]:
    """``model`` as a GGUF of ``arch`` (float32, or Q8_0 matrices); returns the HF state dict that
    holds the file's values (the reference for a quantized file)."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    # one MTP block after the decoder's, as the converter counts it (fw skips it)
    writer.add_block_count(config.num_hidden_layers + 1)
    writer.add_nextn_predict_layers(1)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    if arch != "qwen35moe":
        writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    recurrent = [t == "linear_attention" for t in config.layer_types]
    writer.add_array(f"{arch}.attention.recurrent_layers", [*recurrent, False])
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters["partial_rotary_factor"]))
    if arch != "qwen3next":  # _Qwen35MRopeMixin
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if arch != "qwen35":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<s>", "</s>", "a", "b", "ab", *(f"t{i}" for i in range(5, config.vocab_size))])
    writer.add_token_types([3, 3, *([1] * (config.vocab_size - 2))])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    name_map = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_hidden_layers + 1
    )
    mtp = f"blk.{config.num_hidden_layers}"
    writer.add_tensor(f"{mtp}.nextn.eh_proj.weight", np.ones((config.hidden_size, 2 * config.hidden_size), np.float32))
    writer.add_tensor(
        f"{mtp}.attn_q.weight",
        np.ones((2 * config.num_attention_heads * config.head_dim, config.hidden_size), np.float32),
    )
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    held = dict(state)
    for hf_name, tensor in state.items():
        pieces, back = converted(config, hf_name, tensor)
        stored = []
        for name, values in pieces:
            base, suffix = (name, "") if name.endswith((".A_log",)) else name.rsplit(".", 1)
            gguf_name = name_map.get_name(base) + (f".{suffix}" if suffix else "")
            array = values.float().contiguous().numpy()
            if quantize and is_quantized(arch, gguf_name, values):
                packed = gguf.quants.quantize(array, Q.Q8_0)
                writer.add_tensor(gguf_name, packed, raw_dtype=Q.Q8_0)
                array = gguf.quants.dequantize(packed, Q.Q8_0)
            else:
                writer.add_tensor(gguf_name, np.ascontiguousarray(array))
            stored.append(torch.from_numpy(np.array(array)))
        if quantize:  # the file's values back in the HF layout
            held[hf_name] = back(stored).reshape(tensor.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def test_config_states_the_hybrid_layout(tmp_path):
    """The file's config is transformers' own (DeltaNet sizes, layer types, partial rotary, MoE
    sizes) with the MTP block left out; without `recurrent_layers` every fourth layer is attention."""
    from fw_gguf.config import hf_config_from_gguf
    from fw_gguf.reader import open_gguf

    reference = transformers.Qwen3_5MoeForCausalLM(CONFIGS["qwen35moe"]())
    write_gguf(tmp_path / "model.gguf", "qwen35moe", reference)
    file = open_gguf(tmp_path / "model.gguf")
    config = hf_config_from_gguf(file.metadata, file.tensors)
    rebuilt = transformers.AutoConfig.for_model(**config).to_dict()
    expected = reference.config.to_dict()
    keys = [
        *(k for k in expected if k.startswith("linear_")),
        "layer_types",
        "rope_parameters",
        "num_hidden_layers",
        "head_dim",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ]
    assert {k: rebuilt[k] for k in keys} == {k: expected[k] for k in keys}
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    metadata = {k: v for k, v in file.metadata.items() if k != "qwen35moe.attention.recurrent_layers"}
    assert hf_config_from_gguf(metadata)["layer_types"] == ["linear_attention"] * 3  # 3 layers, interval 4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, write_randomised_model(folder / "safetensors", CONFIGS[request.param]())


def test_f32_gguf_gives_the_logits_of_transformers(tiny):
    arch, folder, reference = tiny
    write_gguf(folder / "model-f32.gguf", arch, reference)
    llm = check_logits_parity(folder / "model-f32.gguf", reference, PARITY_PROMPTS)
    assert llm.engine.model_config.architecture == type(reference).__name__
    assert llm.engine.summary["state_slots"] > 0


def test_q8_gguf_stays_packed_and_gives_the_greedy_ids_of_the_files_values(tiny, monkeypatch, check_kept_packed):
    arch, folder, reference = tiny
    held = write_gguf(folder / "model-q8.gguf", arch, reference, quantize=True)
    dequantized = transformers.AutoModelForCausalLM.from_config(reference.config, dtype=torch.float32).eval()
    dequantized.load_state_dict(held)
    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")
    llm = LLM(str(folder / "model-q8.gguf"), num_blocks=16, prefill_chunk_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS[:2]], greedy)
    expected = [reference_greedy(dequantized, p, greedy.max_tokens) for p in PARITY_PROMPTS[:2]]
    assert [r.outputs[0].token_ids for r in results] == expected
    packed = check_kept_packed(llm.engine.core.runner.model)
    gdn = "model.layers.0.linear_attn"
    if arch == "qwen3next":
        assert f"{gdn}.in_proj_ba" in packed and f"{gdn}.in_proj_qkvz" not in packed
    else:
        assert f"{gdn}.in_proj_qkv" in packed and "model.layers.2.linear_attn.in_proj_z" in packed
    # out_proj's tiled columns: whole Q8_0 blocks per 32-wide value head; split by 8-wide ones
    assert f"{gdn}.out_proj" in packed  # Qwen3.5's tiled columns kept, the input gathered into their order
    orders = llm.engine.core.runner.model.model.layers[0].linear_attn.out_proj.linear_method.input_order
    assert orders == (None if arch == "qwen3next" else [2, 4, reference.config.linear_value_head_dim])
    out_proj = llm.engine.core.runner.model.model.layers[0].linear_attn.out_proj
    weight = out_proj.linear_method.dequantize(out_proj)  # in the model's order
    assert torch.equal(weight, held["model.layers.0.linear_attn.out_proj.weight"])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_q8_hybrid_in_cuda_graphs_gives_the_greedy_ids_of_the_files_values(arch, tmp_path):
    """On the GPU (fp32; the DeltaNet ops' Triton kernels, decode in CUDA graphs) a Q8_0 file's
    packed matrices and experts give the greedy ids of transformers holding the file's values,
    one sequence and six at once."""
    reference = write_randomised_model(tmp_path / "safetensors", CONFIGS[arch]())
    held = write_gguf(tmp_path / "model-q8.gguf", arch, reference, quantize=True)
    dequantized = transformers.AutoModelForCausalLM.from_config(reference.config, dtype=torch.float32).eval()
    dequantized.load_state_dict(held)
    prompts = [*PARITY_PROMPTS[:2], *([3 + i, 17, 29 + i] for i in range(4))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(tmp_path / "model-q8.gguf"), device="cuda", dtype="f32", num_blocks=64)
    assert "decode graphs" in llm.engine.summary["cuda_graphs"]
    for batch in ([prompts[0]], prompts):
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in batch], greedy)]
        assert ids == [reference_greedy(dequantized, p, greedy.max_tokens) for p in batch]
