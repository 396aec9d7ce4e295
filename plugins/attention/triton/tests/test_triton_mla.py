"""The Triton MLA kernels (``"mla"`` latent cache) against the torch reference backend: interpreted on
CPU (fp32, bf16 I/O), compiled on CUDA; and tiny DeepSeek-V2 / GLM-4.7-Flash models through the
engine on them against transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from framework import hookimpl
from framework.attention_backend import AttentionLayerConfig, AttentionMetadata, MLAConfig
from framework.kv_cache import KVCache
from framework.specs import AttentionBackendSpec
from framework.testing import (
    PARITY_PROMPTS,
    check_greedy_parity,
    check_logits_parity,
    check_mla_attention_backend,
    check_prefix_cache_parity,
    interpreted,
    require_triton,
    write_grouped_moe_model,
    write_tiny_model,
)

require_triton()

from fw_torch_attention.backend import TorchAttentionBackend  # noqa: E402
from fw_torch_attention.backend import store_latent as torch_store_latent  # noqa: E402
from fw_triton_attention.backend import TritonAttentionBackend  # noqa: E402
from fw_triton_attention.mla_decode import mla_decode, store_latent  # noqa: E402

PAGE = 16
CPU_NUM_SMS = 64  # enough "SMs" that long CPU decode cases split their contexts


def mla_layer(num_heads: int, rank: int, rope: int, scale: float | None = None) -> AttentionLayerConfig:
    size = rank + rope
    return AttentionLayerConfig(num_heads, 1, size, scale or size**-0.5, mla=MLAConfig(rank, rope))


def paged_step(query_lens, context_lens, num_heads, rank, rope, device, dtype, seed=0):
    """A step of requests with ``query_lens`` new tokens after ``context_lens`` cached ones, over a cache
    with random values in every slot (so a stray read or write shows) and shuffled block tables: ``(query,
    latent, cache, metadata)``. A request with query length 0 stands for a CUDA-graph padding row: one
    token in the sink block (the last one, spare), at its first slot, as the graph runner pads."""
    generator = torch.Generator().manual_seed(seed)
    is_padding = [q == 0 for q in query_lens]
    query_lens = [max(q, 1) for q in query_lens]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks = [-(-s // PAGE) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    sink = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=generator).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = sink if is_padding[r] else order[start : start + n]
        start += n
    slots = [
        int(table[r, p // PAGE]) * PAGE + p % PAGE
        for r, (c, s) in enumerate(zip(context_lens, seq_lens))
        for p in range(c, s)
    ]
    size = rank + rope
    cache = torch.randn(num_blocks, PAGE, size, generator=generator).to(dtype)
    query = torch.randn(sum(query_lens), num_heads * size, generator=generator).to(dtype)
    latent = torch.randn(sum(query_lens), size, generator=generator).to(dtype)
    cu = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=len(seq_lens),
        num_tokens=int(cu[-1]),
        cu_seqlens_q=cu.to(device),
        seq_lens=lens.to(device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=lens,
        is_decode_only=max(query_lens) == 1,
        block_table_cpu=table,
    )
    return query.to(device), latent.to(device), cache.to(device), metadata


def check_against_torch_backend(layer, step, atol, backend=None, padding=()):
    """The Triton backend's output and cache after ``step`` against the torch backend's (run on the CPU
    in float32 over the same inputs): outputs within ``atol`` x their scale, but for the ``padding`` rows
    (which race on the sink slot and whose outputs the engine drops), and
    the same cache in every slot (bit-identical: both store the latents as given)."""
    query, latent, cache, metadata = step
    backend = backend or TritonAttentionBackend(num_sms=CPU_NUM_SMS)
    triton_cache = cache.clone()
    out = backend.forward(layer, query, latent, None, KVCache(triton_cache), metadata)
    reference_cache = cache.cpu().clone()
    on_cpu = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
    cpu = AttentionMetadata(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in on_cpu.items()})
    expected = TorchAttentionBackend().forward(layer, query.cpu(), latent.cpu(), None, KVCache(reference_cache), cpu)
    rows = torch.ones(query.shape[0], dtype=torch.bool)
    rows[list(padding)] = False
    error = (out.cpu()[rows].double() - expected[rows].double()).abs().max().item()
    assert error <= atol * max(expected[rows].double().abs().max().item(), 1.0), error
    blocks = slice(None, -1 if padding else None)  # the sink block is the last
    assert torch.equal(triton_cache.cpu()[blocks], reference_cache[blocks])
    assert not torch.equal(triton_cache.cpu(), cache.cpu())  # the step did store something


def test_the_conformance_kit_passes():
    check_mla_attention_backend(TritonAttentionBackend(num_sms=CPU_NUM_SMS), atol=1e-4)


#: (name, query lens (0: a padding row), cached context lens, heads, kv_lora_rank, qk_rope_head_dim).
#: Page 16: contexts 15, 16, 31, 32 put the new token at the end of a page or the start of the next.
CPU_CASES = [
    ("decode_page_boundaries", [1, 1, 1, 1, 1], [0, 15, 16, 31, 32], 16, 64, 16),
    ("decode_long_split", [1, 1, 1], [300, 517, 40], 4, 32, 16),
    ("decode_padding_rows_many_head_blocks", [1, 0, 1, 0], [70, 0, 129, 0], 20, 32, 8),
    ("prefill_fresh", [7, 1, 19], [0, 0, 0], 4, 32, 16),
    ("prefill_with_prefix", [5, 16, 3, 1], [11, 32, 40, 63], 8, 64, 32),
    ("prefill_many_head_blocks_long_query", [40, 2], [9, 130], 20, 32, 8),
]


@interpreted
@pytest.mark.parametrize("case", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_interpreted_kernels_match_the_torch_backend_fp32(case):
    name, query_lens, context_lens, heads, rank, rope = case
    padding = [r for r, q in enumerate(query_lens) if q == 0]
    step = paged_step(query_lens, context_lens, heads, rank, rope, "cpu", torch.float32)
    assert step[3].is_decode_only == name.startswith("decode")
    check_against_torch_backend(mla_layer(heads, rank, rope, scale=0.11), step, 1e-4, padding=padding)


@interpreted
def test_interpreted_kernels_read_and_write_bf16():
    for case in (CPU_CASES[1], CPU_CASES[4]):
        _, query_lens, context_lens, heads, rank, rope = case
        step = paged_step(query_lens, context_lens, heads, rank, rope, "cpu", torch.bfloat16)
        check_against_torch_backend(mla_layer(heads, rank, rope), step, 2e-2)


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_decode_split_count_never_changes_the_result(num_splits):
    # 16 splits over 33..300 keys: most segments are empty, as in a graph captured for longer contexts
    query, latent, cache, metadata = paged_step([1, 1, 1, 1], [299, 32, 100, 5], 8, 32, 16, "cpu", torch.float32)
    metadata.slot_mapping[3] = -1  # a padding row: its latent is attended to but never stored
    common = dict(rank=32, num_reqs=4, max_seq_len=metadata.max_seq_len, sm_scale=0.2)
    query = query.view(4, 8, 48)
    store_latent(latent, cache, metadata.slot_mapping)
    expected = mla_decode(query, cache, metadata.seq_lens, metadata.block_table, num_splits=1, **common)
    out = mla_decode(query, cache, metadata.seq_lens, metadata.block_table, num_splits=num_splits, **common)
    assert (out - expected).abs().max().item() < 1e-5
    fused_cache = cache.clone()  # the fused store writes what store_latent wrote, and the same output
    fused = mla_decode(
        query,
        fused_cache,
        metadata.seq_lens,
        metadata.block_table,
        num_splits=num_splits,
        latent=latent,
        slot_mapping=metadata.slot_mapping,
        **common,
    )
    assert torch.equal(fused_cache, cache) and (fused - expected)[:3].abs().max().item() < 1e-5


@interpreted
def test_store_latent_writes_slots_and_skips_negative_padding_slots():
    cache = torch.zeros(4, PAGE, 40)
    latent = torch.randn(3, 40)
    slots = torch.tensor([17, -1, 63])
    store_latent(latent, cache, slots)
    expected = torch.zeros_like(cache)
    torch_store_latent(latent[[0, 2]], expected, slots[[0, 2]])
    assert torch.equal(cache, expected) and cache.abs().sum(-1).count_nonzero() == 2


def test_validate_accepts_mla_layers_and_names_what_it_cannot_read():
    deepseek_v2_lite = mla_layer(16, 512, 64)
    assert TritonAttentionBackend.validate([deepseek_v2_lite], "auto", None) == []
    reasons = TritonAttentionBackend.validate([mla_layer(16, 1024, 256)], "auto", None)
    assert reasons == ["MLA kv_lora_rank 1024 > 512 unsupported", "MLA qk_rope_head_dim 256 > 128 unsupported"]
    assert TritonAttentionBackend.validate([deepseek_v2_lite], "fp8", None) == [
        "kv dtype fp8: the MLA latent cache is read in the model dtype only (auto)"
    ]
    windowed = AttentionLayerConfig(16, 1, 576, 0.1, sliding_window=128, has_sinks=True, mla=MLAConfig(512, 64))
    assert TritonAttentionBackend.validate([windowed], "auto", None) == [
        "MLA layers with a sliding window unsupported",
        "MLA layers with attention sinks unsupported",
    ]


def test_registration_reads_the_mla_layout_on_cuda():
    from framework import registries
    from framework.engine.attention_choice import refusal_reasons
    from framework.platform import Platform

    hopper = Platform("cuda", num_devices=1, compute_capability=(9, 0), packages=frozenset({"triton"}), probed=True)
    layers = [mla_layer(16, 512, 64)]
    triton_spec = registries.attention_backends().get("triton")
    assert "mla" in triton_spec.kv_cache_layouts
    assert refusal_reasons(triton_spec, layers, "mla", "auto", torch.bfloat16, hopper) == []
    # FlashInfer's refusal of the layout: plugins/attention/flashinfer/tests


# --- through the engine, interpreted --------------------------------------------------------------


class InterpretedTritonMLAPlugin:
    """Offers the Triton backend on the CPU (kernels under TRITON_INTERPRET=1) for both layouts, so the
    engine's own steps (chunked prefill, prefix hits, decode steps storing their latents) run on it."""

    @hookimpl
    def register_attention_backends(self):
        return [
            AttentionBackendSpec(
                name="triton-interpreted",
                impl="fw_triton_attention.backend:TritonAttentionBackend",
                devices=("cpu",),
                kv_cache_layouts=("standard", "mla"),
                kv_cache_dtypes=("auto",),
            )
        ]


TINY_MLA = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    initializer_range=0.1,
)


def count_mla_kernel_calls(monkeypatch) -> dict[str, int]:
    """Count the backend's calls of the MLA decode (storing its latents), store and prefill wrappers."""
    from fw_triton_attention import backend

    calls = {"mla_decode storing": 0, "store_latent": 0, "mla_prefill": 0}
    for name, key in (("mla_decode", "mla_decode storing"), ("store_latent", None), ("mla_prefill", None)):

        def counted(*args, _function=getattr(backend, name), _key=key or name, **kwargs):
            calls[_key] += _key != "mla_decode storing" or kwargs.get("latent") is not None
            return _function(*args, **kwargs)

        monkeypatch.setattr(backend, name, counted)
    return calls


@interpreted
def test_tiny_deepseek_v2_on_the_interpreted_backend_matches_transformers(
    register_fw_plugin, tmp_path, one_thread, monkeypatch
):
    register_fw_plugin(InterpretedTritonMLAPlugin(), "triton_interpreted")
    calls = count_mla_kernel_calls(monkeypatch)
    reference = write_tiny_model(tmp_path, transformers.DeepseekV2Config(**TINY_MLA, topk_method="greedy"))
    engine = dict(attention_backend="triton-interpreted", device="cpu")
    llm = check_logits_parity(tmp_path, reference, PARITY_PROMPTS, **engine)  # chunked prefill over cached chunks
    assert llm.engine.attention_backend == "triton-interpreted"
    # 12 steps: the 5-token prompt's decode tokens cross into a second page
    check_greedy_parity(tmp_path, reference, PARITY_PROMPTS, steps=12, **engine)
    check_prefix_cache_parity(tmp_path, reference, PARITY_PROMPTS, steps=4, **engine)
    # per layer: chunks store their latents then run the prefill kernel; decode-only steps only the decode kernel
    assert calls["mla_decode storing"] >= 2 * 11 and calls["mla_prefill"] == calls["store_latent"] > 0, calls


@interpreted
def test_tiny_glm4_moe_lite_on_the_interpreted_backend_matches_transformers(
    register_fw_plugin, tmp_path, one_thread, monkeypatch
):
    register_fw_plugin(InterpretedTritonMLAPlugin(), "triton_interpreted")
    calls = count_mla_kernel_calls(monkeypatch)
    config = transformers.Glm4MoeLiteConfig(
        **{**TINY_MLA, "q_lora_rank": 24, "first_k_dense_replace": None},
        mlp_layer_types=["dense", "sparse"],
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        rope_interleave=False,
    )
    reference = write_grouped_moe_model(tmp_path, config)
    check_greedy_parity(
        tmp_path, reference, PARITY_PROMPTS[:2], steps=8, attention_backend="triton-interpreted", device="cpu"
    )
    assert calls["mla_decode storing"] > 0 and calls["mla_prefill"] > 0, calls


# --- compiled on the GPU ----------------------------------------------------------------------

#: DeepSeek-V2-Lite (16 heads), GLM-4.7-Flash (20 heads) and DeepSeek-V3 at TP=8 (16 of 128 heads):
#: kv_lora_rank 512, qk_rope_head_dim 64; long and short contexts, new pages, padding rows.
GPU_CASES = [
    ("v2_lite_decode", [1] * 6, [4095, 15, 16, 0, 1000, 8191], 16, 512, 64),
    ("v2_lite_decode_padding", [1, 0, 1, 0], [300, 0, 33, 0], 16, 512, 64),
    ("glm47_flash_decode", [1, 1, 1], [20000, 64, 2], 20, 512, 64),
    ("v2_lite_prefill_with_prefix", [512, 1, 37, 5], [0, 700, 64, 2000], 16, 512, 64),
    ("glm47_flash_mixed", [100, 1, 1], [33, 5000, 16], 20, 512, 64),
    ("v3_128_heads_decode", [1, 1], [3000, 17], 128, 512, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_compiled_kernels_match_the_torch_backend_on_cuda(case, dtype, atol):
    _, query_lens, context_lens, heads, rank, rope = case
    padding = [r for r, q in enumerate(query_lens) if q == 0]
    step = paged_step(query_lens, context_lens, heads, rank, rope, "cuda", dtype)
    check_against_torch_backend(mla_layer(heads, rank, rope), step, atol, TritonAttentionBackend(), padding)


@pytest.mark.gpu
def test_compiled_conformance_kit_passes_on_cuda_bf16():
    check_mla_attention_backend(TritonAttentionBackend(), device="cuda", dtype=torch.bfloat16, atol=2e-2)


@pytest.mark.gpu
def test_mla_decode_makes_no_host_sync_and_replays_in_a_cuda_graph():
    """A decode step (split: the graph runner passes the model's length as max_seq_len) replayed after
    the next step's queries, latents, lengths and slots were copied in gives the eager result."""
    from framework.testing import check_no_sync_and_cuda_graph_replay

    layer, backend = mla_layer(16, 512, 64), TritonAttentionBackend()
    query, latent, cache, metadata = paged_step([1] * 4, [100, 17, 900, 3], 16, 512, 64, "cuda", torch.bfloat16)
    metadata.max_seq_len = 4096
    table = metadata.block_table.long()
    rows = torch.arange(4, device="cuda")

    def run(q, lat, seq_lens, slots):
        metadata.seq_lens, metadata.slot_mapping = seq_lens, slots
        return backend.forward(layer, q, lat, None, KVCache(cache), metadata)

    def fresh():  # the next token of every request: one position further, its slot from the table
        position = metadata.seq_lens.long()
        slots = table[rows, position // PAGE] * PAGE + position % PAGE
        return torch.randn_like(query), torch.randn_like(latent), metadata.seq_lens + 1, slots

    inputs = [query, latent, metadata.seq_lens.clone(), metadata.slot_mapping.clone()]
    check_no_sync_and_cuda_graph_replay(run, inputs, fresh)


@pytest.mark.gpu
def test_tiny_deepseek_v2_runs_on_triton_with_cuda_graphs_and_matches_transformers(tmp_path):
    from framework import LLM, SamplingParams
    from framework.testing import check_kernels_used, count_kernel_calls, reference_greedy

    reference = write_tiny_model(tmp_path, transformers.DeepseekV2Config(**TINY_MLA, topk_method="greedy"))
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with count_kernel_calls() as calls:
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", num_blocks=64, prefill_chunk_size=8)
        assert llm.engine.attention_backend == "triton"
        assert "decode graphs" in llm.engine.summary["cuda_graphs"], llm.engine.summary
        results = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS], greedy)
    for prompt, result in zip(PARITY_PROMPTS, results, strict=True):
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt)
    check_kernels_used(calls, {"attention": "triton"})
