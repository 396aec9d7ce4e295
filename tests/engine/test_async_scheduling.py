"""Async scheduling: step n + 1 is launched before step n is read back, with the same results.

On the CPU nothing runs concurrently, but every piece of the overlap does run: placeholders in the
requests, inputs taken from the previous step's sampled ids, dropped results of requests that
stopped while a step was in flight, and the cases that must read the previous step back first.
The references are transformers (greedy ids) and the same engine without async scheduling.
"""

from __future__ import annotations

import transformers

from framework import LLM, SamplingParams
from framework.engine.request import PLACEHOLDER
from framework.sampling_params import StructuredOutputsParams
from framework.testing import (
    PARITY_PROMPTS,
    check_greedy_parity,
    check_preemption_parity,
    check_prefix_cache_parity,
    record_step_overlaps,
    tiny_model_fixture,
)

TINY = transformers.LlamaConfig(
    vocab_size=160,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    eos_token_id=1,
    bos_token_id=0,
)

tiny = tiny_model_fixture({"llama": lambda: TINY})


def test_greedy_ids_match_transformers(tiny):
    check_greedy_parity(*tiny, PARITY_PROMPTS, async_scheduling=True)


def test_greedy_ids_match_after_prefix_cache_hit(tiny):
    check_prefix_cache_parity(*tiny, PARITY_PROMPTS, async_scheduling=True)


def test_greedy_ids_match_when_preempted_and_resumed(tiny):
    check_preemption_parity(*tiny, PARITY_PROMPTS, async_scheduling=True)


def summary(results) -> list[tuple]:
    return [
        (out.token_ids, out.logprobs, out.finish_reason, out.stop_reason)
        for result in results
        for out in result.outputs
    ]


def test_mixed_requests_give_the_same_outputs_as_sync_scheduling(tiny):
    path, _ = tiny
    prompts = [{"prompt_token_ids": p} for p in PARITY_PROMPTS] + [{"prompt_token_ids": [7, 8, 9] * 7}]
    sync = LLM(str(path), num_blocks=64, async_scheduling=False)
    greedy = sync.generate(prompts[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    stop_token = greedy.outputs[0].token_ids[9]  # stops at its first occurrence, step 10 at the latest
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token], logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=30, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=1.0, seed=5, max_tokens=17, min_tokens=12, stop_token_ids=[3, 4, 5, 6]),
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            prompt_logprobs=2,
            n=2,
            frequency_penalty=0.7,
            repetition_penalty=1.3,
        ),
    ]
    expected = summary(sync.generate(prompts, params))
    overlapped = LLM(str(path), num_blocks=64, async_scheduling=True)
    steps = record_step_overlaps(overlapped.engine.core)
    assert summary(overlapped.generate(prompts, params)) == expected
    assert expected[0][2] == "stop" and expected[0][3] == stop_token
    assert steps.num_overlapped > 10
    core = overlapped.engine.core
    assert core.inflight is None and not core.requests
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def test_steady_decode_overlaps_and_only_grammars_stop_it(tiny):
    path, _ = tiny
    llm = LLM(str(path), num_blocks=64, async_scheduling=True)
    steps = record_step_overlaps(llm.engine.core)
    prompts = [{"prompt_token_ids": p} for p in PARITY_PROMPTS]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    # 16 steps, one token each: every step after the prefill overlaps its predecessor, and no step
    # is launched past the length limit
    assert steps.num_overlapped == 15 and steps.num_launched == steps.num_collected == 16
    steps.clear()
    # requests that stop by length at different steps do not break the overlap: one whose last
    # token is in flight is left out of the next batch
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 11, 16)]
    overlapped = llm.generate(prompts, lengths)
    assert steps.num_overlapped == 15 and steps.num_launched == steps.num_collected == 16
    sync = LLM(str(path), num_blocks=64, async_scheduling=False).generate(prompts, lengths)
    assert summary(overlapped) == summary(sync)
    steps.clear()
    # penalties count the previous token on the device: they overlap too, with the same tokens
    penalised = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=0.9),
        SamplingParams(temperature=0.8, seed=2, max_tokens=16, ignore_eos=True, presence_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8),
    ]
    overlapped = llm.generate(prompts, penalised)
    assert steps.num_overlapped == 15
    assert summary(overlapped) == summary(
        LLM(str(path), num_blocks=64, async_scheduling=False).generate(prompts, penalised)
    )
    steps.clear()
    constrained = SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(t[2-5]){3}")
    )
    llm.generate(prompts, constrained)
    assert steps.num_overlapped == 0  # the grammar needs the previous token on the host


def test_abort_while_a_step_is_in_flight_drops_its_token_and_frees_the_blocks(tiny):
    path, _ = tiny
    core = LLM(str(path), num_blocks=64, async_scheduling=True).engine.core
    core.add_request("a", PARITY_PROMPTS[2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    core.add_request("b", PARITY_PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    produced = {"a": 0, "b": 0}
    for _ in range(6):
        for out in core.step():
            produced[out.request_id] += len(out.new_token_ids)
    request = core.requests["a"]
    assert core.inflight is not None and request.output_token_ids[-1] == PLACEHOLDER
    assert core.abort("a")
    before = produced["a"]
    for out in core.run_until_done():
        produced[out.request_id] += len(out.new_token_ids)
    assert produced["a"] == before and produced["b"] == 40
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def test_a_stop_token_ends_the_output_without_a_placeholder(tiny):
    path, _ = tiny
    sync = LLM(str(path), num_blocks=64, async_scheduling=False)
    greedy = sync.generate(
        {"prompt_token_ids": PARITY_PROMPTS[1]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0].outputs[0]
    stop = greedy.token_ids[6]
    llm = LLM(str(path), num_blocks=64, async_scheduling=True)
    core = llm.engine.core
    steps = record_step_overlaps(core)
    core.add_request("s", PARITY_PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))
    request = core.requests["s"]
    outputs = core.run_until_done()
    # a step was launched after the one that sampled the stop token, and its token was dropped
    assert steps.num_overlapped == len(outputs) and steps.num_launched == len(outputs) + 1
    assert [out.new_token_ids[0] for out in outputs] == greedy.token_ids[: greedy.token_ids.index(stop) + 1]
    assert outputs[-1].finish_reason == "stop" and request.output_token_ids == greedy.token_ids[: len(outputs)]
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
