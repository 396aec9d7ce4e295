"""Test helpers for fw and for plugin authors (a pytest plugin: ``pytest_plugins = ["framework.testing"]``).

Fixtures:

* ``register_fw_plugin``: ``register_fw_plugin(obj, name="x")`` registers a plugin object (a
  module or any object with ``@hookimpl`` methods) for the current test only.
* ``fresh_plugins``: forget loaded plugins before and after the test, so a test can set
  ``FW_PLUGINS`` / ``FW_DISABLE_PLUGINS`` with ``monkeypatch`` and load again.
* ``one_thread`` (module scope): torch on one intra-op thread for a module of tiny-model tests
  (threads only add synchronisation there, and on a busy 2-core runner OpenMP's spinning threads
  make them many times slower); the previous setting is restored after the module.

Conformance kits for plugin authors: attention backends (``check_attention_backend``), tool
parsers, model parity (``ModelParityTests``), and quantization methods against
dequantize-then-matmul (``check_linear_method``, ``check_moe_method``, in :mod:`framework.testing.quant`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest

from framework import plugins


@contextlib.contextmanager
def registered_plugin(obj: Any, name: str) -> Iterator[Any]:
    """Register ``obj`` as plugin ``name`` for the duration of the ``with`` block."""
    plugins.register_plugin(obj, name)
    try:
        yield obj
    finally:
        plugins.unregister_plugin(name)


@pytest.fixture(scope="module")
def one_thread():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def register_fw_plugin():
    """Register plugin objects for one test: ``register_fw_plugin(obj, name="mine")``."""
    with contextlib.ExitStack() as stack:
        yield lambda obj, name="test_plugin": stack.enter_context(registered_plugin(obj, name))


@pytest.fixture
def fresh_plugins():
    """Reset plugin discovery before and after the test (environment changes take effect)."""
    plugins.reset_plugins()
    yield plugins
    plugins.reset_plugins()


def make_tiny_tokenizer(vocab_size: int):
    """A word-level ``tokenizers.Tokenizer`` with tokens ``t0 .. t{n-1}`` plus ``<s>``/``</s>``.

    Enough for tests of tiny random-weight models, which are driven by token ids.
    """
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


def randomise_identity_params(model, seed: int = 2) -> None:
    """Give ``model``'s norm weights (ones) and biases (zeros) random values, so that a misplaced
    norm or bias changes the outputs (``1 + 0.3 N(0, 1)`` and ``0.3 N(0, 1)``)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = 0.3 * torch.randn(param.shape, generator=generator)
            if "norm" in name and name.endswith(".weight"):
                param.copy_(1.0 + noise)
            elif name.endswith(".bias"):
                param.copy_(noise)


def write_randomised_model(path, hf_config):
    """:func:`write_tiny_model` with :func:`randomise_identity_params` applied before the one write;
    returns the reference."""
    return write_tiny_model(path, hf_config, randomise_norms_and_biases=True)


def write_tiny_model(path, hf_config, seed: int = 0, chat_template: str | None = None, *,
                     randomise_norms_and_biases: bool = False):
    """Write a random-weight transformers model of ``hf_config`` (a ``PretrainedConfig``) to ``path``.

    Saves safetensors weights, ``config.json``, a word-level ``tokenizer.json`` and
    ``tokenizer_config.json``; returns the transformers model (fp32, eval mode) as the reference.
    ``randomise_norms_and_biases`` applies :func:`randomise_identity_params` before saving.
    """
    import json
    from pathlib import Path

    import torch
    import transformers

    path = Path(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if randomise_norms_and_biases:
        randomise_identity_params(model)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer(hf_config.vocab_size).save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return model


# --- conformance helpers ---------------------------------------------------------------------

ATTENTION_CASES = [
    # (name, query lens, context lens already cached, num_heads, num_kv_heads, head_size, sliding_window, soft_cap)
    ("prefill", [7, 1, 19], [0, 0, 0], 4, 4, 32, None, None),
    ("prefill_with_prefix", [5, 16, 3], [11, 32, 40], 8, 2, 64, None, None),
    ("decode_short", [1, 1, 1, 1], [3, 17, 1, 30], 8, 1, 64, None, None),
    ("decode_long", [1, 1], [700, 1100], 8, 8, 128, None, None),
    ("mixed_gqa4", [9, 1, 4], [20, 64, 0], 8, 2, 64, None, None),
    ("sliding_window", [12, 1, 6], [30, 50, 0], 4, 2, 32, 9, None),
    ("soft_cap", [6, 1], [10, 25], 4, 4, 64, None, 5.0),
]


def dense_attention(query, key, value, scale: float, sliding_window=None, soft_cap=None):
    """Unpaged causal attention of one sequence: query ``[q, H, D]`` at the last ``q`` positions
    of ``key``/``value`` ``[k, H_kv, D]``. The oracle for paged backends (float64)."""
    import torch

    group = query.shape[1] // key.shape[1]
    q = query.double().transpose(0, 1)
    k = key.double().repeat_interleave(group, 1).transpose(0, 1)
    v = value.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale
    if soft_cap:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    q_pos = torch.arange(k.shape[1] - q.shape[1], k.shape[1])[:, None]
    k_pos = torch.arange(k.shape[1])[None, :]
    allowed = k_pos <= q_pos
    if sliding_window:
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def check_attention_backend(backend, *, device="cpu", dtype=None, block_size: int = 16, atol: float = 1e-4, seed: int = 0,
                            cases=None) -> None:
    """Run ``backend`` (an AttentionBackend instance) on random paged inputs of many shapes and
    assert it matches :func:`dense_attention` within ``atol`` (relative to the output scale).

    Each case first writes the cached context into the paged cache through the backend itself
    (a prefill of the sequences that have one), then runs the step under test. Block tables are
    shuffled so that a backend that ignores them fails.
    """
    import torch

    dtype = dtype or torch.float32
    generator = torch.Generator().manual_seed(seed)
    for case in cases or ATTENTION_CASES:
        _check_attention_case(backend, case, device, dtype, block_size, atol, generator)


def _check_attention_case(backend, case, device, dtype, block_size: int, atol: float, generator) -> None:
    """One case of :func:`check_attention_backend`."""
    import torch

    from framework.attention_backend import AttentionLayerConfig

    name, query_lens, context_lens, num_heads, num_kv_heads, head_size, window, cap = case
    layer = AttentionLayerConfig(num_heads, num_kv_heads, head_size, head_size**-0.5, window, cap)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_blocks, tables = _shuffled_block_tables(seq_lens, block_size, generator)
    kv_cache = torch.zeros(backend.layer_kv_cache_shape(layer, num_blocks, block_size), dtype=dtype, device=device)
    backend.initialize([layer], dtype, block_size, torch.device(device))
    rand = lambda n, h: torch.randn(n, h, head_size, generator=generator).to(dtype)  # noqa: E731
    keys, values = [rand(s, num_kv_heads) for s in seq_lens], [rand(s, num_kv_heads) for s in seq_lens]
    queries = [rand(s, num_heads) for s in seq_lens]

    def run(spans: dict[int, tuple[int, int]]) -> torch.Tensor:
        """One backend call computing positions ``spans[r] = (first, end)`` of sequences ``r``."""
        rows, metadata = _step_metadata(spans, tables, block_size, device)
        take = lambda xs: torch.cat([xs[r][slice(*spans[r])] for r in rows]).to(device).flatten(1)  # noqa: E731
        backend.prepare(metadata)
        out = backend.forward(layer, take(queries), take(keys), take(values), kv_cache, metadata)
        return out.view(-1, num_heads, head_size).double().cpu()

    _compare_with_dense(backend, name, run, context_lens, seq_lens, atol, lambda r, c, s: dense_attention(
        queries[r][c:s], keys[r][:s], values[r][:s], layer.scale, window, cap))


MLA_ATTENTION_CASES = [
    # (name, query lens, context lens already cached, num_heads, kv_lora_rank, qk_rope_head_dim)
    ("mla_prefill", [7, 1, 19], [0, 0, 0], 4, 32, 16),
    ("mla_prefill_with_prefix", [5, 16, 3], [11, 32, 40], 8, 64, 32),
    ("mla_decode", [1, 1, 1], [3, 17, 70], 16, 32, 8),
]


def check_mla_attention_backend(backend, *, device="cpu", dtype=None, block_size: int = 16, atol: float = 1e-4,
                                seed: int = 0) -> None:
    """Like :func:`check_attention_backend` for the ``"mla"`` KV layout: ``backend`` attends with
    absorbed queries ``[T, H * (L + R)]`` over cached latents ``[T, L + R]`` whose first ``L``
    features are the values; compared with :func:`dense_attention` over one KV head."""
    import torch

    dtype = dtype or torch.float32
    generator = torch.Generator().manual_seed(seed)
    for case in MLA_ATTENTION_CASES:
        _check_mla_case(backend, case, device, dtype, block_size, atol, generator)



def _shuffled_block_tables(seq_lens: list[int], block_size: int, generator) -> tuple[int, list[list[int]]]:
    """``(num_blocks, tables)``: blocks for ``seq_lens`` tokens in a shuffled order (plus 3 spare), so
    a backend that ignores its block tables fails."""
    import torch

    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    starts = torch.tensor([0, *blocks_per_seq]).cumsum(0).tolist()
    return num_blocks, [order[starts[r]:starts[r + 1]] for r in range(len(seq_lens))]


def _compare_with_dense(backend, name: str, run, context_lens: list[int], seq_lens: list[int], atol: float,
                        expected_of) -> None:
    """Write each sequence's cached context through ``run``, run the step under test, and compare
    sequence ``r``'s rows with ``expected_of(r, context_len, seq_len)`` within ``atol`` x its scale."""
    context = {r: (0, c) for r, c in enumerate(context_lens) if c}
    if context:
        run(context)
    out = run({r: (c, s) for r, (c, s) in enumerate(zip(context_lens, seq_lens))})
    offset = 0
    for r, (c, s) in enumerate(zip(context_lens, seq_lens)):
        expected = expected_of(r, c, s)
        error = (out[offset:offset + s - c] - expected).abs().max().item()
        bound = atol * max(expected.abs().max().item(), 1.0)
        assert error <= bound, f"{type(backend).__name__} case {name!r} sequence {r}: max error {error:.3g} > {bound:.3g}"
        offset += s - c


def _step_metadata(spans: dict[int, tuple[int, int]], tables: list[list[int]], block_size: int, device):
    """``(rows, AttentionMetadata)`` of one step computing positions ``spans[r] = (first, end)`` of sequences ``r``."""
    import torch

    from framework.attention_backend import AttentionMetadata

    rows = sorted(spans)
    q_lens = [spans[r][1] - spans[r][0] for r in rows]
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    lens = torch.tensor([spans[r][1] for r in rows], dtype=torch.int32)
    width = max(len(tables[r]) for r in rows)
    table = torch.tensor([tables[r] + [0] * (width - len(tables[r])) for r in rows], dtype=torch.int32, device=device)
    slots = [tables[r][p // block_size] * block_size + p % block_size for r in rows for p in range(*spans[r])]
    metadata = AttentionMetadata(
        num_reqs=len(rows), num_tokens=int(cu[-1]), cu_seqlens_q=cu.to(device), seq_lens=lens.to(device),
        block_table=table, slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q_lens), max_seq_len=int(lens.max()), cu_seqlens_q_cpu=cu, seq_lens_cpu=lens,
        is_decode_only=all(n == 1 for n in q_lens), block_table_cpu=table.cpu())
    return rows, metadata


def _check_mla_case(backend, case, device, dtype, block_size: int, atol: float, generator) -> None:
    """One case of :func:`check_mla_attention_backend`."""
    import torch

    from framework.attention_backend import AttentionLayerConfig, MLAConfig

    name, query_lens, context_lens, num_heads, rank, rope = case
    mla = MLAConfig(rank, rope)
    size = mla.latent_size
    layer = AttentionLayerConfig(num_heads, 1, size, size**-0.5, mla=mla)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_blocks, tables = _shuffled_block_tables(seq_lens, block_size, generator)
    kv_cache = torch.zeros(backend.layer_kv_cache_shape(layer, num_blocks, block_size), dtype=dtype, device=device)
    backend.initialize([layer], dtype, block_size, torch.device(device))
    latents = [torch.randn(s, size, generator=generator).to(dtype) for s in seq_lens]
    queries = [torch.randn(s, num_heads, size, generator=generator).to(dtype) for s in seq_lens]

    def run(spans: dict[int, tuple[int, int]]) -> torch.Tensor:
        rows, metadata = _step_metadata(spans, tables, block_size, device)
        take = lambda xs: torch.cat([xs[r][slice(*spans[r])] for r in rows]).to(device)  # noqa: E731
        backend.prepare(metadata)
        out = backend.forward(layer, take(queries).flatten(1), take(latents), None, kv_cache, metadata)
        return out.view(-1, num_heads, rank).double().cpu()

    _compare_with_dense(backend, name, run, context_lens, seq_lens, atol, lambda r, c, s: dense_attention(
        queries[r][c:s], latents[r][:s, None], latents[r][:s, None, :rank], layer.scale))


def random_chunks(text: str, seed: int, max_size: int = 13) -> list[str]:
    """``text`` cut into pieces of 1 to ``max_size`` characters, their sizes drawn from
    ``random.Random(seed)``: a stream's deltas as a client might see them."""
    import random

    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        size = rng.randint(1, max_size)
        pieces.append(text[i:i + size])
        i += size
    return pieces


def check_tool_parser_streaming(parser_cls, text: str, tools=None, *, seeds: int = 8):
    """Feed ``text`` to ``parser_cls(tools)`` whole and in random chunkings (``seeds`` of them, 1 to
    13 characters a piece); assert that every chunking's deltas assemble to the one-shot result and
    that each call's first delta, and only it, names the call. Returns the one-shot result."""
    from framework.parsers.base import assemble

    def summary(result):
        return result.content, [(c.name, c.arguments) for c in result.tool_calls]

    one_shot = parser_cls(tools).parse(text)
    for seed in range(seeds):
        parser = parser_cls(tools)
        deltas = [parser.feed(piece) for piece in random_chunks(text, seed)] + [parser.finish()]
        assert summary(assemble(deltas)) == summary(one_shot), f"chunking seed {seed} differs from the one-shot result"
        named = set()
        for delta in deltas:
            for piece in delta.tool_calls:
                assert (piece.name is not None) == (piece.index not in named), f"call {piece.index}: name not first"
                named.add(piece.index)
    return one_shot


# --- references for model parity tests -------------------------------------------------------


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
    return ids[len(prompt):]


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
    results = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    for index, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt, steps), f"prompt {index}"
        assert result.outputs[0].finish_reason == "length"


#: Prompts for tiny-model parity tests (vocabulary >= 160): 5, 13 and 29 tokens.
PARITY_PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 53)), [13, 89, 26, 117, 4, 150, 77, 31, 62, 8, 141, 55, 99, 20, 133,
                                                           47, 71, 106, 12, 158, 39, 84, 3, 125, 66, 18, 92, 144, 57]]


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
    results = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    assert llm.engine.core.stats().num_preemptions > 0
    for index, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt, steps), f"prompt {index}"
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.num_blocks


def check_no_sync_and_cuda_graph_replay(run, inputs, fresh_inputs) -> None:
    """``run(*inputs)`` (tensors in, a tensor or a sequence of tensors out) on CUDA: after a warm-up call
    (compilation), a second call makes no host synchronisation, and a CUDA graph captured of it,
    replayed after ``fresh_inputs()`` is copied into ``inputs``, gives exactly what an eager call gives."""
    import torch

    run(*inputs)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(*inputs)
    for static, fresh in zip(inputs, fresh_inputs(), strict=True):
        static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(outs, run(*inputs), rtol=0, atol=0)


def require_triton() -> None:
    """Skip the calling test, or at module level the whole module, when triton is not installed."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'triton>=3.4'; the interpreter "
                                         "runs it on CPU)")


#: Marks a test that runs Triton kernels under the interpreter on the CPU (the root conftest sets
#: ``TRITON_INTERPRET=1`` there; where CUDA is present the kernels compile instead and these skip).
#: The condition is a string so that pytest reads the variable when the test runs, not at import.
interpreted = pytest.mark.skipif('os.environ.get("TRITON_INTERPRET") != "1"',
                                 reason="CPU tests run the kernels under TRITON_INTERPRET=1 (off when CUDA is present)")


class HopperCompile(NamedTuple):
    """One kernel variant for :func:`compile_for_hopper`: the kernel as ``"module:name"``, the types
    of its pointer arguments (``"*bf16"``, ``"*i32"``...), its constexpr values, which other
    arguments are 64-bit ints or fp32 scalars (the rest are 32-bit ints), compile options
    (``num_warps``, ``num_stages``), and which arguments to compile as multiples of 16: Triton's
    launcher specializes a kernel so for a 16-byte-aligned pointer or an int divisible by 16, and
    vectorized loads depend on it, so list them to see the PTX a GPU launch with such values runs."""

    kernel: str
    pointer_types: dict[str, str]
    constexprs: dict[str, Any]
    int64_args: tuple[str, ...] = ()
    float_args: tuple[str, ...] = ()
    options: dict[str, Any] | None = None
    divisible_by_16: tuple[str, ...] = ()


def compile_for_hopper(cases: list[HopperCompile]) -> list[str]:
    """The PTX of each ``@triton.jit`` kernel variant, compiled for sm_90 (H100/H200) through
    Triton's whole pipeline and ``ptxas``, on any machine: no GPU needed.

    The interpreter runs a kernel's arithmetic on the CPU but never lowers it; this makes a kernel
    that would not compile on the GPU machine (a bad inline-PTX instruction, an unsupported mask
    type) or could not launch there (more shared memory than an SM has) fail in CI. It runs in a
    fresh process, because a process with ``TRITON_INTERPRET=1`` (as the CPU tests have) cannot
    lower kernels. Raises the compiler's error, or ``ValueError`` for the shared memory.
    """
    import concurrent.futures
    import multiprocessing

    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
            return pool.submit(_compile_for_hopper_here, cases).result()
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def _compile_for_hopper_here(cases: list[HopperCompile]) -> list[str]:
    import importlib
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptx = []
    for case in cases:
        module, name = case.kernel.split(":")
        kernel = getattr(importlib.import_module(module), name)
        unknown = set(case.divisible_by_16) - set(inspect.signature(kernel.fn).parameters)
        if unknown:
            raise ValueError(f"{case.kernel} has no arguments {sorted(unknown)} to compile as multiples of 16")
        signature = {}
        attrs = {}
        for index, arg in enumerate(inspect.signature(kernel.fn).parameters):
            if arg in case.divisible_by_16:
                attrs[(index,)] = [["tt.divisibility", 16]]
            if arg in case.constexprs:
                signature[arg] = "constexpr"
            elif arg in case.pointer_types:
                signature[arg] = case.pointer_types[arg]
            else:
                signature[arg] = "i64" if arg in case.int64_args else "fp32" if arg in case.float_args else "i32"
        source = ASTSource(kernel, signature, constexprs=case.constexprs, attrs=attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=case.options or {})
        if compiled.metadata.shared > HOPPER_SHARED_MEMORY:  # Triton itself checks this only when loading on a GPU
            raise ValueError(f"{case.kernel} {case.constexprs} needs {compiled.metadata.shared} bytes of shared memory; "
                             f"an H100/H200 SM has {HOPPER_SHARED_MEMORY}")
        ptx.append(compiled.asm["ptx"])
    return ptx


#: Shared memory one thread block may use on an H100/H200 (227 KiB).
HOPPER_SHARED_MEMORY = 232448


# --- which kernels ran --------------------------------------------------------------------------


@contextlib.contextmanager
def count_kernel_calls() -> Iterator[dict[str, int]]:
    """Count what the layers and engines built inside the block call: ``{"op/name": calls}`` for
    the kernel registry's implementations (``"fused_moe/triton"``, ``"rms_norm/torch"``) and
    ``{"attention/name": calls}`` for the attention backend's ``forward``.

    Layers resolve their kernels at construction (:func:`framework.kernels.get_kernel`), so build
    the engine inside the block; shared rotary modules are rebuilt for it. Replays of a CUDA graph
    do not reach Python: the counts are of eager calls and graph captures (prefill is eager).
    :func:`check_kernels_used` turns the counts into a test that a fallback fails.
    """
    import collections
    import functools

    from framework import kernels
    from framework.engine.builder import EngineBuilder
    from framework.layers import rotary

    calls: collections.Counter[str] = collections.Counter()

    def counted(key: str, function: Any) -> Any:
        @functools.wraps(function)
        def counting(*args: Any, **kwargs: Any) -> Any:
            calls[key] += 1
            return function(*args, **kwargs)

        return counting

    resolve, select_backend = kernels._resolve, EngineBuilder.select_attention_backend

    def counting_resolve(op: str, name: str | None, generation: int, device_type: str | None) -> Any:
        key = kernels._select(op, name, device_type).key  # the spec whose implementation ``_resolve`` loads
        return counted(key, resolve(op, name, generation, device_type))

    def counting_select_backend(builder: EngineBuilder) -> Any:
        backend = select_backend(builder)
        backend.forward = counted(f"attention/{builder.backend_name}", backend.forward)
        return backend

    rotary._cached_rope.cache_clear()  # a rotary module built before the block holds an uncounted kernel
    kernels._resolve, EngineBuilder.select_attention_backend = counting_resolve, counting_select_backend
    try:
        yield calls
    finally:
        kernels._resolve, EngineBuilder.select_attention_backend = resolve, select_backend
        rotary._cached_rope.cache_clear()  # nor may later models share a counting one


def check_kernels_used(calls: dict[str, int], expected: dict[str, str]) -> None:
    """Every op of ``expected`` (``{"fused_moe": "triton", "attention": "triton", ...}``; ``"attention"``
    is the attention backend) ran, through the named implementation and no other. ``calls`` come
    from :func:`count_kernel_calls`; an op that fell back to another implementation (the torch
    reference where Triton was meant), or never ran, fails with the counts of that op."""
    failures = []
    for op, name in sorted(expected.items()):
        ran = {key.partition("/")[2]: count for key, count in calls.items() if key.partition("/")[0] == op and count}
        if set(ran) != {name}:
            failures.append(f"{op}: expected only {name!r} to run, ran {ran or 'nothing'}")
    assert not failures, "; ".join(failures) + f" (all calls: {dict(sorted(calls.items()))})"


def metric_value(text: str, name: str, label: str | None = None) -> float:
    """The value of the Prometheus sample ``name`` in ``/metrics`` text: the first one, or the
    first whose labels contain ``label`` (e.g. ``'"abort"'``); 0.0 for an absent labelled sample
    (a counter not yet incremented), an assertion error for an absent metric."""
    import re

    labels = rf"\{{[^}}]*{re.escape(label)}[^}}]*\}}" if label else r"(?:\{[^}]*\})?"
    match = re.search(rf"^{re.escape(name)}{labels} (\S+)$", text, re.MULTILINE)
    if match is None and label is not None:
        return 0.0
    assert match, f"{name} not in /metrics"
    return float(match.group(1))



_QUANT_KITS = ("QuantScheme", "check_linear_method", "check_moe_method")


def __getattr__(name: str) -> Any:
    """The quantization conformance kits (:mod:`framework.testing.quant`), imported on first use
    (they import torch; this module does not)."""
    if name in _QUANT_KITS:
        from framework.testing import quant

        return getattr(quant, name)
    raise AttributeError(f"module 'framework.testing' has no attribute {name!r}")
