"""Tensor parallelism on CPU (gloo, one worker process per extra rank) gives the ids of one device
and of transformers: Llama with GQA, Qwen2 with q/k/v bias, and a tied-embedding model at TP=4 with
fewer KV heads than ranks and a vocabulary that does not divide by 4 (padded)."""

from __future__ import annotations

import pytest
import transformers

from framework import LLM, SamplingParams
from framework.testing import reference_greedy, write_tiny_model

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 59)), [3, 150, 77]]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
# a small prefill chunk makes the 19-token prompt span steps that mix prefill and decode; 4 blocks
# of 16 for 5 blocks' worth of requests force a preemption (the workers then get new block tables)
ENGINE = dict(device="cpu", num_blocks=4, prefill_chunk_size=8, max_num_batched_tokens=16)

CASES = {
    "llama_gqa_tp2": (lambda: transformers.LlamaConfig(**SMALL), 2),
    "qwen2_bias_tp2": (lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=False), 2),
    "llama_tied_kv_replicated_tp4": (
        lambda: transformers.LlamaConfig(**{**SMALL, "vocab_size": 162}, tie_word_embeddings=True),
        4,
    ),
}


# a chunked prompt scored with prompt logprobs: extra compute_logits calls every rank must join
SCORED = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)


def run(path, **engine_args) -> tuple[list[list[int]], list]:
    """Greedy ids of PROMPTS, and the prompt + sampled logprobs of the scored request (as flat floats / ids)."""
    with LLM(str(path), **ENGINE, **engine_args) as llm:
        tp = engine_args.get("tensor_parallel_size", 1)
        assert llm.engine.summary["tensor_parallel_size"] == tp
        model = llm.engine.core.runner.model.model
        # under TP every branch leaves its all-reduce to the next norm (all_reduce_add_rms_norm)
        assert model.norm.reduces_input == (tp > 1)
        assert all(
            layer.self_attn.o_proj.reduce_results == layer.mlp.reduce_results == (tp == 1)
            and layer.post_attention_layernorm.reduces_input == (tp > 1)
            for layer in model.layers
        )
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        assert llm.engine.core.stats().num_preemptions > 0
        scored = llm.generate({"prompt_token_ids": PROMPTS[1]}, SCORED)[0]
    entries = scored.prompt_logprobs[1:] + scored.outputs[0].logprobs
    return [r.outputs[0].token_ids for r in results], entries


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel_greedy_ids_match_one_device_and_transformers(case, tmp_path):
    make_config, tp = CASES[case]
    reference = write_tiny_model(tmp_path, make_config())
    expected = [reference_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    one_ids, one_logprobs = run(tmp_path)
    ids, logprobs = run(tmp_path, tensor_parallel_size=tp)
    assert one_ids == expected and ids == expected
    assert len(logprobs) == len(one_logprobs) == len(PROMPTS[1]) - 1 + SCORED.max_tokens
    for (value, top), (one_value, one_top) in zip(logprobs, one_logprobs, strict=True):
        assert value == pytest.approx(one_value, abs=1e-4)
        assert [i for i, _ in top] == [i for i, _ in one_top]


def test_tensor_parallel_with_async_scheduling_matches_transformers(tmp_path):
    """Rank 0 launches step n + 1 before reading step n back; the workers take the placeholder
    input tokens from rank 0's broadcast of the sampled ids (a wrong token would change every
    rank's partial sums, so rank 0's ids would differ)."""
    reference = write_tiny_model(tmp_path, transformers.LlamaConfig(**SMALL))
    expected = [reference_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    with LLM(str(tmp_path), **{**ENGINE, "num_blocks": 32}, tensor_parallel_size=2, async_scheduling=True) as llm:
        core, launch, overlapped = llm.engine.core, llm.engine.core.runner.launch, []

        def counting_launch(batch):
            overlapped.append(core.inflight is not None)  # the previous step is not read back yet
            return launch(batch)

        core.runner.launch = counting_launch
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [r.outputs[0].token_ids for r in results] == expected
    assert sum(overlapped) >= GREEDY.max_tokens - 2
