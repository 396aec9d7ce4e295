"""gpt-oss (`gpt-oss`) from GGUF files laid out as llama.cpp's converter (``GptOssModel``) writes them.

A tiny random transformers gpt-oss (sliding window on alternate layers, YaRN, sinks, biased experts)
has its experts quantized to MXFP4 by this test's own packer (table and nearest value, the OCP
rule) in the checkpoint layout (``*_blocks`` / ``*_scales``, gate and up rows interleaved); the
writer then does what the converter does: splits gate_up rows and biases (even: gate, odd: up),
moves each block's nibbles into ggml's order behind its scale byte (MXFP4 tensors), renames the
sinks, router and post-attention norm. fw serves the file with the experts still MXFP4 (fw_fp4's
method) and gives the logits and greedy ids of transformers holding the dequantized experts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from fw_gguf.config import hf_config_from_gguf
from gguf import GGMLQuantizationType as Q

from framework.testing import PARITY_PROMPTS, check_greedy_parity, check_logits_parity, random_causal_lm

sys.path.insert(0, str(Path(__file__).parent))
from gguf_test_writer import write_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=512,
    initializer_range=0.1,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
)

#: e2m1 code -> value (OCP MX table; codes 8..15 the negatives).
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

_GLOBAL = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
}


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` -> gpt-oss checkpoint ``(blocks [..., K/32, 16], scales [..., K/32])``: per 32
    values the power of two putting the largest magnitude at most 6, each value's nearest code."""
    groups = weight.float().unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0))
    codes = (groups / torch.exp2(exponent).unsqueeze(-1)).unsqueeze(-1).sub(E2M1).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def unpack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()
    return (E2M1[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)


def to_ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """The converter's repack: per block the scale byte, then 16 bytes whose low nibbles are values
    0..15 and high nibbles 16..31 (``transform_nibble_layout``), rows of ``K/32 * 17`` bytes."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # [..., K/32, 32] in order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).flatten(-2).numpy()


@pytest.fixture(scope="module")
def model_with_mxfp4_experts():
    """transformers' gpt-oss with random sinks and expert biases, experts (and layer 1's o_proj)
    holding MXFP4 values; returns it and their checkpoint tensors ``{layer: {name: tensor}}``."""
    model = random_causal_lm(transformers.GptOssConfig(**CONFIG))
    generator = torch.Generator().manual_seed(3)
    checkpoint = {}
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=generator))
            experts, tensors = layer.mlp.experts, {}
            for name in ("gate_up_proj", "down_proj"):
                bias = getattr(experts, f"{name}_bias")
                bias.copy_(0.3 * torch.randn(bias.shape, generator=generator))
                weight = getattr(experts, name)  # [E, in, out]
                blocks, scales = pack_mxfp4(weight.transpose(1, 2))  # rows: outputs
                weight.copy_(unpack_mxfp4(blocks, scales).transpose(1, 2))
                tensors.update({f"{name}_blocks": blocks, f"{name}_scales": scales, f"{name}_bias": bias.clone()})
            if index == 1:  # one dense MXFP4 matrix too (llama.cpp can write any 2-D tensor as MXFP4)
                o_proj = layer.self_attn.o_proj.weight
                tensors["o_proj"] = pack_mxfp4(o_proj)
                o_proj.copy_(unpack_mxfp4(*tensors["o_proj"]))
            checkpoint[index] = tensors
    return model, checkpoint


def metadata(config):
    """The converter's `gpt-oss.*` keys (TextModel's, YaRN's, and GptOssModel's sliding window and expert width)."""

    def add(writer) -> None:
        for name, value in {
            "block_count": config.num_hidden_layers,
            "context_length": config.max_position_embeddings,
            "embedding_length": config.hidden_size,
            "feed_forward_length": config.intermediate_size,
            "expert_feed_forward_length": config.intermediate_size,
            "attention.head_count": config.num_attention_heads,
            "attention.head_count_kv": config.num_key_value_heads,
            "attention.key_length": config.head_dim,
            "attention.value_length": config.head_dim,
            "attention.sliding_window": config.sliding_window,
            "expert_count": config.num_local_experts,
            "expert_used_count": config.num_experts_per_tok,
            "rope.scaling.original_context_length": config.rope_parameters["original_max_position_embeddings"],
        }.items():
            writer.add_uint32(f"gpt-oss.{name}", value)
        rope = config.rope_parameters
        writer.add_float32("gpt-oss.rope.freq_base", rope["rope_theta"])
        writer.add_float32("gpt-oss.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
        writer.add_string("gpt-oss.rope.scaling.type", "yarn")
        writer.add_float32("gpt-oss.rope.scaling.factor", rope["factor"])
        writer.add_float32("gpt-oss.rope.scaling.yarn_beta_fast", rope["beta_fast"])
        writer.add_float32("gpt-oss.rope.scaling.yarn_beta_slow", rope["beta_slow"])

    return add


def write_gpt_oss_gguf(path: Path, model, checkpoint, float_stacks: tuple[str, ...] = ()) -> None:
    """The converter's tensors: float ones through ``write_gguf``, the MXFP4 experts packed (those
    named in ``float_stacks`` as their float32 values instead, as a re-quantized file may hold them)."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name in _GLOBAL:
            tensors[f"{_GLOBAL[name]}.weight"] = tensor
            continue
        _, _, index, rest = name.split(".", 3)
        if rest == "self_attn.sinks":
            tensors[f"blk.{index}.attn_sinks.weight"] = tensor
        elif ".experts." not in rest and not (rest == "self_attn.o_proj.weight" and "o_proj" in checkpoint[int(index)]):
            module, suffix = rest.rsplit(".", 1)
            tensors[f"blk.{index}.{_LAYER[module]}.{suffix}"] = tensor
    experts = {}
    for index, parts in checkpoint.items():
        block = f"blk.{index}"
        gate_up_blocks, gate_up_scales = parts["gate_up_proj_blocks"], parts["gate_up_proj_scales"]
        stacks = {
            "ffn_gate_exps": (gate_up_blocks[:, ::2], gate_up_scales[:, ::2]),
            "ffn_up_exps": (gate_up_blocks[:, 1::2], gate_up_scales[:, 1::2]),
            "ffn_down_exps": (parts["down_proj_blocks"], parts["down_proj_scales"]),
        }
        if "o_proj" in parts:
            experts[f"{block}.attn_output.weight"] = (to_ggml_mxfp4(*parts["o_proj"]), Q.MXFP4)
        for stack, (blocks, scales) in stacks.items():
            name = f"{block}.{stack}.weight"
            if name in float_stacks:
                tensors[name] = unpack_mxfp4(blocks, scales)
            else:
                experts[name] = (to_ggml_mxfp4(blocks, scales), Q.MXFP4)
        tensors[f"{block}.ffn_gate_exps.bias"] = parts["gate_up_proj_bias"][..., ::2]
        tensors[f"{block}.ffn_up_exps.bias"] = parts["gate_up_proj_bias"][..., 1::2]
        tensors[f"{block}.ffn_down_exps.bias"] = parts["down_proj_bias"]
    write_gguf(path, "gpt-oss", tensors, metadata(model.config), model.config.vocab_size, prepacked=experts)


@pytest.fixture(scope="module")
def gpt_oss_gguf(model_with_mxfp4_experts, tmp_path_factory):
    model, checkpoint = model_with_mxfp4_experts
    path = tmp_path_factory.mktemp("gpt_oss") / "gpt-oss-mxfp4.gguf"
    write_gpt_oss_gguf(path, model, checkpoint)
    return path, model


def test_metadata_gives_the_gpt_oss_config():
    config = transformers.GptOssConfig(**CONFIG)
    md = {"general.architecture": "gpt-oss", "tokenizer.ggml.tokens": ["a"] * config.vocab_size}
    metadata(config)(_KeyRecorder(md))
    hf = hf_config_from_gguf(md, ["blk.0.attn_q.bias", "output.weight"])
    assert hf["architectures"] == ["GptOssForCausalLM"] and hf["layer_types"] == config.layer_types
    assert (hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"]) == (4, 2, 64)
    assert (hf["swiglu_limit"], hf["swiglu_alpha"], hf["attention_bias"], hf["tie_word_embeddings"]) == (
        7.0,
        1.702,
        True,
        False,
    )
    rope = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
    assert hf["rope_scaling"] == rope and hf["rope_theta"] == 150000.0


def test_mxfp4_gguf_gives_the_logits_of_transformers_with_experts_packed(gpt_oss_gguf, model_with_mxfp4_experts):
    """Also through layer 1's dense MXFP4 o_proj (the gguf linear method's dequantizing path)."""
    path, reference = gpt_oss_gguf
    checkpoint = model_with_mxfp4_experts[1]
    llm = check_logits_parity(path, reference, PARITY_PROMPTS)
    model = llm.engine.core.runner.model
    assert llm.engine.model_config.architecture == "GptOssForCausalLM"
    experts = model.model.layers[0].mlp.experts
    assert type(experts.quant_method).__name__ == "Mxfp4FusedMoEMethod"
    # gate rows then up rows, 64 inputs as 32 bytes each: the file's MXFP4, never expanded
    assert experts.mxfp4_w13.dtype == torch.uint8 and tuple(experts.mxfp4_w13.shape) == (4, 128, 32)
    assert not hasattr(experts, "w13_weight")
    # exactly the bytes fw_fp4 keeps for the checkpoint itself: gate rows (even), then up rows (odd)
    blocks, scales = checkpoint[0]["gate_up_proj_blocks"], checkpoint[0]["gate_up_proj_scales"]
    assert torch.equal(experts.mxfp4_w13, torch.cat([blocks[:, ::2], blocks[:, 1::2]], 1).flatten(-2))
    assert torch.equal(experts.mxfp4_w13_scales, torch.cat([scales[:, ::2], scales[:, 1::2]], 1).int().add(14).byte())
    assert torch.equal(experts.mxfp4_w2, checkpoint[0]["down_proj_blocks"].flatten(-2))
    assert [layer.self_attn.attn.config.sliding_window for layer in model.model.layers] == [8, None]
    assert llm.engine.core.runner.model.model.layers[1].self_attn.o_proj.gguf_types[0].name == "MXFP4"


def test_mxfp4_gguf_gives_the_greedy_ids_of_transformers(gpt_oss_gguf, monkeypatch):
    monkeypatch.setenv(
        "FW_GGUF_KEEP_PACKED", "1"
    )  # dense layers packed too, dequantized in each apply (the GPU's path)
    check_greedy_parity(*gpt_oss_gguf, PARITY_PROMPTS[:2], steps=12)


def test_a_layer_with_a_float_expert_stack_is_dequantized_at_load(model_with_mxfp4_experts, tmp_path):
    """A file whose layer-0 down stack is not MXFP4 (re-quantized): that layer takes plain weights."""
    model, checkpoint = model_with_mxfp4_experts
    path = tmp_path / "mixed.gguf"
    write_gpt_oss_gguf(path, model, checkpoint, float_stacks=("blk.0.ffn_down_exps.weight",))
    assert {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}["blk.0.ffn_down_exps.weight"] == Q.F32
    llm = check_logits_parity(path, model, PARITY_PROMPTS[:1])
    layers = llm.engine.core.runner.model.model.layers
    assert type(layers[0].mlp.experts.quant_method).__name__ == "UnquantizedFusedMoEMethod"
    assert type(layers[1].mlp.experts.quant_method).__name__ == "Mxfp4FusedMoEMethod"


def test_mxfp4_experts_without_fw_fp4_are_a_clear_error(gpt_oss_gguf, monkeypatch):
    from framework import LLM
    from framework.errors import ConfigError

    monkeypatch.setitem(sys.modules, "fw_fp4.moe", None)  # as if fw-fp4 were not installed
    with pytest.raises(ConfigError, match=r"experts are MXFP4, which run on the fp4 plugin.*install fw-fp4"):
        LLM(str(gpt_oss_gguf[0]), num_blocks=16)


def steps_off_the_scoring(token_ids: list[int], logprobs: list, scored: torch.Tensor, tolerance: float) -> list[int]:
    """The decode steps of one greedy run (its ``token_ids`` and sampled ``logprobs``) that another
    engine's logits ``scored [N, V]`` for the same tokens (row i: after the prompt and the first
    i ids) do not back: its logprob further than ``2 * tolerance`` from theirs (a logprob moves by
    at most twice its logits' change), or its token more than ``tolerance`` below their best.

    Scoring the run's own tokens compares every step on the same context, so a near tie that
    rounding flips changes nothing after it. A step can still be off when rounding flips an
    expert choice (the router's top-k), which moves its logits by more than rounding: between
    bf16 and float32 on the CPU one step of this file's 48 is (0.43 where the others are <= 0.014)."""
    lsm = scored.float().log_softmax(-1)
    theirs = lsm[torch.arange(len(token_ids)), torch.tensor(token_ids)]
    ours = torch.tensor([value for value, _ in logprobs])
    off = ((ours - theirs).abs() > 2 * tolerance) | (lsm.max(-1).values - theirs > tolerance)
    return off.nonzero().flatten().tolist()


def test_steps_off_the_scoring_are_the_ones_whose_logits_disagree():
    scored = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 1.01], [0.5, 0.0, 3.0], [1.0, 0.0, 0.0]])
    lsm = scored.log_softmax(-1)
    ids = [0, 1, 2, 1]  # step 1: a near tie the other way, step 3: not their best by far
    logprobs = [(lsm[0, 0].item() + 0.01, []), (lsm[1, 1].item(), []), (lsm[2, 2].item() - 0.5, []), (-1.0, [])]
    assert steps_off_the_scoring(ids, logprobs, scored, 0.05) == [2, 3]
    assert steps_off_the_scoring(ids, logprobs, scored, 0.004) == [0, 1, 2, 3]


@pytest.mark.gpu
def test_on_cuda_bf16_the_mxfp4_kernel_in_cuda_graphs_matches_eager_and_the_torch_reference(gpt_oss_gguf, monkeypatch):
    """On the GPU the GGUF experts run fw_fp4's Triton grouped GEMM: the decodes replayed in CUDA
    graphs are backed, step by step, by the eager engine scoring their tokens (within bf16
    rounding; :func:`steps_off_the_scoring`: greedy ids of this random tiny model have near ties
    that rounding flips), and its bf16 prefill logits stay within bf16 rounding of the same engine
    running the experts through the torch reference op (``FW_KERNELS``)."""
    import gc

    from framework import LLM, SamplingParams
    from framework.testing import capture_logits

    path, _ = gpt_oss_gguf
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    runs = {"graphs": (True, ""), "eager": (False, ""), "reference": (False, "quantized_fused_moe=torch")}
    outputs, logits, scored = {}, {}, []
    for run, (graphs, forced) in runs.items():
        monkeypatch.setenv("FW_KERNELS", forced)
        # no prefix cache: the logits pass recomputes the prompts the decodes used
        args = dict(device="cuda", dtype="bf16", num_blocks=64, enable_prefix_caching=False)
        llm = LLM(str(path), enable_cuda_graphs=graphs, **args)
        assert ("decode graphs" in llm.engine.summary["cuda_graphs"]) == graphs
        experts = llm.engine.core.runner.model.model.layers[0].mlp.experts
        kernel = "framework.ops" if forced else "fw_fp4.kernels.fp4_moe"
        assert experts.mxfp4_w13.is_cuda and experts.quant_method.fused_moe.__module__ == kernel
        results = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS], greedy)
        outputs[run] = [r.outputs[0] for r in results]
        records = capture_logits(llm)  # after the decodes: the hook is not in the graphs
        prefills = llm.generate(
            [{"prompt_token_ids": p} for p in PARITY_PROMPTS], SamplingParams(temperature=0, max_tokens=1)
        )
        logits[run] = [
            torch.stack([records[(f"{r.request_id}-0", pos)] for pos in range(len(p))]).float().cpu()
            for p, r in zip(PARITY_PROMPTS, prefills, strict=True)
        ]
        if run == "eager":  # its logits after each prompt + the graphed run's ids, but the last
            forced = llm.generate(
                [{"prompt_token_ids": p + out.token_ids[:-1]} for p, out in zip(PARITY_PROMPTS, outputs["graphs"])],
                SamplingParams(temperature=0, max_tokens=1),
            )
            scored = [
                torch.stack([records[(f"{r.request_id}-0", len(p) - 1 + i)] for i in range(16)]).float().cpu()
                for p, r in zip(PARITY_PROMPTS, forced, strict=True)
            ]
        del llm, experts
        gc.collect()
        torch.cuda.empty_cache()
    assert all(len(out.token_ids) == len(out.logprobs) == 16 for out in outputs["graphs"])
    for index, (ours, reference) in enumerate(zip(logits["graphs"], logits["reference"], strict=True)):
        assert (ours - reference).abs().max() <= 3e-2 * reference.abs().max(), f"prompt {index}"
    off = {  # the same bf16 bound for the graphed decodes
        index: steps_off_the_scoring(out.token_ids, out.logprobs, rows, 3e-2 * rows.abs().max().item())
        for index, (out, rows) in enumerate(zip(outputs["graphs"], scored, strict=True))
    }
    assert sum(map(len, off.values())) <= 2, off  # of 48: at most an expert choice or two flipped by rounding


class _KeyRecorder:
    """A stand-in GGUFWriter that records ``add_*`` calls as metadata."""

    def __init__(self, md: dict) -> None:
        self.md = md

    def __getattr__(self, name):
        return lambda key, value: self.md.__setitem__(key, value)
