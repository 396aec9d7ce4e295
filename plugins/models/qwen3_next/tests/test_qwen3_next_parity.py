"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE through the whole engine match transformers (fp32, tiny
random models with randomised norms).

Every tiny model has linear-attention (Gated DeltaNet) and gated full-attention layers, grouped
value heads (4 value heads over 2 key heads) and partial rotary. Logits of a batch of prompts of
5, 13 and 29 tokens at every position, with prefill chunks of 8 (the state carried across chunk
boundaries mid-prompt); greedy tokens; and, on the dense model, preemption and abort, after
which the state slots are all free and a reused slot does not leak its old state.
"""

from __future__ import annotations

import pytest
import transformers

from framework import LLM, SamplingParams
from framework.testing import (
    PARITY_PROMPTS,
    check_logits_parity,
    reference_greedy,
    write_randomised_model,
)

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # partial_rotary_factor 0.25: 4 rotated features per head
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40)

CONFIGS = {
    # a dense layer among sparse ones (mlp_only_layers); the fused in_proj_qkvz / in_proj_ba layout
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**SMALL, **MOE, intermediate_size=96, mlp_only_layers=[2]),
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**SMALL, intermediate_size=96),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**SMALL, **MOE),
}

_MODELS: dict[str, tuple] = {}


def _written(name: str, tmp_path_factory) -> tuple:
    """``(path, transformers reference)`` of tiny model ``name``, written once for the module."""
    if name not in _MODELS:
        path = tmp_path_factory.mktemp(name)
        _MODELS[name] = (path, write_randomised_model(path, CONFIGS[name]()))
    return _MODELS[name]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    return _written(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """The dense Qwen3.5 tiny model, for the engine-level state-slot checks (model-independent)."""
    return _written("qwen3_5", tmp_path_factory)


#: Ops of these layers whose Triton kernels are opt-in (forced with the DeltaNet ones on CUDA).
OPT_IN_LAYER_OPS = ("gdn_gating", "sigmoid_gate_mul", "rms_norm_gated")

STEPS = 8  # greedy tokens per prompt: the reference is a full transformers forward per token
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
_REFERENCE_IDS: dict[tuple, list[int]] = {}


def _reference_ids(reference, prompt: list[int]) -> list[int]:
    """transformers' greedy ids, computed once per model and prompt for the whole module."""
    key = (id(reference), tuple(prompt))
    if key not in _REFERENCE_IDS:
        _REFERENCE_IDS[key] = reference_greedy(reference, prompt, STEPS)
    return _REFERENCE_IDS[key]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [result.outputs[0].token_ids for result in results]


def test_batched_chunked_prefill_logits_match_transformers(tiny):
    llm = check_logits_parity(*tiny, PARITY_PROMPTS)  # prefill chunks of 8: the 13 and 29 token prompts split
    assert llm.engine.summary["state_slots"] > 0


def test_greedy_tokens_match_transformers_with_chunked_prefill(tiny):
    path, reference = tiny
    prompts = [PARITY_PROMPTS[0], PARITY_PROMPTS[2]]
    llm = LLM(str(path), num_blocks=64, prefill_chunk_size=8, max_num_batched_tokens=24)
    assert _generate(llm, prompts) == [_reference_ids(reference, p) for p in prompts]


def test_layers_follow_layer_types_with_kv_and_state_caches_per_kind(tiny):
    path, reference = tiny
    runner = LLM(str(path), num_blocks=16).engine.core.runner
    kinds = ["linear_attention" if layer.is_linear else "full_attention" for layer in runner.model.model.layers]
    assert kinds == reference.config.layer_types == LAYER_TYPES
    assert len(runner.kv_caches) == 1 and len(runner.state_caches) == 3
    for ours, theirs in zip(runner.model.model.layers, reference.model.layers, strict=True):
        assert hasattr(ours.mlp, "experts") == hasattr(theirs.mlp, "experts")


def test_preempted_requests_resume_from_scratch_and_every_slot_is_freed(qwen3_5):
    """Three requests (71 tokens in all) in 4 blocks of 16 preempt each other; each preempted
    request gives its slot back and recomputes from token 0 (state from zeros); all still give
    transformers' ids."""
    path, reference = qwen3_5
    prompts = PARITY_PROMPTS
    llm = LLM(str(path), num_blocks=4, max_num_seqs=4)
    assert _generate(llm, prompts) == [_reference_ids(reference, p) for p in prompts]
    core = llm.engine.core
    assert core.stats().num_preemptions > 0
    assert core.scheduler.state_slots.num_free_slots == core.scheduler.state_slots.num_slots == 4


def test_prefix_caching_is_turned_off_and_a_shared_prefix_is_recomputed(qwen3_5, caplog):
    path, reference = qwen3_5
    with caplog.at_level("INFO", logger="fw.engine"):
        llm = LLM(str(path), num_blocks=64)
    assert "prefix caching is off" in caplog.text
    assert not llm.engine.core.kv_cache.enable_prefix_caching
    first, second = PARITY_PROMPTS[2] + [7], PARITY_PROMPTS[2] + [8, 9]  # a shared 29-token prefix
    llm.generate({"prompt_token_ids": first}, GREEDY)
    result = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert result.num_cached_tokens == 0
    assert result.outputs[0].token_ids == _reference_ids(reference, second)


def test_aborted_request_frees_its_slot_and_the_next_request_reuses_it_from_zeros(qwen3_5):
    """Two running requests hold slots 0 and 1; aborting the first mid-decode frees its slot; a new
    request takes it and still gives transformers' ids (its first step must not read the stale
    state), and when all are done every slot is free."""
    path, reference = qwen3_5
    core = LLM(str(path), num_blocks=32, max_num_seqs=2).engine.core
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)

    core.add_request("a", PARITY_PROMPTS[2], GREEDY)
    core.add_request("b", PARITY_PROMPTS[1], GREEDY)
    for _ in range(4):
        step()
    slot_a = core.requests["a"].state_slot
    assert {slot_a, core.requests["b"].state_slot} == {0, 1}
    assert core.abort("a")
    assert core.scheduler.state_slots.num_free_slots == 1
    core.add_request("c", PARITY_PROMPTS[0], GREEDY)
    step()
    assert core.requests["c"].state_slot == slot_a
    while core.has_unfinished():
        step()
    assert core.scheduler.state_slots.num_free_slots == 2
    assert tokens["c"] == _reference_ids(reference, PARITY_PROMPTS[0])
    assert tokens["b"] == _reference_ids(reference, PARITY_PROMPTS[1])


def test_state_cache_comes_out_of_the_memory_budget(qwen3_5):
    """With ``--mem 1`` (1 MiB) the states of at most half the budget get slots (fewer than
    ``max_num_seqs``) and the KV blocks take what is left."""
    path, _ = qwen3_5
    llm = LLM(str(path), mem_mb=1, max_num_seqs=256)
    summary, budget = llm.engine.summary, 1 << 20
    runner = llm.engine.core.runner
    per_slot = sum(cache.conv[0].nbytes + cache.recurrent[0].nbytes for cache in runner.state_caches)
    assert summary["state_slots"] == budget // 2 // per_slot < 256
    assert summary["state_bytes"] == summary["state_slots"] * per_slot
    assert summary["state_bytes"] + summary["kv_bytes"] <= budget
    assert llm.engine.core.scheduler.state_slots.num_slots == summary["state_slots"]


def test_decode_graph_buffers_carry_the_state_slots_replayed_eagerly(tmp_path):
    """The decode CUDA graphs' static buffers, with each replay run eagerly on the CPU (what a captured
    graph does: the model over the buffers): real rows read and write their own state slots,
    padding rows (3 requests in the bucket of 4) only the spare row; the ids stay transformers'.
    The model has linear-attention layers only: the CPU paged-attention backend reads host lengths,
    which a graph replay does not refresh."""
    from framework.engine.cuda_graphs import CUDAGraphRunner

    config = transformers.Qwen3_5TextConfig(
        **{**SMALL, "num_hidden_layers": 2, "layer_types": ["linear_attention"] * 2},
        intermediate_size=96,
        use_cache=False,  # transformers' cache needs an attention layer
    )
    reference = write_randomised_model(tmp_path, config)
    llm = LLM(str(tmp_path), num_blocks=16, max_num_seqs=4, prefill_chunk_size=8)  # buckets 1, 2, 4
    runner = llm.engine.core.runner
    graphs = CUDAGraphRunner(
        runner.model, runner.backend, runner.kv_caches, max_num_seqs=4, max_model_len=512, block_size=16,
        sink_block=16, device=runner.device, state_caches=runner.state_caches, spare_state_slot=4,
    )  # fmt: skip
    replays = []

    class EagerReplay:
        def __init__(self, size: int) -> None:
            self.size = size

        def replay(self) -> None:
            replays.append((self.size, graphs.state_slots[: self.size].tolist()))
            graphs.outputs[self.size] = graphs._forward(self.size)

    graphs.graphs = {size: EagerReplay(size) for size in graphs.buckets}
    runner.graph_runner = graphs
    assert _generate(llm, PARITY_PROMPTS) == [_reference_ids(reference, p) for p in PARITY_PROMPTS]
    assert (4, [0, 1, 2, 4]) in replays  # three decodes and a padding row on the spare slot 4


VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
#: M-RoPE sections over the 2 rotary frequencies of a head (transformers' default [11, 11, 10] fits 32)
MROPE = {"rope_type": "default", "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0], "mrope_interleaved": True}
TEXT_OF_MULTIMODAL = {**{k: v for k, v in SMALL.items() if k != "tie_word_embeddings"}, "rope_parameters": MROPE}
MULTIMODAL = {
    "qwen3_5_vl": lambda: transformers.Qwen3_5Config(
        text_config={**TEXT_OF_MULTIMODAL, "intermediate_size": 96}, vision_config=VISION, tie_word_embeddings=False
    ),
    "qwen3_5_moe_vl": lambda: transformers.Qwen3_5MoeConfig(
        text_config={**TEXT_OF_MULTIMODAL, **MOE}, vision_config=VISION, tie_word_embeddings=False
    ),
}


def _write_multimodal(path, hf_config):
    """A ``*ForConditionalGeneration`` checkpoint as the Hub ships Qwen3.5 (language model under
    ``model.language_model``, a vision tower beside it); returns the transformers reference."""
    import torch

    from framework.testing.model_writers import make_tiny_tokenizer, randomise_identity_params

    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(hf_config, dtype=torch.float32).eval()
    randomise_identity_params(model)
    model.save_pretrained(path)
    make_tiny_tokenizer(hf_config.text_config.vocab_size).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return model


@pytest.mark.parametrize("name", sorted(MULTIMODAL))
def test_text_path_of_the_hub_multimodal_checkpoints_matches_transformers(name, tmp_path):
    reference = _write_multimodal(tmp_path, MULTIMODAL[name]())
    llm = check_logits_parity(tmp_path, reference, PARITY_PROMPTS)
    assert llm.engine.summary["architecture"] == reference.config.architectures[0]


@pytest.mark.gpu
@pytest.mark.parametrize("deltanet_kernels", ["torch", "triton"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gpu_engine_matches_transformers(name, deltanet_kernels, tmp_path, monkeypatch):
    """On CUDA (fp32; Triton attention and kernels, decode in CUDA graphs; the DeltaNet ops and the
    opt-in gate / gated-norm / router ops as torch references or triton_ops' kernels, forced): every
    prompt position's logits within 1e-4 of transformers' (CPU) and the greedy ids equal, prompts
    split into prefill chunks of 8, async scheduling on."""
    import torch

    from framework.testing import capture_logits, check_kernels_used, count_kernel_calls, reference_logits

    routed = ("select_experts",) if name != "qwen3_5" else ()  # the MoE models' router
    forced = {op: deltanet_kernels for op in ("gated_delta_rule", "causal_conv1d", *OPT_IN_LAYER_OPS, *routed)}
    monkeypatch.setenv("FW_KERNELS", ",".join(f"{op}={impl}" for op, impl in forced.items()))
    reference = write_randomised_model(tmp_path, CONFIGS[name]())
    with count_kernel_calls() as calls:
        llm = LLM(str(tmp_path), device="cuda", dtype="f32", num_blocks=64, prefill_chunk_size=8)
        assert llm.engine.core.async_scheduling
        assert "decode graphs" in llm.engine.summary["cuda_graphs"]  # the state slots ride in the graphs
        records = capture_logits(llm)
        results = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS], GREEDY)
    check_kernels_used(calls, forced)
    for index, (prompt, result) in enumerate(zip(PARITY_PROMPTS, results, strict=True)):
        expected = reference_logits(reference, prompt)
        got = torch.stack([records[(f"{index}-0", pos)].cpu() for pos in range(len(prompt))])
        assert (got - expected).abs().max() <= 1e-4 * expected.abs().max(), f"prompt {index}"
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt, STEPS), f"prompt {index}"


@pytest.mark.gpu
def test_gpu_long_prompts_through_the_chunked_deltanet_kernel_match_transformers(qwen3_5, monkeypatch):
    """On CUDA (fp32, the triton_ops DeltaNet kernels, forced: they are opt-in): prompts of 150 and 70 tokens in
    prefill chunks of 100 (the chunked kernel's 64-token chunks, then a chunk resuming the state):
    every position's logits within 1e-4 of transformers' and the greedy ids equal."""
    import torch

    from framework.testing import capture_logits, check_kernels_used, count_kernel_calls, reference_logits

    path, reference = qwen3_5
    monkeypatch.setenv("FW_KERNELS", "gated_delta_rule=triton,causal_conv1d=triton")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 160, (n,), generator=generator).tolist() for n in (150, 70)]
    with count_kernel_calls() as calls:
        llm = LLM(str(path), device="cuda", dtype="f32", num_blocks=64, prefill_chunk_size=100)
        records = capture_logits(llm)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    check_kernels_used(calls, {"gated_delta_rule": "triton", "causal_conv1d": "triton"})
    for index, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        expected = reference_logits(reference, prompt)
        got = torch.stack([records[(f"{index}-0", pos)].cpu() for pos in range(len(prompt))])
        assert (got - expected).abs().max() <= 1e-4 * expected.abs().max(), f"prompt {index}"
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt, STEPS), f"prompt {index}"
