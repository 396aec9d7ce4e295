"""The Triton backend against dense attention: interpreted on CPU (fp32), compiled on CUDA (bf16/fp16)."""

from __future__ import annotations

import pytest
import torch

from framework import hookimpl
from framework.attention_backend import AttentionLayerConfig
from framework.kv_cache import KVCache
from framework.platform import Platform
from framework.specs import AttentionBackendSpec
from framework.testing import (
    ATTENTION_CASES,
    BIDIRECTIONAL_SPAN_CASES,
    CHUNKED_ATTENTION_CASES,
    PARITY_PROMPTS,
    check_attention_backend,
    check_greedy_parity,
    dense_attention,
    interpreted,
    require_triton,
    write_tiny_model,
)

require_triton()

from fw_triton_attention.backend import TritonAttentionBackend  # noqa: E402
from fw_triton_attention.decode import decode_attention, num_kv_splits  # noqa: E402
from fw_triton_attention.kv_store import store_kv  # noqa: E402

#: Interpreter-sized cases: (name, query lens, cached context lens, heads, KV heads, head size, window, soft-cap).
CPU_CASES = [
    ("prefill_gqa1", [7, 1, 19], [0, 0, 0], 4, 4, 32, None, None),
    ("prefill_with_prefix_gqa4", [5, 16, 3], [11, 32, 40], 8, 2, 64, None, None),
    ("decode_short_gqa8", [1, 1, 1, 1], [3, 17, 1, 30], 8, 1, 64, None, None),
    ("decode_long_split_gqa1", [1, 1], [300, 530], 4, 4, 128, None, None),
    ("decode_long_split_gqa8", [1, 1, 1], [257, 420, 40], 16, 2, 64, None, None),
    ("mixed_gqa4", [9, 1, 4], [20, 64, 0], 8, 2, 64, None, None),
    ("mixed_gqa8_long_query", [40, 1, 1, 5], [33, 70, 0, 9], 16, 2, 32, None, None),
    ("sliding_window_prefill", [12, 1, 6], [30, 50, 0], 4, 2, 32, 9, None),
    ("sliding_window_decode_split", [1, 1], [600, 45], 4, 2, 32, 300, None),
    ("soft_cap_prefill", [6, 1], [10, 25], 4, 4, 64, None, 5.0),
    ("soft_cap_decode_split", [1, 1], [290, 25], 4, 4, 64, None, 5.0),
    ("head_size_80", [9, 1], [5, 20], 4, 2, 80, None, None),
]
#: Enough "SMs" that the decode cases above split their contexts (see test_cpu_decode_cases_split).
CPU_NUM_SMS = 64


@interpreted
@pytest.mark.parametrize("case", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_interpreted_kernels_match_dense_attention_fp32(case):
    check_attention_backend(
        TritonAttentionBackend(num_sms=CPU_NUM_SMS), device="cpu", dtype=torch.float32, atol=1e-4, cases=[case]
    )


#: small interpreter cases for the quantized caches: a prefill over cached prefixes, a mixed step
#: (prefill and decode rows) and a decode step with a window; more per dtype below
QUANTIZED_CASES = [
    ("prefix_prefill_gqa4", [5, 9, 3], [11, 32, 20], 8, 2, 64, None, None),
    ("mixed_soft_cap", [4, 1], [9, 21], 4, 2, 32, None, 5.0),
    ("decode_window_gqa4", [1, 1, 1], [40, 17, 3], 8, 2, 64, 24, None),
]
QUANTIZED_EXTRA_CASES = {
    "fp8": [("head_size_80", [9, 1], [5, 20], 4, 2, 80, None, None)],  # no rotation: any multiple of 8
    "turbo3": [("decode_split", [1, 1], [300, 40], 4, 2, 32, None, None)],  # the split-KV reduce
}


@interpreted
@pytest.mark.parametrize("kv_dtype", ["fp8", "turbo8", "turbo4", "turbo3"])
def test_interpreted_kernels_read_quantized_caches_as_dense_attention_on_the_dequantized_cache(kv_dtype):
    cases = QUANTIZED_CASES + QUANTIZED_EXTRA_CASES.get(kv_dtype, [])
    check_attention_backend(
        TritonAttentionBackend(num_sms=CPU_NUM_SMS), device="cpu", atol=1e-4, cases=cases, kv_dtype=kv_dtype
    )


@interpreted
def test_interpreted_kernels_read_and_write_bf16():
    # loads are cast to fp32 under the interpreter (it computes bf16 wrongly); I/O stays bf16
    check_attention_backend(
        TritonAttentionBackend(num_sms=CPU_NUM_SMS),
        device="cpu",
        dtype=torch.bfloat16,
        atol=2e-2,
        cases=[CPU_CASES[1], CPU_CASES[10]],
    )


#: Prefill, split and unsplit decode, and a window: where the sink enters each kernel's softmax.
SINK_CASES = [CPU_CASES[i] for i in (1, 2, 4, 5, 7, 8)]


#: Chunked local attention (chunks of 8): prefills across chunk borders and over cached prefixes,
#: decodes right after and before a border (split decodes: test_chunked_decode_split_count...).
CHUNKED_CPU_CASES = CHUNKED_ATTENTION_CASES


@interpreted
def test_interpreted_kernels_keep_chunked_attention_within_each_chunk():
    check_attention_backend(
        TritonAttentionBackend(num_sms=CPU_NUM_SMS),
        device="cpu",
        dtype=torch.float32,
        atol=1e-4,
        cases=CHUNKED_CPU_CASES,
    )


@interpreted
def test_interpreted_kernels_let_the_tokens_of_a_bidirectional_span_see_each_other():
    check_attention_backend(
        TritonAttentionBackend(num_sms=CPU_NUM_SMS),
        device="cpu",
        dtype=torch.float32,
        atol=1e-4,
        cases=BIDIRECTIONAL_SPAN_CASES,
    )


@interpreted
def test_interpreted_kernels_add_attention_sinks_fp32():
    check_attention_backend(
        TritonAttentionBackend(num_sms=CPU_NUM_SMS),
        device="cpu",
        dtype=torch.float32,
        atol=1e-4,
        cases=SINK_CASES,
        with_sinks=True,
    )


def test_cpu_decode_cases_split_their_contexts():
    for name, query_lens, context_lens, _, num_kv_heads, _, window, _ in CPU_CASES:
        if "split" in name:
            max_seq_len = max(c + q for c, q in zip(context_lens, query_lens, strict=True))
            max_seq_len = min(max_seq_len, window or max_seq_len)
            assert num_kv_splits(len(query_lens), num_kv_heads, max_seq_len, CPU_NUM_SMS) > 1, name


def _shuffled_table(seq_lens, page, generator):
    """A block table giving each request the pages it needs in shuffled order, and the number of
    blocks (two more than needed, left unused)."""
    blocks = [-(-s // page) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = order[start : start + n]
        start += n
    return table, num_blocks


def _paged_decode_case(seq_lens, num_heads, num_kv_heads, head_size, page, device, dtype, seed=0, chunk_size=None):
    """Random query ``[R, H, D]``, a paged cache with shuffled blocks, and the dense reference per
    request (with ``chunk_size``: chunked local attention)."""
    generator = torch.Generator().manual_seed(seed)
    table, num_blocks = _shuffled_table(seq_lens, page, generator)
    cache = torch.randn(2, num_blocks, page, num_kv_heads, head_size, generator=generator).to(dtype)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=generator).to(dtype)
    expected = []
    for r, s in enumerate(seq_lens):
        k, v = (cache[i, table[r].long()].flatten(0, 1)[:s] for i in (0, 1))
        expected.append(dense_attention(query[r : r + 1], k, v, head_size**-0.5, chunk_size=chunk_size)[0])
    to = dict(device=device)
    return (
        query.to(**to),
        cache.to(**to),
        torch.tensor(seq_lens, dtype=torch.int32, **to),
        table.to(**to),
        torch.stack(expected),
    )


def _decode_error(query, cache, seq_lens, table, expected, **kwargs):
    out = decode_attention(
        query,
        cache,
        seq_lens,
        table,
        num_reqs=len(seq_lens),
        max_seq_len=int(seq_lens.max()),
        sm_scale=query.shape[-1] ** -0.5,
        **kwargs,
    )
    return (out.double().cpu() - expected).abs().max().item()


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_decode_split_count_never_changes_the_result(num_splits):
    # 16 splits over 33..70 keys: most segments are empty, as when a CUDA graph is captured for
    # longer contexts than the step has
    case = _paged_decode_case([70, 33, 64], 8, 2, 32, 16, "cpu", torch.float32)
    assert _decode_error(*case, num_splits=num_splits) < 1e-5


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3])
def test_chunked_decode_split_count_never_changes_the_result(num_splits):
    # chunks of 16: the requests' last chunks hold 6, 1 and 16 keys, spread over the splits
    case = _paged_decode_case([70, 33, 64], 8, 2, 32, 16, "cpu", torch.float32, chunk_size=16)
    assert _decode_error(*case, num_splits=num_splits, chunk_size=16) < 1e-5


def _fused_store_case(seq_lens, num_heads, num_kv_heads, head_size, page, device, dtype, seed=0):
    """A decode step over a paged cache full of random values (every slot, so a stray write shows):
    ``(query, cache, seq_lens, table, key, value, slots)``. Request ``r``'s new token sits at
    ``seq_len - 1`` and its slot comes from the block table; a request of length 0 stands for a
    CUDA-graph padding row: length 1, slot -1. ``key``/``value`` are column slices of one fused
    QKV-like tensor, as the backend passes them (token stride wider than ``H_kv * D``)."""
    generator = torch.Generator().manual_seed(seed)
    is_padding = [s == 0 for s in seq_lens]
    seq_lens = [max(s, 1) for s in seq_lens]
    table, num_blocks = _shuffled_table(seq_lens, page, generator)
    slots = [
        -1 if pad else int(table[r, (s - 1) // page]) * page + (s - 1) % page
        for r, (s, pad) in enumerate(zip(seq_lens, is_padding, strict=True))
    ]
    cache = torch.randn(2, num_blocks, page, num_kv_heads, head_size, generator=generator).to(dtype)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=generator).to(dtype)
    qkv = torch.randn(len(seq_lens), num_heads + 2 * num_kv_heads, head_size, generator=generator).to(dtype)
    to = dict(device=device)
    qkv = qkv.to(**to)
    key, value = qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    return (
        query.to(**to),
        cache.to(**to),
        torch.tensor(seq_lens, dtype=torch.int32, **to),
        table.to(**to),
        key,
        value,
        torch.tensor(slots, dtype=torch.int64, **to),
    )


def _check_fused_store_matches_store_kv(
    seq_lens, num_heads, num_kv_heads, head_size, page, device, dtype, atol, **kwargs
):
    """``decode_attention`` with the new K/V against ``store_kv`` + ``decode_attention`` without: the
    same output for every real request (padding rows' outputs are discarded by the engine) and a
    bit-identical cache, every slot."""
    query, cache, lens, table, key, value, slots = _fused_store_case(
        seq_lens, num_heads, num_kv_heads, head_size, page, device, dtype
    )
    common = dict(num_reqs=len(seq_lens), max_seq_len=int(lens.max()), sm_scale=head_size**-0.5, **kwargs)
    unfused_cache = cache.clone()
    store_kv(key, value, unfused_cache, slots)
    expected = decode_attention(query, unfused_cache, lens, table, **common)
    fused_cache = cache.clone()
    out = decode_attention(query, fused_cache, lens, table, key=key, value=value, slot_mapping=slots, **common)
    assert torch.equal(fused_cache, unfused_cache)
    assert not torch.equal(fused_cache, cache)  # the step did store something
    real = torch.tensor([s > 0 for s in seq_lens], device=device)
    error = (out[real].double() - expected[real].double()).abs().max().item()
    assert error <= atol * max(expected[real].double().abs().max().item(), 1.0), error


#: (name, seq lens (0: a padding row, slot -1), heads, KV heads, head size, window). Page 16: lengths
#: 1, 17, 33 put the new token at offset 0 of a new page.
FUSED_STORE_CASES = [
    ("lengths_gqa4_new_pages", [17, 1, 90, 33, 64], 8, 2, 32, None),
    ("gqa1_head80_padding_row", [40, 0, 70], 4, 4, 80, None),
    ("gqa8_padding_rows", [0, 49, 0, 120], 16, 2, 64, None),
    ("sliding_window_gqa2", [90, 33, 12], 4, 2, 32, 20),
]


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("case", FUSED_STORE_CASES, ids=[c[0] for c in FUSED_STORE_CASES])
def test_decode_with_new_kv_matches_store_kv_then_decode(case, num_splits):
    # exact: the fused kernel folds in the very values store_kv would have written (fp32 under the interpreter)
    _, seq_lens, heads, kv_heads, head_size, window = case
    _check_fused_store_matches_store_kv(
        seq_lens,
        heads,
        kv_heads,
        head_size,
        16,
        "cpu",
        torch.float32,
        0.0,
        num_splits=num_splits,
        sliding_window=window,
    )


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_rows_sharing_the_graphs_sink_slot_leave_every_other_slot_alone(num_splits):
    """As the CUDA-graph runner pads a batch: every padding row has length 1, the sink block as its
    table and the same (positive) sink slot. They race only on that slot, which nothing reads."""
    query, cache, lens, table, key, value, slots = _fused_store_case(
        [30, 0, 45, 0, 0], 8, 2, 32, 16, "cpu", torch.float32
    )
    padding = torch.tensor([False, True, False, True, True])
    used = {int(block) for row, n in ((0, 2), (2, 3)) for block in table[row, :n]}
    sink = min(set(range(cache.shape[1])) - used)  # the case leaves two blocks unused
    table[padding] = sink
    slots[padding] = sink * 16
    common = dict(num_reqs=5, max_seq_len=45, sm_scale=32**-0.5, num_splits=num_splits)
    unfused_cache = cache.clone()
    store_kv(key[~padding], value[~padding], unfused_cache, slots[~padding])
    expected = decode_attention(query, unfused_cache, lens, table, **common)
    fused_cache = cache.clone()
    out = decode_attention(query, fused_cache, lens, table, key=key, value=value, slot_mapping=slots, **common)
    others = [block for block in range(cache.shape[1]) if block != sink]
    assert torch.equal(fused_cache[:, others], unfused_cache[:, others])
    assert torch.equal(out[~padding], expected[~padding])


@interpreted
def test_decode_with_new_kv_matches_store_kv_then_decode_bf16():
    _check_fused_store_matches_store_kv([17, 0, 50], 8, 2, 64, 16, "cpu", torch.bfloat16, 0.0, num_splits=2)


def test_decode_with_new_kv_needs_key_value_and_slots_together():
    query, cache, lens, table, key, value, slots = _fused_store_case([5, 9], 4, 2, 32, 16, "cpu", torch.float32)
    common = dict(num_reqs=2, max_seq_len=9, sm_scale=0.1)
    with pytest.raises(ValueError, match="all of key, value and slot_mapping"):
        decode_attention(query, cache, lens, table, key=key, value=value, **common)
    with pytest.raises(ValueError, match="key must be"):
        decode_attention(query, cache, lens, table, key=key[:, :1], value=value, slot_mapping=slots, **common)


def _steps_metadata(starts, ends, table, page):
    """Metadata of one step computing positions ``[starts[r], ends[r])`` of request ``r``."""
    from framework.attention_backend import AttentionMetadata

    q_lens = [e - s for s, e in zip(starts, ends, strict=True)]
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    lens = torch.tensor(ends, dtype=torch.int32)
    slots = [int(table[r, p // page]) * page + p % page for r in range(len(starts)) for p in range(starts[r], ends[r])]
    return AttentionMetadata(
        num_reqs=len(starts),
        num_tokens=int(cu[-1]),
        cu_seqlens_q=cu,
        seq_lens=lens,
        block_table=table,
        slot_mapping=torch.tensor(slots),
        max_query_len=max(q_lens),
        max_seq_len=max(ends),
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=lens,
        is_decode_only=max(q_lens) == 1,
    )


@interpreted
def test_backend_decode_steps_store_the_kv_that_later_steps_read():
    # a prefill (store_kv + prefill kernel), then decode steps whose K/V only the decode kernel
    # stores: each step must see the earlier steps' tokens, and the cache must end up as store_kv
    # of every token would leave it
    page, heads, kv_heads, head_size, steps = 16, 8, 2, 32, 4
    prompt_lens = [15, 30]  # request 0's second decode token opens a new page
    backend, layer = TritonAttentionBackend(num_sms=CPU_NUM_SMS), AttentionLayerConfig(heads, kv_heads, head_size, 0.2)
    generator = torch.Generator().manual_seed(3)
    total = [n + steps for n in prompt_lens]
    table = torch.randperm(8, generator=generator).to(torch.int32).view(2, 4)
    keys, values, queries = (
        [torch.randn(n, h, head_size, generator=generator) for n in total] for h in (kv_heads, kv_heads, heads)
    )
    cache = torch.randn(2, 8, page, kv_heads, head_size, generator=generator)
    expected_cache = cache.clone()
    for step in range(steps + 1):
        starts = [0, 0] if step == 0 else [n + step - 1 for n in prompt_lens]
        ends = prompt_lens if step == 0 else [n + step for n in prompt_lens]
        metadata = _steps_metadata(starts, ends, table, page)
        query, key, value = (
            torch.cat([x[s:e] for x, s, e in zip(xs, starts, ends, strict=True)]) for xs in (queries, keys, values)
        )
        out = backend.forward(layer, query.flatten(1), key.flatten(1), value.flatten(1), KVCache(cache), metadata).view(
            -1, heads, head_size
        )
        store_kv(key, value, expected_cache, metadata.slot_mapping)
        if step:
            assert metadata.is_decode_only
            for r, end in enumerate(ends):
                expected = dense_attention(queries[r][end - 1 : end], keys[r][:end], values[r][:end], layer.scale)
                assert (out[r] - expected[0]).abs().max().item() < 1e-4, (step, r)
    assert torch.equal(cache, expected_cache)


@interpreted
def test_store_kv_writes_slots_and_skips_negative_padding_slots():
    cache = torch.zeros(2, 4, 16, 2, 32)
    key, value = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    store_kv(key, value, cache, torch.tensor([17, -1, 63]))
    flat = cache.view(2, 64, 2, 32)
    assert torch.equal(flat[0, 17], key[0]) and torch.equal(flat[1, 63], value[2])
    assert flat.abs().sum(dim=(2, 3)).count_nonzero() == 4  # two slots, keys and values; padding wrote nothing


def test_validate_names_unsupported_head_size_gqa_and_kv_dtype():
    good = AttentionLayerConfig(32, 8, 128, 128**-0.5)
    assert TritonAttentionBackend.validate([good], "auto", None) == []
    assert TritonAttentionBackend.validate([good], "turbo3", None) == []
    reasons = TritonAttentionBackend.validate([AttentionLayerConfig(6, 4, 512, 0.1)], "fp8", None)
    assert any("head size 512" in r for r in reasons)
    assert any("not a multiple" in r for r in reasons)
    reasons = TritonAttentionBackend.validate([AttentionLayerConfig(4, 2, 80, 0.1)], "turbo4", None)
    assert reasons == ["kv dtype turbo4 rotates keys by a Walsh-Hadamard transform: head size 80 is not a power of two"]


def test_registration_selects_triton_on_cuda_and_never_on_cpu():
    from framework import registries

    spec = registries.attention_backends().get("triton")
    assert registries.attention_backends().plugin_of("triton") == "triton_attention"
    assert spec.load() is TritonAttentionBackend
    assert spec.priority > registries.attention_backends().get("torch").priority
    assert spec.unavailable_reasons(Platform("cpu", packages=frozenset({"triton"})))
    hopper = Platform("cuda", num_devices=1, compute_capability=(9, 0), packages=frozenset({"triton"}), probed=True)
    assert spec.unavailable_reasons(hopper) == []
    no_triton = Platform("cuda", num_devices=1, compute_capability=(9, 0), probed=True)
    assert any("triton" in r for r in spec.unavailable_reasons(no_triton))


# --- compiled on the GPU ----------------------------------------------------------------------

#: 8 requests with up to 32k cached tokens, Llama-3-8B heads (32 query / 8 KV, head 128).
LONG_DECODE = ("decode_32k_gqa4", [1] * 8, [32767, 20000, 32767, 8191, 32767, 1000, 32767, 16], 32, 8, 128, None, None)


@pytest.mark.gpu
def test_compiled_kernels_add_attention_sinks_on_cuda_bf16():
    check_attention_backend(
        TritonAttentionBackend(), device="cuda", dtype=torch.bfloat16, atol=2e-2, cases=CPU_CASES, with_sinks=True
    )


@pytest.mark.gpu
def test_compiled_kernels_let_bidirectional_spans_see_each_other_on_cuda_bf16():
    check_attention_backend(
        TritonAttentionBackend(), device="cuda", dtype=torch.bfloat16, atol=2e-2, cases=BIDIRECTIONAL_SPAN_CASES
    )


@pytest.mark.gpu
def test_compiled_kernels_keep_chunked_attention_within_each_chunk_on_cuda_bf16():
    check_attention_backend(
        TritonAttentionBackend(), device="cuda", dtype=torch.bfloat16, atol=2e-2, cases=CHUNKED_CPU_CASES
    )


@pytest.mark.gpu
def test_compiled_kernels_match_dense_attention_on_cuda_bf16():
    check_attention_backend(
        TritonAttentionBackend(), device="cuda", dtype=torch.bfloat16, atol=2e-2, cases=ATTENTION_CASES + CPU_CASES
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, atol", [(torch.float16, 2e-2), (torch.float32, 1e-4)], ids=["fp16", "fp32"])
def test_compiled_kernels_match_dense_attention_on_cuda(dtype, atol):
    check_attention_backend(TritonAttentionBackend(), device="cuda", dtype=dtype, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp8", "turbo8", "turbo4", "turbo3"])
def test_compiled_kernels_read_quantized_caches_on_cuda(kv_dtype):
    # bf16 tiles of the dequantized rows on tensor cores; the oracle quantizes with framework.kv_quant
    check_attention_backend(TritonAttentionBackend(), device="cuda", dtype=torch.bfloat16, atol=3e-2, kv_dtype=kv_dtype)


@pytest.mark.gpu
def test_long_context_split_kv_decode_matches_dense_attention_on_cuda():
    check_attention_backend(
        TritonAttentionBackend(), device="cuda", dtype=torch.bfloat16, atol=2e-2, cases=[LONG_DECODE]
    )


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 7, 64])
def test_compiled_decode_split_count_never_changes_the_result(num_splits):
    case = _paged_decode_case([5000, 33, 1], 32, 8, 128, 16, "cuda", torch.bfloat16)
    assert _decode_error(*case, num_splits=num_splits) < 2e-2


#: Per-rank heads of Llama-3-8B and Qwen3-32B at TP=2 (16 / 32 query, 4 KV heads of 128); long and
#: short contexts, new pages, a padding row (0), a sliding window.
GPU_FUSED_STORE_CASES = [
    ("llama3-8b-tp2", [5000, 17, 1, 128, 0, 4097], 16, 4, 128, None),
    ("qwen3-32b-tp2", [129, 33, 2048, 0], 32, 4, 128, None),
    ("qwen3-32b-tp2-window", [5000, 300, 65], 32, 4, 128, 1024),
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4, 16])
@pytest.mark.parametrize("case", GPU_FUSED_STORE_CASES, ids=[c[0] for c in GPU_FUSED_STORE_CASES])
def test_compiled_decode_with_new_kv_matches_store_kv_then_decode_bf16(case, num_splits):
    _, seq_lens, heads, kv_heads, head_size, window = case
    _check_fused_store_matches_store_kv(
        seq_lens,
        heads,
        kv_heads,
        head_size,
        16,
        "cuda",
        torch.bfloat16,
        1e-2,
        num_splits=num_splits,
        sliding_window=window,
    )


@pytest.mark.gpu
def test_forward_does_not_sync_with_the_host():
    from framework.attention_backend import AttentionMetadata

    backend, layer = TritonAttentionBackend(), AttentionLayerConfig(8, 2, 128, 128**-0.5, None, None)
    cache = torch.randn(2, 64, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    for query_lens in ([1, 1, 1], [5, 1, 40]):
        seq_lens = [100 + q for q in query_lens]
        cu = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        num_tokens = int(cu[-1])
        metadata = AttentionMetadata(
            num_reqs=3,
            num_tokens=num_tokens,
            cu_seqlens_q=cu.cuda(),
            seq_lens=lens.cuda(),
            block_table=torch.arange(3 * 10, dtype=torch.int32, device="cuda").view(3, 10),
            slot_mapping=torch.arange(num_tokens, device="cuda") + 16 * 30,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            cu_seqlens_q_cpu=cu,
            seq_lens_cpu=lens,
            is_decode_only=max(query_lens) == 1,
        )
        q = torch.randn(num_tokens, 8 * 128, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(num_tokens, 2 * 128, device="cuda", dtype=torch.bfloat16)
        backend.forward(layer, q, kv, kv, KVCache(cache), metadata)  # compile outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = backend.forward(layer, q, kv, kv, KVCache(cache), metadata)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert out.isfinite().all()


class InterpretedTritonPlugin:
    """Offers the Triton backend on the CPU (its kernels under TRITON_INTERPRET=1), so that the
    engine's own steps (chunked prefill, then decode steps that store their K/V in the decode
    kernel) run on it here; the real spec keeps it to CUDA."""

    @hookimpl
    def register_attention_backends(self):
        return [
            AttentionBackendSpec(
                name="triton-interpreted",
                impl="fw_triton_attention.backend:TritonAttentionBackend",
                devices=("cpu",),
                kv_cache_layouts=("standard",),
                kv_cache_dtypes=("auto",),
            )
        ]


@interpreted
def test_engine_on_the_interpreted_backend_generates_transformers_greedy_tokens(
    register_fw_plugin, tmp_path, monkeypatch
):
    import transformers
    from fw_triton_attention import backend

    register_fw_plugin(InterpretedTritonPlugin(), "triton_interpreted")
    calls = {"store_kv": 0, "decode storing": 0, "decode": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name if kwargs.get("key") is None else "decode storing"] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(backend, "store_kv", counted("store_kv", store_kv))
    monkeypatch.setattr(backend, "decode_attention", counted("decode", decode_attention))
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    reference = write_tiny_model(tmp_path, config)
    # 16 steps: the 13- and 29-token prompts' decode tokens cross into a new page (16 tokens each)
    check_greedy_parity(
        tmp_path, reference, PARITY_PROMPTS, steps=16, device="cpu", attention_backend="triton-interpreted"
    )
    # per layer: prefill chunks store with store_kv, decode-only steps in the decode kernel
    assert calls["decode storing"] >= 2 * 14 and calls["decode"] == 0 and calls["store_kv"] > 0, calls
