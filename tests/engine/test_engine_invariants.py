"""Engine invariants on a tiny random Llama: blocks, ref counts, prefix cache, seeds, limits."""

from __future__ import annotations

import random

import pytest
import transformers

from framework import LLM, SamplingParams
from framework.errors import ConfigError
from framework.testing import capture_logits, write_tiny_model

TINY = transformers.LlamaConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    initializer_range=0.1,
    eos_token_id=1,
    bos_token_id=0,
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    write_tiny_model(path, TINY)
    return str(path)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_requests_with_aborts_free_every_block(tiny_path, async_scheduling):
    llm = LLM(
        tiny_path,
        num_blocks=16,
        max_num_seqs=32,
        prefill_chunk_size=24,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    core, rng = llm.engine.core, random.Random(0)
    in_flight_at_abort = []
    shared_prefix = [rng.randrange(2, 96) for _ in range(40)]
    added, aborted, finished = 0, 0, 0
    for _ in range(100_000):
        while added < 1000 and len(core.requests) < 40:
            prompt = (shared_prefix[: rng.randrange(0, 40)] if rng.random() < 0.5 else []) + [
                rng.randrange(2, 96) for _ in range(rng.randrange(1, 30))
            ]
            params = SamplingParams(
                max_tokens=rng.randrange(1, 40),
                temperature=rng.choice([0.0, 0.8]),
                seed=rng.choice([None, 7]),
                ignore_eos=rng.random() < 0.5,
            )
            core.add_request(f"r{added}", prompt, params)
            added += 1
        finished += sum(out.finish_reason is not None for out in core.step())
        if core.requests and rng.random() < 0.3:
            victim = rng.choice(sorted(core.requests))
            in_flight_at_abort.append(
                core.inflight is not None and victim in {request.request_id for request in core.inflight.requests}
            )
            aborted += core.abort(victim)
        if added == 1000 and not core.has_unfinished():
            break
    assert finished + aborted == 1000 and aborted > 50
    kv = core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_count == 0 for block in kv.blocks)
    assert not core.scheduler.running and not core.scheduler.waiting and not core.requests and core.inflight is None
    # with async scheduling, some aborts hit a request whose step is still in flight (its result is
    # then dropped and its blocks freed all the same)
    assert (sum(in_flight_at_abort) > 0) == async_scheduling
    stats = core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_prefix_cache_hit_reuses_the_same_blocks_and_counts_hits(tiny_path):
    llm = LLM(tiny_path, num_blocks=32)
    core = llm.engine.core
    prompt = list(range(2, 52))  # 50 tokens: 3 full blocks of 16
    core.add_request("a", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    core.step()
    first_blocks = list(core.requests["a"].block_ids)
    core.add_request("b", prompt + [60, 61], SamplingParams(max_tokens=4, ignore_eos=True))
    core.step()
    second = core.requests["b"]
    assert second.num_cached_tokens == 48
    assert second.block_ids[:3] == first_blocks[:3]
    assert all(core.kv_cache.blocks[b].ref_count == 2 for b in first_blocks[:3])
    stats = core.stats()
    assert stats.prefix_cache_hits == 48 and stats.prefix_cache_queries == 50 + 52
    core.run_until_done()
    assert core.kv_cache.num_free_blocks == 32


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("first_max_tokens", [1, 4])
def test_a_finished_request_leaves_its_full_blocks_in_the_prefix_cache(tiny_path, async_scheduling, first_max_tokens):
    """Even one that stops on its first token: its prompt's full blocks are keyed before they are freed."""
    llm = LLM(tiny_path, num_blocks=32, async_scheduling=async_scheduling)
    prompt = list(range(2, 52))  # 50 tokens: 3 full blocks of 16
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=first_max_tokens, ignore_eos=True))
    second = llm.generate({"prompt_token_ids": prompt + [60]}, SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert second.num_cached_tokens == 48


def test_prefix_cache_can_be_disabled(tiny_path):
    llm = LLM(tiny_path, num_blocks=32, enable_prefix_caching=False)
    prompt = {"prompt_token_ids": list(range(2, 52))}
    llm.generate([prompt], SamplingParams(max_tokens=2))
    result = llm.generate([prompt], SamplingParams(max_tokens=2))[0]
    assert result.num_cached_tokens == 0 and llm.engine.core.stats().prefix_cache_hits == 0


def test_prefix_cache_max_tokens_caps_cached_blocks(tiny_path):
    llm = LLM(tiny_path, num_blocks=32, prefix_cache_max_tokens=32)
    for start in (2, 40):
        llm.generate({"prompt_token_ids": list(range(start, start + 50))}, SamplingParams(max_tokens=1))
    assert len(llm.engine.core.kv_cache.hash_to_block) <= 2


def test_same_seed_gives_same_text_in_different_batches(tiny_path):
    llm = LLM(tiny_path, num_blocks=64)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    alone = llm.generate(prompt, seeded)[0].outputs[0]
    others = [{"prompt_token_ids": [9, 10 + i]} for i in range(4)]
    crowd = llm.generate(
        [*others[:2], prompt, *others[2:]],
        [SamplingParams(temperature=1.0, max_tokens=16)] * 2
        + [seeded]
        + [SamplingParams(temperature=0.7, seed=i, max_tokens=16) for i in range(2)],
    )
    assert crowd[2].outputs[0].token_ids == alone.token_ids
    assert crowd[2].outputs[0].text == alone.text
    other_seed = llm.generate(prompt, seeded.replace(seed=99))[0].outputs[0]
    assert other_seed.token_ids != alone.token_ids


def test_stops_on_eos_stop_token_and_max_tokens(tiny_path):
    llm = LLM(tiny_path, num_blocks=64)
    prompt = {"prompt_token_ids": [3, 4, 5]}
    free_run = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_id = free_run.token_ids[5]
    first = free_run.token_ids.index(stop_id)
    stopped = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id], ignore_eos=True)
    )[0].outputs[0]
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    short = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert short.token_ids == free_run.token_ids[:3] and short.finish_reason == "length"
    # EOS (id 1) ends generation unless ignore_eos: force it with a logit bias.
    eos = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, logit_bias={1: 100}))[0].outputs[0]
    assert eos.token_ids == [1] and eos.finish_reason == "stop"


def test_stop_strings_cut_the_text(tiny_path):
    llm = LLM(tiny_path, num_blocks=64)
    prompt = {"prompt_token_ids": [3, 4, 5]}
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    words = full.text.split()
    stop = f"{words[3]} {words[4]}"
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert llm.engine.core.kv_cache.num_free_blocks == 64


def test_generation_stops_at_max_model_len(tiny_path):
    llm = LLM(tiny_path, num_blocks=64, max_model_len=20)
    out = llm.generate({"prompt_token_ids": list(range(2, 17))}, SamplingParams(max_tokens=None, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    with pytest.raises(ConfigError, match="20"):
        llm.generate({"prompt_token_ids": list(range(2, 22))}, SamplingParams())


def test_logprobs_and_prompt_logprobs_are_consistent(tiny_path):
    import torch

    llm = LLM(tiny_path, num_blocks=64)
    prompt = [3, 9, 27, 81, 50]
    result = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    )[0]
    out = result.outputs[0]
    assert len(out.logprobs) == 3
    for token, (logprob, top) in zip(out.token_ids, out.logprobs):
        assert len(top) == 2 and top[0][0] == token and top[0][1] == pytest.approx(logprob)  # greedy picks the top
        assert top[0][1] >= top[1][1]
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    # prompt logprob of token i equals the model's log-softmax at position i - 1
    records = capture_logits(llm)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    logp = torch.log_softmax(torch.stack([records[key] for key in sorted(records, key=lambda key: key[1])]), -1)
    assert logp.shape[0] == len(prompt)
    for i in range(1, len(prompt)):
        assert result.prompt_logprobs[i][0] == pytest.approx(float(logp[i - 1, prompt[i]]), abs=1e-5)


def test_bad_inputs_fail_with_clear_errors(tiny_path):
    llm = LLM(tiny_path, num_blocks=16)
    with pytest.raises(ConfigError, match=r"\[0, 96\)"):
        llm.generate({"prompt_token_ids": [5, 500]})
    with pytest.raises(ConfigError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_embeddings_are_normalized_pooled_hidden_states(tiny_path):
    import torch

    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    llm = LLM(tiny_path, num_blocks=32, prefill_chunk_size=8, max_num_batched_tokens=8)
    prompts = [[5, 6, 7], list(range(10, 40))]  # the second spans four chunks
    for pooling in ("mean", "last"):
        got = llm.embed([{"prompt_token_ids": p} for p in prompts], pooling=pooling)
        for prompt, vector in zip(prompts, got):
            with torch.no_grad():
                hidden = reference.model(torch.tensor([prompt])).last_hidden_state[0]
            pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]
            expected = torch.nn.functional.normalize(pooled, dim=0)
            assert torch.allclose(torch.tensor(vector), expected, atol=1e-5)
    assert llm.engine.core.kv_cache.num_free_blocks == 32
    with pytest.raises(ConfigError, match="valid: mean, last"):
        llm.embed({"prompt_token_ids": [5]}, pooling="max")


@pytest.mark.parametrize("prefill_chunk_size", [64, 16])
def test_an_embedding_request_leaves_its_full_blocks_in_the_prefix_cache(tiny_path, prefill_chunk_size):
    """A pooling request computes the same causal KV as any other: its full prompt blocks are keyed
    when it finishes, whether its prompt ran in one step or in chunks, and a generation request with
    that prefix reuses them (it does not look the cache up itself: pooling needs every position)."""
    prompt = list(range(2, 52))  # 50 tokens: 3 full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(tiny_path, num_blocks=32, prefill_chunk_size=prefill_chunk_size, max_num_batched_tokens=64)
    llm.embed({"prompt_token_ids": prompt})
    assert len(llm.engine.core.kv_cache.hash_to_block) == 3
    again = llm.embed({"prompt_token_ids": prompt})  # not served from the cache
    assert llm.engine.core.stats().prefix_cache_hits == 0 and len(again[0]) == TINY.hidden_size
    reused = llm.generate({"prompt_token_ids": prompt + [60]}, params)[0]
    assert reused.num_cached_tokens == 48
    uncached = LLM(tiny_path, num_blocks=32, enable_prefix_caching=False).generate(
        {"prompt_token_ids": prompt + [60]}, params
    )[0]
    assert reused.outputs[0].token_ids == uncached.outputs[0].token_ids


def test_a_request_never_outgrows_the_kv_cache(tiny_path):
    llm = LLM(tiny_path, num_blocks=4)  # 64 tokens in all, less than the 256-token context
    out = llm.generate({"prompt_token_ids": list(range(2, 52))}, SamplingParams(max_tokens=100, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(out.token_ids) == 14 and out.finish_reason == "length"
    with pytest.raises(ConfigError, match="KV cache holds 64"):
        llm.generate({"prompt_token_ids": list(range(2, 70))})
    assert llm.engine.core.kv_cache.num_free_blocks == 4
