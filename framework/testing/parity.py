"""Model parity against transformers: reference logits and greedy tokens, the engine's logits,
the parity checks (prefix cache, preemption) and the ``ModelParityTests`` mix-in; plus a
recorder of step launch/collect overlaps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import pytest

from framework.testing.model_writers import write_tiny_model


def reference_logits(model, prompt: list[int]):
    """transformers' logits ``[len(prompt), vocab]`` (float32) for one prompt, full forward."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def reference_greedy(model, prompt: list[int], steps: int = 32) -> list[int]:
    """Greedy ids from a full transformers forward per step (no KV cache; EOS is not special).

    transformers' ``generate`` would suppress EOS under ``min_new_tokens``; this loop does not,
    matching the engine with ``ignore_eos=True``.
    """
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def capture_logits(llm) -> dict:
    """Record the engine's logits at every position it computes: ``{(request id, position): logits}``.

    Wraps the model runner's forward, so the logits come through the whole engine (scheduler,
    chunked prefill, paged cache, attention backend).
    """
    runner, records = llm.engine.core.runner, {}
    forward = runner.forward

    def recording_forward(batch, *inputs):
        hidden = forward(batch, *inputs)
        logits = runner.model.compute_logits(hidden).float()
        offset = 0
        for request, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            for j in range(num_new):
                records[(request.request_id, request.num_computed_tokens + j)] = logits[offset + j]
            offset += num_new
        return hidden

    runner.forward = recording_forward
    return records


class StepLaunch(NamedTuple):
    """One step an engine core launched (see :func:`record_step_overlaps`)."""

    overlapped: bool  # launched while the step before it was in flight (launched, not yet read back)
    num_constrained: int  # rows of the batch with a grammar (``request.structured_output``) at launch


@dataclass(slots=True)
class StepOverlapLog:
    """What :func:`record_step_overlaps` saw: every launch in order, and how many steps were read back."""

    launches: list[StepLaunch] = field(default_factory=list)
    num_collected: int = 0

    @property
    def num_launched(self) -> int:
        return len(self.launches)

    @property
    def num_overlapped(self) -> int:
        """How many steps were launched before the step before them was read back: with async
        scheduling every step after the first of a steady decode does; without it, none."""
        return sum(launch.overlapped for launch in self.launches)

    def clear(self) -> None:
        self.launches.clear()
        self.num_collected = 0


def record_step_overlaps(core) -> StepOverlapLog:
    """Count the overlapping steps of ``core`` (an :class:`~framework.engine.engine.EngineCore`)
    from now on: wraps its runner's ``launch`` and ``collect`` and records, for each launch, whether
    a step was in flight then (``core.inflight``: launched, not yet read back) and how many of the
    batch's rows had a grammar, and how many steps were read back. Only Python-side bookkeeping is
    added, so it can watch steps under ``torch.cuda.set_sync_debug_mode("error")``.
    """
    runner, log = core.runner, StepOverlapLog()
    launch, collect = runner.launch, runner.collect

    def recording_launch(batch):
        constrained = sum(request.structured_output is not None for request in batch.requests)
        log.launches.append(StepLaunch(core.inflight is not None, constrained))
        return launch(batch)

    def recording_collect(step):
        log.num_collected += 1
        return collect(step)

    runner.launch, runner.collect = recording_launch, recording_collect
    return log


def generate_in_new_process(path, prompts: list[list[int]], params, **engine_args) -> tuple[list, list, dict]:
    """Run ``prompts`` with ``params`` on ``LLM(path, **engine_args)`` in a new (spawned) process;
    returns each prompt's first output's token ids and logprobs, and the engine summary.

    torch sets symmetric memory up once per process and group name (see
    :mod:`framework.distributed.fast_all_reduce`), so only the first tensor-parallel engine of a
    process uses the symm_mem all-reduce; tests of several such engines build each in its own process.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_generate_here, str(path), prompts, params, engine_args).result()


def _generate_here(path: str, prompts: list[list[int]], params, engine_args: dict) -> tuple[list, list, dict]:
    from framework import LLM

    with LLM(path, **engine_args) as llm:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        summary = dict(llm.engine.summary)
    return [r.outputs[0].token_ids for r in results], [r.outputs[0].logprobs for r in results], summary


def check_logits_parity(path, reference, prompts: list[list[int]], *, rel_tol: float = 1e-4, **engine_args):
    """The engine's logits at every prompt position (batched, chunked prefill) equal transformers'
    within ``rel_tol`` of the largest logit. ``engine_args`` go to :class:`framework.LLM`; returns
    the engine's ``LLM`` (to inspect what ran)."""
    import torch

    from framework import LLM, SamplingParams

    llm = LLM(str(path), **{"num_blocks": 64, "prefill_chunk_size": 8, "max_num_batched_tokens": 16, **engine_args})
    records = capture_logits(llm)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1))
    for index, prompt in enumerate(prompts):
        expected = reference_logits(reference, prompt)
        got = torch.stack([records[(f"{index}-0", pos)] for pos in range(len(prompt))])
        error, bound = (got - expected).abs().max().item(), rel_tol * expected.abs().max().item()
        assert error <= bound, f"prompt {index}: max logit error {error:.3g} > {bound:.3g}"
    return llm


def check_greedy_parity(path, reference, prompts: list[list[int]], steps: int = 32, **engine_args) -> None:
    """``steps`` greedy ids of every prompt through the engine equal :func:`reference_greedy`'s."""
    from framework import LLM, SamplingParams

    llm = LLM(str(path), **{"num_blocks": 64, "prefill_chunk_size": 8, "max_num_batched_tokens": 24, **engine_args})
    results = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    )
    for index, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt, steps), f"prompt {index}"
        assert result.outputs[0].finish_reason == "length"


#: Prompts for tiny-model parity tests (vocabulary >= 160): 5, 13 and 29 tokens.
PARITY_PROMPTS = [
    [5, 9, 33, 2, 71],
    list(range(40, 53)),
    [
        13,
        89,
        26,
        117,
        4,
        150,
        77,
        31,
        62,
        8,
        141,
        55,
        99,
        20,
        133,
        47,
        71,
        106,
        12,
        158,
        39,
        84,
        3,
        125,
        66,
        18,
        92,
        144,
        57,
    ],
]


def tiny_model_fixture(configs: dict, write=None):
    """A module-scoped ``tiny`` fixture, parametrized over ``configs`` (name -> a function returning
    a transformers config): ``(path, transformers reference)`` of the model written there by
    ``write`` (default :func:`write_tiny_model`). Assign it in a test module: ``tiny = tiny_model_fixture(CONFIGS)``."""

    @pytest.fixture(scope="module", params=sorted(configs))
    def tiny(request, tmp_path_factory):
        path = tmp_path_factory.mktemp(request.param)
        return path, (write or write_tiny_model)(path, configs[request.param]())

    return tiny


class ModelParityTests:
    """The engine-against-transformers checks every architecture passes; a test module subclasses it
    (``class TestParity(ModelParityTests): pass``) beside a ``tiny`` fixture (:func:`tiny_model_fixture`)."""

    prompts = PARITY_PROMPTS

    def test_batched_chunked_prefill_logits_match_transformers(self, tiny):
        check_logits_parity(*tiny, self.prompts)

    def test_greedy_tokens_match_transformers_with_chunked_prefill(self, tiny):
        check_greedy_parity(*tiny, self.prompts)

    def test_greedy_tokens_match_after_prefix_cache_hit(self, tiny):
        check_prefix_cache_parity(*tiny, self.prompts)

    def test_greedy_tokens_match_when_preempted_and_resumed(self, tiny):
        check_preemption_parity(*tiny, self.prompts)


def check_prefix_cache_parity(path, reference, prompts: list[list[int]], steps: int = 32, **engine_args) -> None:
    """A request whose first 32 tokens (two full 16-token blocks) are cached reuses them and still
    gives :func:`reference_greedy`'s ids. ``prompts[2] + prompts[1]`` must be >= 33 tokens long."""
    from framework import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    llm = LLM(str(path), **{"num_blocks": 64, **engine_args})
    shared = prompts[2] + prompts[1]
    llm.generate({"prompt_token_ids": shared + [7]}, greedy)
    second = llm.generate({"prompt_token_ids": shared + [8, 9]}, greedy)[0]
    assert second.num_cached_tokens == 32
    assert llm.engine.core.stats().prefix_cache_hits >= 32
    assert second.outputs[0].token_ids == reference_greedy(reference, shared + [8, 9], steps)


def check_preemption_parity(path, reference, prompts: list[list[int]], steps: int = 32, **engine_args) -> None:
    """Four requests (``prompts`` and the first one reversed) in 9 blocks of 16 preempt each other and
    resume; every one still gives :func:`reference_greedy`'s ids, and every block is free after."""
    from framework import LLM, SamplingParams

    llm = LLM(str(path), **{"num_blocks": 9, "max_num_seqs": 4, **engine_args})
    prompts = [*prompts, prompts[0][::-1]]
    results = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    )
    assert llm.engine.core.stats().num_preemptions > 0
    for index, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt, steps), f"prompt {index}"
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.num_blocks
