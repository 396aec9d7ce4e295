"""Tensor parallelism for the MoE members of the Llama family (and Qwen3, Phi-3, GLM, GLM-4 dense)
on CPU (gloo).

Every rank holds all experts with half of each expert's intermediate features (TP=2); the greedy
ids must equal those of one device and of transformers. Qwen2-MoE adds a shared expert whose
partial output joins the experts' before the block's one all-reduce. A layer-level test checks
that the sharded FusedMoE's partial outputs sum to the unsharded layer, for every checkpoint
layout its loader takes (per-expert, transformers-5 stacked gate_up, GGUF stacked per projection),
including lazy ``CheckpointSlice``s.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import LLM, SamplingParams
from framework.errors import ConfigError
from framework.layers.fused_moe import FusedMoE
from framework.loader.checkpoint_slice import CheckpointSlice
from framework.loader.dummy_format import DummyFormat
from framework.testing import reference_greedy, write_randomised_model, write_tiny_model

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
QWEN_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96)
PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 59)), [3, 150, 77]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = dict(device="cpu", num_blocks=16, prefill_chunk_size=8, max_num_batched_tokens=16)

CASES = {
    # every second layer sparse, the other dense (a sharded GatedMLP); renormalised top-k; QK norm
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, **QWEN_MOE, head_dim=32, norm_topk_prob=True, decoder_sparse_step=2
    ),
    # routed experts + sigmoid-gated shared expert (one all-reduce for both), q/k/v bias
    "qwen2_moe_shared_expert": lambda: transformers.Qwen2MoeConfig(
        **SMALL, **QWEN_MOE, shared_expert_intermediate_size=40, norm_topk_prob=False
    ),
    # block_sparse_moe.experts.{e}.w1/w3/w2, expert width from intermediate_size
    "mixtral": lambda: transformers.MixtralConfig(
        **SMALL, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2
    ),
    "qwen3_dense_qk_norm": lambda: transformers.Qwen3Config(**SMALL, intermediate_size=96, head_dim=32),
    # dense Llama variants the same sharding serves: Phi-3's fused qkv / gate_up checkpoint tensors
    # with LongRoPE (short factors), partial rotary and a sliding window; GLM's interleaved partial rotary; GLM-4's extra norms
    "phi3_fused_longrope": lambda: transformers.Phi3Config(
        **SMALL,
        pad_token_id=0,
        intermediate_size=96,
        partial_rotary_factor=0.5,
        sliding_window=12,
        original_max_position_embeddings=64,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.3, 2.1, 3.7],
            "long_factor": [1.5, 2.9, 6.0, 11.0],
        },
    ),
    "glm_interleaved_partial_rope": lambda: transformers.GlmConfig(
        **SMALL, pad_token_id=0, intermediate_size=96, head_dim=16, partial_rotary_factor=0.5
    ),
    "glm4_four_norms": lambda: transformers.Glm4Config(
        **SMALL, pad_token_id=0, intermediate_size=96, head_dim=16, partial_rotary_factor=0.5
    ),
    # StableLM's per-head QK LayerNorms (randomised weights): each rank keeps its heads' norms
    "stablelm_per_head_qk_layernorm": lambda: transformers.StableLmConfig(
        **SMALL,
        intermediate_size=96,
        partial_rotary_factor=0.25,
        use_qkv_bias=True,
        use_parallel_residual=True,
        qk_layernorm=True,
    ),
}


def greedy_ids(path, **engine_args) -> list[list[int]]:
    with LLM(str(path), **ENGINE, **engine_args) as llm:
        assert llm.engine.summary["tensor_parallel_size"] == engine_args.get("tensor_parallel_size", 1)
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [r.outputs[0].token_ids for r in results]


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_greedy_ids_match_one_device_and_transformers(case, tmp_path):
    reference = write_randomised_model(tmp_path, CASES[case]())
    expected = [reference_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    assert greedy_ids(tmp_path) == expected
    assert greedy_ids(tmp_path, tensor_parallel_size=2) == expected


def test_tp4_qwen3_moe_with_replicated_kv_heads_matches_transformers(tmp_path):
    """TP=4 (the 4-GPU runs' layout, here four gloo ranks): 2 KV heads replicated over 4 ranks,
    every expert split four ways (8 of 32 features per rank), one all-reduce per block."""
    reference = write_randomised_model(tmp_path, CASES["qwen3_moe"]())
    expected = [reference_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    assert greedy_ids(tmp_path, tensor_parallel_size=4) == expected


def test_tp4_stablelm_replicated_kv_heads_keep_their_own_per_head_norms(tmp_path):
    """4 query heads over 4 ranks, 2 KV heads each on 2 ranks: rank r normalises query head r and
    key head r // 2 with those heads' own (random) LayerNorm weights."""
    reference = write_randomised_model(tmp_path, CASES["stablelm_per_head_qk_layernorm"]())
    expected = [reference_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    assert greedy_ids(tmp_path, tensor_parallel_size=4) == expected


def test_expert_width_that_does_not_split_is_refused_at_start_up(tmp_path):
    write_tiny_model(
        tmp_path, transformers.Qwen3MoeConfig(**SMALL, **{**QWEN_MOE, "moe_intermediate_size": 31}, head_dim=32)
    )
    with pytest.raises(ConfigError, match="intermediate size 31 .* cannot be split over 2 tensor-parallel ranks"):
        LLM(str(tmp_path), device="cpu", num_blocks=16, tensor_parallel_size=2)


class LazyFull:
    """A full tensor behind the ``get_slice`` interface, so loaders see a ``CheckpointSlice``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.reads = tensor, []

    def __getitem__(self, index):
        self.reads.append(index)
        return self.tensor[index]


def layouts(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor):
    """The checkpoint layouts FusedMoE loads, as ``[(param name, tensor, shard_id, expert_id)]``.

    ``w1``/``w3`` ``[E, I, H]``, ``w2`` ``[E, H, I]``.
    """
    per_expert = [
        (p, t[e], s, e)
        for e in range(w1.shape[0])
        for p, t, s in (("w13", w1, "w1"), ("w13", w3, "w3"), ("w2", w2, "w2"))
    ]
    return {
        "per_expert": per_expert,
        "per_expert_lazy": [(p, CheckpointSlice(LazyFull(t), tuple(t.shape)), s, e) for p, t, s, e in per_expert],
        "stacked_gate_up": [("w13", torch.cat([w1, w3], dim=1), "w13", None), ("w2", w2, "w2", None)],
        "stacked_gate_up_lazy": [
            (
                "w13",
                CheckpointSlice(LazyFull(torch.cat([w1, w3], 1)), (w1.shape[0], 2 * w1.shape[1], w1.shape[2])),
                "w13",
                None,
            ),
            ("w2", CheckpointSlice(LazyFull(w2), tuple(w2.shape)), "w2", None),
        ],
        "gguf_stacked_per_projection": [("w13", w1, "w1", None), ("w13", w3, "w3", None), ("w2", w2, "w2", None)],
    }


def load(layer: FusedMoE, entries) -> None:
    for param, tensor, shard, expert in entries:
        target = layer.w13_weight if param == "w13" else layer.w2_weight
        layer.weight_loader(target, tensor, shard, expert)
    assert layer.missing_weights() == []


@pytest.mark.parametrize(
    "layout",
    ["per_expert", "per_expert_lazy", "stacked_gate_up", "stacked_gate_up_lazy", "gguf_stacked_per_projection"],
)
@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_fused_moe_partial_outputs_sum_to_the_unsharded_layer(layout, tp):
    experts, top_k, hidden, inter = 6, 2, 16, 24
    generator = torch.Generator().manual_seed(0)
    w1, w3 = (torch.randn(experts, inter, hidden, generator=generator) for _ in range(2))
    w2 = torch.randn(experts, hidden, inter, generator=generator)
    x, logits = torch.randn(7, hidden, generator=generator), torch.randn(7, experts, generator=generator)

    full = FusedMoE(experts, top_k, hidden, inter, renormalize=True, tp_size=1, tp_rank=0)
    load(full, layouts(w1, w3, w2)[layout])
    expected = full(x, logits)

    partials = []
    for rank in range(tp):
        shard = FusedMoE(
            experts, top_k, hidden, inter, renormalize=True, tp_size=tp, tp_rank=rank, reduce_results=False
        )
        assert shard.w13_weight.shape == (experts, 2 * inter // tp, hidden) and shard.w2_weight.shape == (
            experts,
            hidden,
            inter // tp,
        )
        load(shard, layouts(w1, w3, w2)[layout])
        rows = slice(rank * inter // tp, (rank + 1) * inter // tp)
        assert torch.equal(shard.w13_weight, torch.cat([w1[:, rows], w3[:, rows]], dim=1))
        assert torch.equal(shard.w2_weight, w2[:, :, rows])
        partials.append(shard(x, logits))
    torch.testing.assert_close(torch.stack(partials).sum(0), expected, rtol=1e-5, atol=1e-5)


def test_lazy_slices_read_only_this_ranks_features():
    w2 = torch.randn(3, 8, 12)
    source = LazyFull(w2)
    layer = FusedMoE(3, 1, 8, 12, renormalize=False, tp_size=2, tp_rank=1)
    layer.weight_loader(layer.w2_weight, CheckpointSlice(source, tuple(w2.shape)), "w2")
    assert source.reads == [(slice(0, 3), slice(0, 8), slice(6, 12))]


def test_wrong_intermediate_size_in_the_checkpoint_is_refused():
    layer = FusedMoE(3, 1, 8, 12, renormalize=False, tp_size=2, tp_rank=0, prefix="moe")
    with pytest.raises(ValueError, match="moe: checkpoint tensor of shape \\(16, 8\\) does not fit: expected 12"):
        layer.weight_loader(layer.w13_weight, torch.randn(16, 8), "w1", 0)
    with pytest.raises(ConfigError, match="intermediate size 12 .* cannot be split over 8"):
        FusedMoE(3, 1, 8, 12, renormalize=False, tp_size=8, tp_rank=0)


def test_dummy_weights_with_stacked_expert_names_shard_like_one_device(tmp_path):
    """``--load-format dummy`` yields transformers 5's stacked ``experts.gate_up_proj`` ``[E, 2I, H]``;
    each rank takes its gate and its up rows of every expert: prompt logprobs equal TP=1's."""
    write_tiny_model(tmp_path, CASES["qwen3_moe"]())
    (tmp_path / "model.safetensors").unlink()
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)

    def prompt_logprobs(**engine_args):
        with LLM(str(tmp_path), load_format="dummy", **ENGINE, **engine_args) as llm:
            if not engine_args:  # one device: the stacked tensors land whole, gate rows then up rows
                experts = llm.engine.core.runner.model.model.layers[1].mlp.experts
                stacked = dict(DummyFormat(tmp_path).iter_weights())
                assert torch.equal(experts.w13_weight, stacked["model.layers.1.mlp.experts.gate_up_proj"].cpu())
                assert torch.equal(experts.w2_weight, stacked["model.layers.1.mlp.experts.down_proj"].cpu())
            return [value for value, _ in llm.generate({"prompt_token_ids": PROMPTS[1]}, scored)[0].prompt_logprobs[1:]]

    one, two = prompt_logprobs(), prompt_logprobs(tensor_parallel_size=2)
    assert len(one) == len(PROMPTS[1]) - 1
    assert two == pytest.approx(one, abs=1e-5)
