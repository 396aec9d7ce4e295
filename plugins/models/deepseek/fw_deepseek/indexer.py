"""The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): which earlier tokens
each query's MLA attends to.

Per token (``H = index_n_heads``, ``D = index_head_dim``, ``R = qk_rope_head_dim``)::

    q       = wq_b(q_resid)                       [H, D]   (q_resid = q_a_layernorm(q_a_proj(x)), MLA's)
    k       = k_norm(wk(x))                       [D]      (a LayerNorm with bias; one key for all heads)
    q, k    : rotary on the first R features      (DeepSeek-V3.2: halves; GLM-5: interleaved pairs)
    w       = weights_proj(x) * H^-0.5            [H]      (float32)
    score_s = sum_h w_h * relu(q_h . k_s * D^-0.5)         for every cached token s <= the query's position
    chosen  = the index_topk highest scores (all tokens while the sequence is shorter)

Each token's key is cached in the tail of its MLA cache row (``[c_kv, k_pe, k]``, see
:mod:`framework.attention_backend`), so chunked prefill, prefix-cache hits and preemption reuse it
like the latent. The indexer runs in plain torch, one request at a time, reading the step's host
metadata (the reference; it is the oracle a fused kernel would be tested against): it cannot run
inside a CUDA graph, and refuses to. Tensor parallelism: every rank runs the whole
indexer (replicated weights) and so chooses the same tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from framework.config import ModelConfig
from framework.forward_context import get_forward_context
from framework.layers import LayerNorm, ReplicatedLinear
from framework.layers.rotary import get_rope
from framework.quantization import QuantConfig


def index_scores(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, query_start: int) -> torch.Tensor:
    """``[q, k]`` float32 scores of ``query [q, H, D]`` (roped, at positions ``query_start..``)
    with head ``weights [q, H]`` (scaled by ``H^-0.5``) over ``keys [k, D]`` at ``0..k-1``;
    ``-inf`` after each query's position."""
    scale = query.shape[-1] ** -0.5
    scores = torch.relu(torch.einsum("qhd,kd->qhk", query.float(), keys.float()) * scale)
    summed = torch.einsum("qh,qhk->qk", weights.float(), scores)
    q_pos = torch.arange(query_start, query_start + query.shape[0], device=query.device)[:, None]
    k_pos = torch.arange(keys.shape[0], device=query.device)[None, :]
    return summed.masked_fill(k_pos > q_pos, float("-inf"))


def select_topk(
    query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, query_start: int, topk: int
) -> torch.Tensor:
    """The top-``topk`` keys of each query by :func:`index_scores`.

    Returns ``[q, min(topk, k)]`` int32 positions, highest score first; ``-1`` where a query has
    fewer causal keys than that.
    """
    values, indices = index_scores(query, weights, keys, query_start).topk(min(topk, keys.shape[0]), dim=-1)
    return torch.where(values == float("-inf"), -1, indices).to(torch.int32)


class LightningIndexer(nn.Module):
    """``forward(positions, hidden, q_resid) -> topk_indices [T, K]`` for layer ``layer_index``
    (``K = min(index_topk, longest sequence of the step)``, ``-1`` pads); stores the step's keys
    in the tail of the layer's cache rows first, then scores every request's cached keys."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        quant_config: QuantConfig | None,
        prefix: str,
        *,
        is_neox_style: bool,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.head_dim = int(config.get("index_n_heads")), int(config.get("index_head_dim"))
        self.rope_dim, self.topk = int(config.get("qk_rope_head_dim")), int(config.get("index_topk"))
        if self.rope_dim > self.head_dim:
            raise ValueError(f"index_head_dim {self.head_dim} must be >= qk_rope_head_dim {self.rope_dim}")
        hidden, q_lora_rank = config.hidden_size, int(config.get("q_lora_rank"))
        linear = dict(bias=False, quant_config=quant_config)
        self.wq_b = ReplicatedLinear(q_lora_rank, self.num_heads * self.head_dim, prefix=f"{prefix}.wq_b", **linear)
        self.wk = ReplicatedLinear(hidden, self.head_dim, prefix=f"{prefix}.wk", **linear)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        # kept and applied in float32, as transformers does (_keep_in_fp32_modules)
        self.weights_proj = ReplicatedLinear(
            hidden, self.num_heads, bias=False, prefix=f"{prefix}.weights_proj", params_dtype=torch.float32
        )
        self.rotary_emb = get_rope(
            self.rope_dim,
            self.rope_dim,
            config.max_model_len,
            config.rope_theta,
            config.rope_scaling,
            is_neox_style=is_neox_style,
        )

    def project(
        self, positions: torch.Tensor, hidden: torch.Tensor, q_resid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's roped queries ``[T, H, D]``, roped keys ``[T, D]`` and head weights ``[T, H]``
        (float32, scaled by ``H^-0.5``): what :func:`select_topk` scores."""
        num_tokens, heads, rope = hidden.shape[0], self.num_heads, self.rope_dim
        q_rot, q_pass = (
            self.wq_b(q_resid).view(num_tokens, heads, self.head_dim).split([rope, self.head_dim - rope], -1)
        )
        k_rot, k_pass = self.k_norm(self.wk(hidden)).split([rope, self.head_dim - rope], -1)
        q_rot, k_rot = self.rotary_emb(positions, q_rot.contiguous(), k_rot.contiguous().view(num_tokens, 1, rope))
        query = torch.cat((q_rot.view(num_tokens, heads, rope), q_pass), dim=-1)
        key = torch.cat((k_rot.view(num_tokens, rope), k_pass), dim=-1)
        return query, key, self.weights_proj(hidden.float()) * heads**-0.5

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, q_resid: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, key, weights = self.project(positions, hidden, q_resid)
        context = get_forward_context()
        cache, metadata = context.kv_caches[self.layer_index].data, context.metadata
        if metadata.graph_batch_size is not None:
            raise RuntimeError("the lightning indexer loops over requests on the host: it cannot run in a CUDA graph")
        num_blocks, block_size, row_size = cache.shape
        rows = cache.view(num_blocks * block_size, row_size)
        rows[metadata.slot_mapping[:num_tokens], row_size - self.head_dim :] = key.to(cache.dtype)
        starts, seq_lens = metadata.cu_seqlens_q_cpu.tolist(), metadata.seq_lens_cpu.tolist()
        width = min(self.topk, max(seq_lens[: metadata.num_reqs]))
        topk_indices = torch.full((num_tokens, width), -1, dtype=torch.int32, device=hidden.device)
        for r in range(metadata.num_reqs):
            start, end, seq_len = starts[r], starts[r + 1], seq_lens[r]
            block_ids = metadata.block_table[r, : -(-seq_len // block_size)]
            keys = cache[block_ids].reshape(-1, row_size)[:seq_len, row_size - self.head_dim :]
            chosen = select_topk(query[start:end], weights[start:end], keys, seq_len - (end - start), self.topk)
            topk_indices[start:end, : chosen.shape[1]] = chosen
        return topk_indices
