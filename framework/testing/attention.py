"""The attention-backend conformance kit: every case against dense attention, paged through
shuffled block tables (standard and MLA layouts)."""

from __future__ import annotations

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

#: Chunked local attention (Llama 4), for backends with ``supports_chunked_attention``: the cases'
#: eight fields then ``attention_chunk_size``. Prefills that cross chunk borders, a chunk that starts
#: inside the cached context, decodes right after and right before a border.
CHUNKED_ATTENTION_CASES = [
    ("chunked_prefill", [19, 7, 1], [0, 0, 0], 4, 2, 32, None, None, 8),
    ("chunked_with_prefix", [5, 12, 3], [11, 32, 40], 8, 2, 64, None, None, 8),
    ("chunked_decode", [1, 1, 1, 1], [16, 23, 5, 40], 4, 1, 32, None, None, 8),
]

#: Bidirectional spans (Gemma 3's image tokens), for backends with ``supports_bidirectional_spans``:
#: the cases' nine fields then, per sequence, its spans ``(first, end)`` among the step's positions.
#: Spans after a cached prefix, two in one sequence, one longer than the sliding window, a decode beside.
BIDIRECTIONAL_SPAN_CASES = [
    ("spans_prefill", [12, 1, 9], [0, 30, 5], 4, 2, 32, None, None, None, [[(2, 7)], [], [(5, 9), (10, 14)]]),
    ("spans_window", [20, 6], [3, 0], 4, 1, 32, 4, None, None, [[(5, 15), (16, 22)], [(0, 6)]]),
    ("spans_long", [150, 1], [10, 40], 4, 2, 32, None, None, None, [[(12, 150)], []]),
]


def span_ends(first: int, end: int, spans: list[tuple[int, int]]) -> list[int]:
    """Each position ``first .. end - 1``'s key end (:attr:`AttentionMetadata.span_ends`): ``p + 1``,
    or the end of the span ``(s, e)`` that holds ``p``."""
    ends = list(range(first + 1, end + 1))
    for start, stop in spans:
        for p in range(max(start, first), min(stop, end)):
            ends[p - first] = stop
    return ends


def dense_attention(
    query, key, value, scale: float, sliding_window=None, soft_cap=None, sinks=None, chunk_size=None, key_ends=None
):
    """Unpaged causal attention of one sequence: query ``[q, H, D]`` at the last ``q`` positions
    of ``key``/``value`` ``[k, H_kv, D]``. The oracle for paged backends (float64). ``sinks``
    ``[H]``: per-head logits joining each softmax's denominator (gpt-oss), as
    ``exp(sink) / (exp(sink) + sum exp(scores))`` taken from the keys' weights. ``chunk_size``:
    chunked local attention, keys of the query's own chunk of positions only (Llama 4).
    ``key_ends`` ``[q]`` (bidirectional spans): each query sees keys before its end, not up to itself."""
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
    allowed = k_pos <= q_pos if key_ends is None else k_pos < torch.as_tensor(key_ends)[:, None]
    if sliding_window:
        allowed &= k_pos > q_pos - sliding_window
    if chunk_size:
        allowed &= k_pos // chunk_size == q_pos // chunk_size
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    weights = scores.softmax(-1)
    if sinks is not None:  # renormalise by hand, independently of the backends' running-max tricks
        expo = (scores - scores.amax(-1, keepdim=True)).exp()
        sink = (sinks.double().to(scores.device)[:, None, None] - scores.amax(-1, keepdim=True)).exp()
        weights = expo / (expo.sum(-1, keepdim=True) + sink)
    return (weights @ v).transpose(0, 1)


def check_attention_backend(
    backend,
    *,
    device="cpu",
    dtype=None,
    block_size: int = 16,
    atol: float = 1e-4,
    seed: int = 0,
    cases=None,
    kv_dtype: str = "auto",
    with_sinks: bool = False,
) -> None:
    """Run ``backend`` (an AttentionBackend instance) on random paged inputs of many shapes and
    assert it matches :func:`dense_attention` within ``atol`` (relative to the output scale).
    ``with_sinks``: every layer has attention sinks (random per-head logits, ``has_sinks=True``).

    With a quantized ``kv_dtype`` the oracle attends over the dequantized cache: the keys and
    values as :func:`framework.kv_quant.quantize_kv` stores them, dequantized and rotated back, so
    the check covers the backend's store, its reading of the packed rows and its query rotation.

    Each case first writes the cached context into the paged cache through the backend itself
    (a prefill of the sequences that have one), then runs the step under test. Block tables are
    shuffled so that a backend that ignores them fails.
    """
    import torch

    dtype = dtype or torch.float32
    generator = torch.Generator().manual_seed(seed)
    for case in cases or ATTENTION_CASES:
        _check_attention_case(backend, case, device, dtype, block_size, atol, generator, kv_dtype, with_sinks)


def allocate_test_cache(backend, layer, kv_dtype: str, dtype, num_blocks: int, block_size: int, device):
    """A zeroed :class:`~framework.kv_cache.KVCache` of ``num_blocks`` as ``backend`` declares it
    for ``layer`` and the registered ``kv_dtype`` (seed 0 for rotated keys)."""
    import torch

    from framework import registries

    spec = backend.kv_cache_spec(layer, registries.kv_cache_dtypes().get(kv_dtype), dtype, block_size)
    return spec.allocate(num_blocks, torch.device(device))


def as_cached(kv_cache, keys, values):
    """``keys``/``values`` ``[T, H_kv, D]`` as ``kv_cache`` holds them: quantized, dequantized and
    (turbo) rotated back, float32; unchanged for a model-dtype cache."""
    from framework import kv_quant

    if not kv_cache.is_quantized:
        return keys, values
    rows, scales = kv_quant.quantize_kv(kv_cache, keys, values)
    cached_keys, cached_values = kv_quant.dequantize_kv(kv_cache, rows, scales)
    if kv_cache.spec.rotate_keys:
        cached_keys = kv_quant.unrotate(cached_keys, kv_cache.rotation_signs)
    if kv_cache.spec.rotate_values:
        cached_values = kv_quant.unrotate(cached_values, kv_cache.rotation_signs)
    return cached_keys, cached_values


def _check_attention_case(
    backend,
    case,
    device,
    dtype,
    block_size: int,
    atol: float,
    generator,
    kv_dtype: str = "auto",
    with_sinks: bool = False,
) -> None:
    """One case of :func:`check_attention_backend`."""
    import torch

    from framework.attention_backend import AttentionLayerConfig

    name, query_lens, context_lens, num_heads, num_kv_heads, head_size, window, cap, *rest = case
    chunk = rest[0] if rest else None  # CHUNKED_ATTENTION_CASES
    bidirectional = rest[1] if len(rest) > 1 else None  # BIDIRECTIONAL_SPAN_CASES
    layer = AttentionLayerConfig(
        num_heads,
        num_kv_heads,
        head_size,
        head_size**-0.5,
        window,
        cap,
        has_sinks=with_sinks,
        attention_chunk_size=chunk,
        has_bidirectional_spans=bidirectional is not None,
    )
    # sinks around the scores' scale (|q.k| * scale ~ 1), some far above, so they take real weight
    sinks = torch.randn(num_heads, generator=generator) * 2.0 if with_sinks else None
    extra = {} if sinks is None else {"sinks": sinks.to(device)}
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_blocks, tables = _shuffled_block_tables(seq_lens, block_size, generator)
    kv_cache = allocate_test_cache(backend, layer, kv_dtype, dtype, num_blocks, block_size, device)
    backend.initialize([layer], dtype, block_size, torch.device(device))
    rand = lambda n, h: torch.randn(n, h, head_size, generator=generator).to(dtype)  # noqa: E731
    keys, values = [rand(s, num_kv_heads) for s in seq_lens], [rand(s, num_kv_heads) for s in seq_lens]
    queries = [rand(s, num_heads) for s in seq_lens]
    cached = [[t.cpu() for t in as_cached(kv_cache, k.to(device), v.to(device))] for k, v in zip(keys, values)]

    def run(spans: dict[int, tuple[int, int]]) -> torch.Tensor:
        """One backend call computing positions ``spans[r] = (first, end)`` of sequences ``r``."""
        rows, metadata = _step_metadata(spans, tables, block_size, device)
        if bidirectional is not None:
            ends = [end for r in rows for end in span_ends(*spans[r], bidirectional[r])]
            metadata.span_ends = torch.tensor(ends, dtype=torch.int32, device=device)
        take = lambda xs: torch.cat([xs[r][slice(*spans[r])] for r in rows]).to(device).flatten(1)  # noqa: E731
        backend.prepare(metadata)
        out = backend.forward(layer, take(queries), take(keys), take(values), kv_cache, metadata, **extra)
        return out.view(-1, num_heads, head_size).double().cpu()

    _compare_with_dense(
        backend,
        name,
        run,
        context_lens,
        seq_lens,
        atol,
        lambda r, c, s: dense_attention(
            queries[r][c:s],
            cached[r][0][:s],
            cached[r][1][:s],
            layer.scale,
            window,
            cap,
            sinks,
            chunk,
            None if bidirectional is None else span_ends(c, s, bidirectional[r]),
        ),
    )


MLA_ATTENTION_CASES = [
    # (name, query lens, context lens already cached, num_heads, kv_lora_rank, qk_rope_head_dim)
    ("mla_prefill", [7, 1, 19], [0, 0, 0], 4, 32, 16),
    ("mla_prefill_with_prefix", [5, 16, 3], [11, 32, 40], 8, 64, 32),
    ("mla_decode", [1, 1, 1], [3, 17, 70], 16, 32, 8),
]


def check_mla_attention_backend(
    backend, *, device="cpu", dtype=None, block_size: int = 16, atol: float = 1e-4, seed: int = 0
) -> None:
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
    return num_blocks, [order[starts[r] : starts[r + 1]] for r in range(len(seq_lens))]


def _compare_with_dense(
    backend, name: str, run, context_lens: list[int], seq_lens: list[int], atol: float, expected_of
) -> None:
    """Write each sequence's cached context through ``run``, run the step under test, and compare
    sequence ``r``'s rows with ``expected_of(r, context_len, seq_len)`` within ``atol`` x its scale."""
    context = {r: (0, c) for r, c in enumerate(context_lens) if c}
    if context:
        run(context)
    out = run({r: (c, s) for r, (c, s) in enumerate(zip(context_lens, seq_lens))})
    offset = 0
    for r, (c, s) in enumerate(zip(context_lens, seq_lens)):
        expected = expected_of(r, c, s)
        error = (out[offset : offset + s - c] - expected).abs().max().item()
        bound = atol * max(expected.abs().max().item(), 1.0)
        assert error <= bound, (
            f"{type(backend).__name__} case {name!r} sequence {r}: max error {error:.3g} > {bound:.3g}"
        )
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
        num_reqs=len(rows),
        num_tokens=int(cu[-1]),
        cu_seqlens_q=cu.to(device),
        seq_lens=lens.to(device),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q_lens),
        max_seq_len=int(lens.max()),
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=lens,
        is_decode_only=all(n == 1 for n in q_lens),
        block_table_cpu=table.cpu(),
    )
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
    kv_cache = allocate_test_cache(backend, layer, "auto", dtype, num_blocks, block_size, device)
    backend.initialize([layer], dtype, block_size, torch.device(device))
    latents = [torch.randn(s, size, generator=generator).to(dtype) for s in seq_lens]
    queries = [torch.randn(s, num_heads, size, generator=generator).to(dtype) for s in seq_lens]

    def run(spans: dict[int, tuple[int, int]]) -> torch.Tensor:
        rows, metadata = _step_metadata(spans, tables, block_size, device)
        take = lambda xs: torch.cat([xs[r][slice(*spans[r])] for r in rows]).to(device)  # noqa: E731
        backend.prepare(metadata)
        out = backend.forward(layer, take(queries).flatten(1), take(latents), None, kv_cache, metadata)
        return out.view(-1, num_heads, rank).double().cpu()

    _compare_with_dense(
        backend,
        name,
        run,
        context_lens,
        seq_lens,
        atol,
        lambda r, c, s: dense_attention(
            queries[r][c:s], latents[r][:s, None], latents[r][:s, None, :rank], layer.scale
        ),
    )
