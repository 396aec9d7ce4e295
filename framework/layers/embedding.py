"""The token embedding and the LM head, vocab-parallel (each rank holds a slice of the vocabulary).

Both store a ``[vocab, hidden]`` table through a :class:`~framework.quantization.LinearMethod`
(the table is a linear weight with the vocabulary as output features), so a quantization
method can quantize either: the embedding looks rows up with ``linear_method.embedding``, the
LM head multiplies with ``linear_method.apply``. Rank r holds token ids
``[r * V/tp, (r+1) * V/tp)`` of the vocabulary padded to ``V``, a multiple of ``tp`` (the padding
rows are zero and the LM head drops their logits). ``tp_size``/``tp_rank`` default to this
process's tensor-parallel group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from framework.distributed.partition import pad_to_multiple
from framework.layers.linear import (
    KeepsWeightAttrs,
    LinearMethod,
    UnquantizedLinearMethod,
    load_column_shard,
    resolve_tp,
    set_weight_attrs,
    tensor_parallel_all_reduce,
    tensor_parallel_gather_to_rank0,
)
from framework.quantization import quant_method_for

if TYPE_CHECKING:
    from framework.quantization import QuantConfig


class VocabEmbedding(KeepsWeightAttrs):
    """``forward(input_ids) -> [..., embedding_dim]``: the rows of the embedding table."""

    #: Its loaders only narrow and copy, so they take lazy checkpoint slices (model_loader).
    reads_checkpoint_slices = True

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        super().__init__()
        tp_size, tp_rank = resolve_tp(tp_size, tp_rank)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_size, self.tp_rank, self.prefix = tp_size, tp_rank, prefix
        self.num_embeddings_padded = pad_to_multiple(num_embeddings, tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // tp_size
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        # The LinearMethod view of the table: input = hidden features, output = vocabulary.
        self.input_size, self.output_size = embedding_dim, num_embeddings
        self.input_size_per_partition = embedding_dim
        self.output_partition_sizes = [self.num_embeddings_per_partition]
        self.output_size_per_partition = self.num_embeddings_per_partition
        self.params_dtype = params_dtype or torch.get_default_dtype()
        method = quant_method_for(quant_config, self, prefix, LinearMethod, "a vocabulary table")
        self.linear_method: LinearMethod | None = method or UnquantizedLinearMethod()
        self.linear_method.create_weights(
            self, embedding_dim, self.output_partition_sizes, embedding_dim, num_embeddings, self.params_dtype
        )

    @property
    def quant_method(self) -> LinearMethod | None:
        """The table's LinearMethod (``None`` for a head tied to the embedding's table)."""
        return self.linear_method

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        """Copy this rank's vocabulary rows of the full checkpoint table (padding rows: zero)."""
        load_column_shard(param, loaded_weight, self.tp_rank, zero_padding=True)

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return self.linear_method.embedding(self, input_ids)
        # Ids owned by other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        is_local = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(is_local, input_ids - self.vocab_start_index, 0)
        embeddings = self.linear_method.embedding(self, local_ids).masked_fill(~is_local.unsqueeze(-1), 0)
        return tensor_parallel_all_reduce(embeddings)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings_per_partition}, embedding_dim={self.embedding_dim}, "
            f"tp={self.tp_rank}/{self.tp_size}, method={type(self.linear_method).__name__}"
        )


class LMHead(VocabEmbedding):
    """``forward(hidden) -> logits [..., num_embeddings]``: under tensor parallelism each rank
    computes its vocabulary shard and rank 0, which samples, gathers the full vocabulary; the
    other ranks get their shard back.

    :meth:`tie_weights` makes it use the token embedding's table (``tie_word_embeddings``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, quant_config, prefix, tp_size, tp_rank)
        # A plain attribute, not a submodule: the embedding owns (loads, moves, post-processes) the table.
        self.__dict__["tied_embedding"] = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.num_embeddings_per_partition, dtype=self.params_dtype), requires_grad=False
            )
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embedding: VocabEmbedding) -> LMHead:
        """Share ``embedding``'s table (and its LinearMethod) instead of owning one.

        The head's own table parameters are dropped, so the checkpoint's ``lm_head.weight`` (if
        any) has nowhere to go and the loader skips it; ``self.weight`` is ``embedding.weight``.
        The embedding is looked up at each call, so the tie survives ``to_empty()``. A tied head
        has no LinearMethod of its own (``linear_method`` is ``None``).
        """
        if (embedding.num_embeddings, embedding.embedding_dim, embedding.tp_size) != (
            self.num_embeddings,
            self.embedding_dim,
            self.tp_size,
        ):
            raise ValueError(
                f"cannot tie LM head {self.num_embeddings}x{self.embedding_dim} (tp {self.tp_size}) to embedding "
                f"{embedding.num_embeddings}x{embedding.embedding_dim} (tp {embedding.tp_size})"
            )
        for name in [name for name in self._parameters if name != "bias"]:
            delattr(self, name)
        self.__dict__["tied_embedding"] = embedding
        self.linear_method = None  # the embedding's method applies (and post-processes the table once)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            tied = self.__dict__.get("tied_embedding")
            if tied is not None and name in tied._parameters:
                return getattr(tied, name)
            raise

    def forward(self, hidden: Tensor) -> Tensor:
        table = self.tied_embedding if self.tied_embedding is not None else self
        logits = table.linear_method.apply(table, hidden, self.bias)
        if self.tp_size > 1:
            logits = tensor_parallel_gather_to_rank0(logits, dim=-1)[..., : self.num_embeddings]
        return logits
