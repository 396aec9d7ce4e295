"""A failing step fails its requests, not the engine: error outputs, every block freed, the next request served."""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import LLM, SamplingParams
from framework.engine.outputs import OUT_OF_MEMORY, STEP_FAILED
from framework.errors import RequestFailedError
from framework.testing import write_tiny_model

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
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": list(range(5, 45)), "b": list(range(50, 60)), "c": list(range(10, 30))}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    write_tiny_model(path, TINY)
    return str(path)


@pytest.fixture(scope="module")
def reference(tiny_path):
    """Each prompt's greedy ids from an engine that never failed."""
    core = LLM(tiny_path, num_blocks=32, block_size=8).engine.core
    for request_id, prompt in PROMPTS.items():
        core.add_request(request_id, prompt, GREEDY)
    ids: dict[str, list[int]] = {}
    for output in core.run_until_done(timeout_s=60):
        ids.setdefault(output.request_id, []).extend(output.new_token_ids)
    return ids


def fail_once(obj, name: str, error: Exception, after_calls: int = 0) -> list[int]:
    """Make ``obj.name`` raise ``error`` on call number ``after_calls`` (0-based), once; returns the call counter."""
    original = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after_calls + 1:
            raise error
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


def run(core, timeout_s: float = 60.0) -> dict[str, list]:
    """Every request's outputs, by request id."""
    outputs: dict[str, list] = {}
    for output in core.run_until_done(timeout_s=timeout_s):
        outputs.setdefault(output.request_id, []).append(output)
    return outputs


def assert_nothing_leaked(core) -> None:
    kv = core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_count == 0 for block in kv.blocks)
    assert not core.requests and not core.scheduler.running and not core.scheduler.waiting and core.inflight is None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_out_of_memory_in_a_step_fails_that_request_and_the_next_one_succeeds(tiny_path, reference, async_scheduling):
    core = LLM(tiny_path, num_blocks=32, block_size=8, async_scheduling=async_scheduling).engine.core
    fail_once(core.runner, "launch", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), 3)
    core.add_request("a", PROMPTS["a"], GREEDY)
    failed = run(core)["a"]
    assert failed[-1].finish_reason == "abort" and failed[-1].error_kind == OUT_OF_MEMORY
    assert "out of memory" in failed[-1].error and "20.00 GiB" not in failed[-1].error  # nothing internal leaks
    assert len([token for output in failed for token in output.new_token_ids]) < GREEDY.max_tokens
    assert_nothing_leaked(core)
    assert core.num_failed_steps == core.stats().num_failed_steps == 1
    # the same prompt again: served in full, with the ids of an engine that never failed (no half-written
    # block was kept in the prefix cache)
    for request_id in ("a", "b"):
        core.add_request(request_id, PROMPTS[request_id], GREEDY)
    served = run(core)
    for request_id in ("a", "b"):
        assert [t for output in served[request_id] for t in output.new_token_ids] == reference[request_id]
        assert served[request_id][-1].finish_reason == "length" and served[request_id][-1].error is None
    assert_nothing_leaked(core)


def test_a_failure_with_two_steps_in_flight_fails_both_steps_requests(tiny_path, reference):
    """Async scheduling: step n is launched before n - 1 is read back; a failure reading n - 1 back
    fails the requests of both, and the requests of neither step stay queued or hold blocks."""
    llm = LLM(tiny_path, num_blocks=32, block_size=8, async_scheduling=True)
    core = llm.engine.core
    for request_id in ("b", "c"):
        core.add_request(request_id, PROMPTS[request_id], GREEDY)
    for _ in range(4):  # prefill, then overlapping decode steps
        core.step()
    assert core.inflight is not None
    in_flight = {request.request_id for request in core.inflight.requests}
    fail_once(core.runner, "collect", RuntimeError("a grammar library failed"))
    outputs = core.step()
    errors = {output.request_id: output for output in outputs if output.error is not None}
    assert set(errors) == in_flight == {"b", "c"}
    assert all(output.error_kind == STEP_FAILED and "RuntimeError" in output.error for output in errors.values())
    assert "grammar library" not in errors["b"].error
    assert not core.has_unfinished()
    assert_nothing_leaked(core)
    core.add_request("c", PROMPTS["c"], GREEDY)
    assert [t for output in run(core)["c"] for t in output.new_token_ids] == reference["c"]


def test_other_requests_keep_running_when_a_step_that_excludes_them_fails(tiny_path, reference):
    """Only the failed step's requests fail: one still waiting for its turn is served afterwards."""
    core = LLM(tiny_path, num_blocks=32, block_size=8, max_num_seqs=1).engine.core
    core.add_request("a", PROMPTS["a"], GREEDY)
    core.add_request("b", PROMPTS["b"], GREEDY)  # waits: one sequence at a time
    fail_once(core.runner, "launch", torch.OutOfMemoryError("out of memory"), 2)
    outputs = run(core)
    assert outputs["a"][-1].error_kind == OUT_OF_MEMORY
    assert [t for output in outputs["b"] for t in output.new_token_ids] == reference["b"]
    assert_nothing_leaked(core)


def test_an_unexpected_error_in_add_request_is_a_request_failure_not_a_crash(tiny_path, reference):
    core = LLM(tiny_path, num_blocks=32, block_size=8).engine.core
    fail_once(core.scheduler, "add", TypeError("unhashable type: 'list'"))
    with pytest.raises(RequestFailedError, match=r"could not add the request \(TypeError\)"):
        core.add_request("b", PROMPTS["b"], GREEDY)
    assert not core.requests and not core.has_unfinished()
    core.add_request("b", PROMPTS["b"], GREEDY)
    assert [t for output in run(core)["b"] for t in output.new_token_ids] == reference["b"]


def test_llm_generate_raises_request_failed_for_a_failed_step(tiny_path):
    llm = LLM(tiny_path, num_blocks=32, block_size=8)
    fail_once(llm.engine.core.runner, "launch", torch.OutOfMemoryError("out of memory"))
    with pytest.raises(RequestFailedError, match="ran out of memory"):
        llm.generate([{"prompt_token_ids": PROMPTS["b"]}], GREEDY)
    assert_nothing_leaked(llm.engine.core)


def test_an_error_from_the_grammar_library_fails_that_step_and_frees_the_grammar_state(tiny_path):
    """xgrammar raising while the sampled token is accepted (the matcher's state is then unknown):
    the constrained request fails, its grammar state is released, and the next constrained
    request is served under its grammar."""
    pytest.importorskip("xgrammar")
    from framework.sampling_params import StructuredOutputsParams

    core = LLM(tiny_path, num_blocks=32, block_size=8).engine.core
    manager = core.structured_outputs
    constrained = SamplingParams(
        temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="(t[2-5]){3}")
    )
    fail_once(manager, "accept_token", RuntimeError("matcher rejected token"), 1)
    core.add_request("g", PROMPTS["b"], constrained)
    request = core.requests["g"]
    failed = run(core)["g"]
    assert failed[-1].error_kind == STEP_FAILED and "matcher rejected" not in failed[-1].error
    assert request.structured_output is None and manager.num_compiling == 0
    assert_nothing_leaked(core)
    core.add_request("g", PROMPTS["b"], constrained)
    served = run(core)["g"]
    ids = [t for output in served for t in output.new_token_ids]
    assert served[-1].error is None and len(ids) == 4 and set(ids[:3]) <= {2, 3, 4, 5} and ids[3] == 1  # then EOS
