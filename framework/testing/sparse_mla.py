"""The sparse-MLA conformance kit (DeepSeek Sparse Attention): a backend with
``supports_sparse_mla`` attends each query only to its ``topk_indices``, stores only the head of
the widened cache rows and leaves their tail (the indexer's keys) alone; paged through shuffled
block tables and compared with dense attention over each query's selected keys."""

from __future__ import annotations

from framework.testing.attention import (
    _compare_with_dense,
    _shuffled_block_tables,
    _step_metadata,
    allocate_test_cache,
    dense_attention,
)

SPARSE_MLA_CASES = [
    # (name, query lens, context lens, num_heads, kv_lora_rank, qk_rope_head_dim, index_head_dim, topk)
    ("sparse_prefill", [7, 1, 19], [0, 0, 0], 4, 32, 8, 16, 4),
    ("sparse_with_prefix", [5, 3, 1], [11, 40, 20], 8, 64, 16, 16, 8),
    ("sparse_decode_shared_layer", [1, 1, 1], [3, 17, 30], 4, 32, 8, 0, 6),  # GLM-5 shared: no indexer key
]

#: what the kit writes into every row's tail (and the unwritten rows), to catch a backend that
#: overwrites the indexer's keys or reads slots it was not given
_TAIL_MARK = 7.0


def _random_selection(seq_len: int, topk: int, generator):
    """``[seq_len, topk]`` int32: for position ``p`` a random ``min(topk, p + 1)`` of ``0..p`` in
    random order, ``-1`` at random places for the rest."""
    import torch

    rows = []
    for p in range(seq_len):
        chosen = torch.randperm(p + 1, generator=generator)[: min(topk, p + 1)]
        row = torch.cat([chosen, torch.full((topk - chosen.numel(),), -1)])
        rows.append(row[torch.randperm(topk, generator=generator)])
    return torch.stack(rows).to(torch.int32)


def check_sparse_mla_attention_backend(
    backend, *, device="cpu", dtype=None, block_size: int = 16, atol: float = 1e-4, seed: int = 0
) -> None:
    """:func:`~framework.testing.check_mla_attention_backend` for sparse MLA layers
    (``MLAConfig.is_sparse``): every :data:`SPARSE_MLA_CASES` case against dense attention over
    each query's selected latents, and the cache rows' tails untouched."""
    import torch

    dtype = dtype or torch.float32
    generator = torch.Generator().manual_seed(seed)
    for case in SPARSE_MLA_CASES:
        _check_sparse_case(backend, case, device, dtype, block_size, atol, generator)


def _check_sparse_case(backend, case, device, dtype, block_size: int, atol: float, generator) -> None:
    import torch

    from framework.attention_backend import AttentionLayerConfig, MLAConfig

    name, query_lens, context_lens, num_heads, rank, rope, index_head_dim, topk = case
    mla = MLAConfig(rank, rope, is_sparse=True, index_head_dim=index_head_dim)
    size = mla.latent_size
    layer = AttentionLayerConfig(num_heads, 1, size, size**-0.5, mla=mla)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_blocks, tables = _shuffled_block_tables(seq_lens, block_size, generator)
    kv_cache = allocate_test_cache(backend, layer, "auto", dtype, num_blocks, block_size, device)
    assert kv_cache.data.shape[-1] == mla.row_size, f"{type(backend).__name__}: rows of {kv_cache.data.shape[-1]}"
    kv_cache.data.fill_(_TAIL_MARK)
    backend.initialize([layer], dtype, block_size, torch.device(device))
    latents = [torch.randn(s, size, generator=generator).to(dtype) for s in seq_lens]
    queries = [torch.randn(s, num_heads, size, generator=generator).to(dtype) for s in seq_lens]
    selections = [_random_selection(s, topk, generator) for s in seq_lens]

    def run(spans: dict[int, tuple[int, int]]) -> torch.Tensor:
        rows, metadata = _step_metadata(spans, tables, block_size, device)
        take = lambda xs: torch.cat([xs[r][slice(*spans[r])] for r in rows]).to(device)  # noqa: E731
        backend.prepare(metadata)
        out = backend.forward(
            layer, take(queries).flatten(1), take(latents), None, kv_cache, metadata, topk_indices=take(selections)
        )
        return out.view(-1, num_heads, rank).double().cpu()

    def expected(r: int, context_len: int, seq_len: int) -> torch.Tensor:
        outputs = []
        for p in range(context_len, seq_len):
            chosen = selections[r][p]
            keys = latents[r][chosen[chosen >= 0].sort().values.long(), None]
            outputs.append(dense_attention(queries[r][p : p + 1], keys, keys[..., :rank], layer.scale))
        return torch.cat(outputs)

    _compare_with_dense(backend, name, run, context_lens, seq_lens, atol, expected)
    tails = kv_cache.data[..., size:]
    assert bool((tails == _TAIL_MARK).all()), f"{type(backend).__name__} case {name!r} wrote into the rows' tails"
