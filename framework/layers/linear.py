"""Linear layers (Megatron tensor-parallel) that delegate storage and matmul to a LinearMethod.

Every layer owns a :class:`LinearMethod`: :class:`UnquantizedLinearMethod` by default, or the
one the model's ``QuantConfig`` returns for the layer's prefix. The method creates the weight
parameters; the layer knows how checkpoint tensors map onto them. Each parameter carries:

* ``weight_loader(param, loaded_weight, shard_id=None)``: copies a checkpoint tensor (the full,
  unsharded tensor) into this rank's part of the parameter;
* ``output_dim`` / ``input_dim``: which parameter dimension runs along output features / input
  features (``None`` or absent: the parameter is not split along it, e.g. a per-tensor scale);
* ``per_shard=True`` (optional): the parameter holds one entry per fused shard along dim 0
  (``output_partition_sizes`` order: a per-tensor scale of each of q, k, v or of gate, up); the
  loader fills entry ``i`` from shard ``i``'s checkpoint tensor instead of the whole parameter.

Loaders work on parameter rows, whatever a row holds: a quantized method may pack several
output features per row (its parameter then has proportionally fewer rows) and the offsets scale
with it. The model's loader calls ``getattr(param, "weight_loader", default)`` for each
checkpoint tensor, then ``finish_loading`` calls ``process_weights_after_loading(layer)`` of every
module's quant method (``linear_method`` here) once.

Tensor parallelism (``tp_size`` ranks, this one ``tp_rank``; both default to this process's
tensor-parallel group, see :mod:`framework.distributed`, so model code never passes them)::

    ColumnParallelLinear   W [out, in] split by rows:    rank r holds W[r*out/tp:(r+1)*out/tp]
    RowParallelLinear      W [out, in] split by columns: rank r holds W[:, r*in/tp:(r+1)*in/tp]
                           and the partial outputs are summed (all-reduce)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from framework import distributed
from framework.distributed.partition import attention_heads_per_rank
from framework.kernels import get_kernel
from framework.loader.checkpoint_slice import materialize
from framework.quantization import LinearMethod, quant_method_for

if TYPE_CHECKING:
    from framework.quantization import QuantConfig


def set_weight_attrs(param: Tensor, attrs: dict[str, Any]) -> None:
    """Attach loader attributes (``weight_loader``, ``output_dim``, ...) to ``param``."""
    for key, value in attrs.items():
        setattr(param, key, value)


class KeepsWeightAttrs(nn.Module):
    """A module whose parameters keep their loader attributes through ``to()`` / ``to_empty()``.

    Materialising a ``meta`` model with ``to_empty`` replaces each Parameter object and drops
    attributes set on it; this copies them onto the replacements.
    """

    def _apply(self, fn: Any, recurse: bool = True) -> KeepsWeightAttrs:
        attrs = {name: dict(vars(param)) for name, param in self._parameters.items() if param is not None}
        super()._apply(fn, recurse)
        for name, extra in attrs.items():
            param = self._parameters.get(name)
            if param is not None:
                set_weight_attrs(param, extra)
        return self


class UnquantizedLinearMethod(LinearMethod):
    """A plain ``[out, in]`` weight in ``params_dtype``, multiplied by the kernel registry's ``linear``
    op (``F.linear`` unless a plugin's implementation is chosen), resolved once in :meth:`create_weights`
    (inside the layer's construction, so :func:`framework.kernels.kernels_for` and ``FW_KERNELS`` apply)."""

    #: The matmul; :meth:`create_weights` replaces it with the registry's choice. A subclass whose
    #: own ``create_weights`` does not call this one keeps ``F.linear``.
    linear = staticmethod(F.linear)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        shape = (sum(output_partition_sizes), input_size_per_partition)
        weight = nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": layer.weight_loader})
        layer.register_parameter("weight", weight)
        self.linear = get_kernel("linear")

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        return self.linear(x, layer.weight, bias)

    def dequantize(self, layer: nn.Module) -> Tensor:
        return layer.weight

    def embedding(self, layer: nn.Module, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, layer.weight)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator // denominator``, refusing a remainder (tensor-parallel shards must be equal)."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def copy_weight(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` with a readable error when a checkpoint tensor has the wrong shape.

    ``src`` may be a lazy :class:`~framework.loader.checkpoint_slice.CheckpointSlice` (tensor
    parallelism, GGUF expert stacks): only the selected block is read from the file, here, and
    decoded (if it needs decoding) straight into ``dst``'s dtype and device.
    """
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(src.shape)} does not fit parameter (shard) of shape {tuple(dst.shape)}"
        )
    dst.copy_(materialize(src, like=dst))


def load_column_shard(param: Tensor, loaded_weight: Tensor, tp_rank: int, *, zero_padding: bool = False) -> None:
    """Copy rank ``tp_rank``'s rows (along ``param.output_dim``) of the full ``loaded_weight``.

    ``zero_padding``: ``loaded_weight`` may end before this rank's last row (a vocabulary padded
    to a multiple of the tensor-parallel size); the rows past its end are zero.
    """
    output_dim = getattr(param, "output_dim", None)
    if output_dim is None:
        copy_weight(param.data, loaded_weight)
        return
    rows = param.size(output_dim)
    start = tp_rank * rows
    present = max(0, min(rows, loaded_weight.size(output_dim) - start)) if zero_padding else rows
    if present < rows:
        param.data.narrow(output_dim, present, rows - present).zero_()
    if present:
        copy_weight(param.data.narrow(output_dim, 0, present), loaded_weight.narrow(output_dim, start, present))


def is_per_shard(param: Tensor) -> bool:
    """Whether ``param`` keeps one entry per fused shard along dim 0 (``per_shard=True``)."""
    return bool(getattr(param, "per_shard", False))


def load_shard_entry(param: Tensor, loaded_weight: Tensor, index: int) -> None:
    """Copy shard ``index``'s checkpoint tensor into entry ``index`` (dim 0) of a ``per_shard`` parameter."""
    if not 0 <= index < param.size(0):
        raise ValueError(f"shard {index} has no entry in a per-shard parameter of shape {tuple(param.shape)}")
    target = param.data[index]
    loaded_weight = materialize(loaded_weight)
    if loaded_weight.numel() == target.numel():
        loaded_weight = loaded_weight.reshape(target.shape)
    copy_weight(target, loaded_weight)


def tensor_parallel_all_reduce(x: Tensor) -> Tensor:
    """Sum ``x`` over the tensor-parallel ranks; use the returned tensor (a new one with ``--all-reduce symm_mem``)."""
    return distributed.all_reduce(x)


def tensor_parallel_gather_to_rank0(x: Tensor, dim: int = -1) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` on rank 0; the other ranks get their own ``x`` back."""
    return distributed.gather_to_rank0(x, dim)


def resolve_tp(tp_size: int | None, tp_rank: int | None) -> tuple[int, int]:
    """``(tp_size, tp_rank)``: the given values, or this process's tensor-parallel group's (1, 0 without one)."""
    return (
        distributed.get_tp_size() if tp_size is None else tp_size,
        distributed.get_tp_rank() if tp_rank is None else tp_rank,
    )


class LinearBase(KeepsWeightAttrs):
    """Shared construction: sizes, the LinearMethod, its weights and an optional bias.

    Sets, before asking the QuantConfig: ``input_size``, ``output_size`` (unsharded),
    ``input_size_per_partition``, ``output_partition_sizes``, ``output_size_per_partition``,
    ``tp_size``, ``tp_rank``, ``prefix``, ``params_dtype``. The bias has this rank's
    ``output_size_per_partition`` entries and ``output_dim=0``.
    """

    #: Its loaders only narrow and copy, so they take lazy checkpoint slices (model_loader).
    reads_checkpoint_slices = True

    def __init__(
        self,
        input_size: int,
        output_size: int,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        bias: bool,
        quant_config: QuantConfig | None,
        prefix: str,
        params_dtype: torch.dtype | None,
        tp_size: int,
        tp_rank: int,
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = list(output_partition_sizes)
        self.output_size_per_partition = sum(output_partition_sizes)
        self.tp_size, self.tp_rank, self.prefix = tp_size, tp_rank, prefix
        self.params_dtype = params_dtype or torch.get_default_dtype()
        method = quant_method_for(quant_config, self, prefix, LinearMethod, "a linear layer")
        self.linear_method: LinearMethod = method or UnquantizedLinearMethod()
        self.linear_method.create_weights(
            self, input_size_per_partition, self.output_partition_sizes, input_size, output_size, self.params_dtype
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_partition, dtype=self.params_dtype), requires_grad=False
            )
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        """Copy the full checkpoint tensor ``loaded_weight`` (shard ``shard_id`` of a fused layer)
        into this rank's part of ``param``."""
        raise NotImplementedError

    @property
    def quant_method(self) -> LinearMethod:
        """The layer's LinearMethod (the name every quantized layer kind shares)."""
        return self.linear_method

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, bias={self.bias is not None}, "
            f"tp={self.tp_rank}/{self.tp_size}, method={type(self.linear_method).__name__}"
        )


class ReplicatedLinear(LinearBase):
    """The full weight on every rank (small projections, routers); ``tp_size`` / ``tp_rank`` are
    recorded but split nothing."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        tp_size, tp_rank = resolve_tp(tp_size, tp_rank)
        super().__init__(
            input_size,
            output_size,
            input_size,
            [output_size],
            bias,
            quant_config,
            prefix,
            params_dtype,
            tp_size,
            tp_rank,
        )

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        if is_per_shard(param):
            load_shard_entry(param, loaded_weight, 0)
            return
        copy_weight(param.data, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is its slice (no communication)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        *,
        output_partition_sizes: list[int] | None = None,
    ) -> None:
        tp_size, tp_rank = resolve_tp(tp_size, tp_rank)
        partitions = output_partition_sizes or [divide(output_size, tp_size, "output size")]
        super().__init__(
            input_size, output_size, input_size, partitions, bias, quant_config, prefix, params_dtype, tp_size, tp_rank
        )

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        if is_per_shard(param):
            load_shard_entry(param, loaded_weight, 0)
            return
        load_column_shard(param, loaded_weight, self.tp_rank)

    def _param_rows(self, param: Tensor, num_features: int) -> int:
        """Rows of ``param`` that hold ``num_features`` output features (packing scales them)."""
        rows, remainder = divmod(num_features * param.size(param.output_dim), self.output_size_per_partition)
        assert remainder == 0, f"{num_features} features do not map to whole rows of {tuple(param.shape)}"
        return rows

    def _load_fused_shard(
        self, param: Tensor, loaded_weight: Tensor, shard_index: int, offset: int, size: int, source_index: int
    ) -> None:
        """Copy part ``source_index`` (of ``size`` features per rank) of fused shard ``shard_index``'s
        full checkpoint tensor into this rank's parameter rows starting at feature ``offset``::

            param rows:  [ shard 0 | shard 1 | ... ]     loaded rows: [ rank 0 | rank 1 | ... ]
                                   ^ offset, size                              ^ source_index * size

        A ``per_shard`` parameter gets the tensor in its entry ``shard_index`` instead.
        """
        if is_per_shard(param):
            load_shard_entry(param, loaded_weight, shard_index)
            return
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:  # not split by output (a per-tensor quantity): same on every shard
            self._load_shared(param, loaded_weight, shard_index)
            return
        offset, size = self._param_rows(param, offset), self._param_rows(param, size)
        copy_weight(
            param.data.narrow(output_dim, offset, size), loaded_weight.narrow(output_dim, source_index * size, size)
        )

    def _load_shared(self, param: Tensor, loaded_weight: Tensor, shard_index: int) -> None:
        """Load a quantity every shard shares; refuse shards that disagree on it (a per-shard
        quantity needs ``per_shard=True``, or the last shard's value would silently win)."""
        loaded_weight = materialize(loaded_weight)
        filled = self.__dict__.setdefault("_shared_params_loaded", set())
        if id(param) in filled and not torch.equal(param.data, loaded_weight.to(param.data)):
            raise ValueError(
                f"{self.prefix}: shard {shard_index} holds a different value for a parameter of shape "
                f"{tuple(param.shape)} that all shards share (it has neither output_dim nor "
                "per_shard=True); a quantity kept per shard needs per_shard=True"
            )
        copy_weight(param.data, loaded_weight)
        filled.add(id(param))

    def _split_fused(self, param: Tensor, loaded_weight: Tensor, shard_ids: list[Any], sizes: list[int]) -> None:
        """Load a checkpoint tensor that already holds every shard, concatenated (Phi-3's qkv_proj)."""
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            copy_weight(param.data, loaded_weight)
            return
        offset = 0
        for shard_id, size in zip(shard_ids, sizes, strict=True):
            rows = size * loaded_weight.size(output_dim) // sum(sizes)
            self.weight_loader(param, loaded_weight.narrow(output_dim, offset, rows), shard_id)
            offset += rows


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (``gate_up_proj``: gate=0, up=1)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        tp_size, tp_rank = resolve_tp(tp_size, tp_rank)
        self.output_sizes = list(output_sizes)
        partitions = [divide(size, tp_size, "output size") for size in output_sizes]
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            quant_config,
            prefix,
            params_dtype,
            tp_size,
            tp_rank,
            output_partition_sizes=partitions,
        )

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: int | None = None) -> None:
        """``shard_id`` is the index into ``output_sizes``; ``None`` means all shards, concatenated."""
        if shard_id is None:
            self._split_fused(param, loaded_weight, list(range(len(self.output_sizes))), self.output_sizes)
            return
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id {shard_id!r} out of range; valid: 0..{len(self.output_sizes) - 1}")
        offset = sum(self.output_partition_sizes[:shard_id])
        self._load_fused_shard(
            param, loaded_weight, shard_id, offset, self.output_partition_sizes[shard_id], self.tp_rank
        )


class QKVParallelLinear(ColumnParallelLinear):
    """The fused query/key/value projection, split by heads across ranks.

    Rank r holds query heads ``[r*H/tp, (r+1)*H/tp)`` and their key/value heads; when there are
    fewer KV heads than ranks, each KV head is replicated on ``tp_size / total_num_kv_heads``
    consecutive ranks. Output layout per rank: ``[q | k | v]``. ``num_heads`` / ``num_kv_heads``
    are this rank's counts (:func:`framework.distributed.partition.attention_heads_per_rank`).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        tp_size, tp_rank = resolve_tp(tp_size, tp_rank)
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size, self.total_num_heads, self.total_num_kv_heads = head_size, total_num_heads, total_num_kv_heads
        # this rank's heads: models read qkv_proj.num_heads / num_kv_heads for their Attention layer
        self.num_heads, self.num_kv_heads, self.num_kv_head_replicas = attention_heads_per_rank(
            total_num_heads, total_num_kv_heads, tp_size
        )
        q_size, kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        super().__init__(
            hidden_size,
            (total_num_heads + 2 * total_num_kv_heads) * head_size,
            bias,
            quant_config,
            prefix,
            params_dtype,
            tp_size,
            tp_rank,
            output_partition_sizes=[q_size, kv_size, kv_size],
        )

    @property
    def kv_shard_rank(self) -> int:
        """Which of the ``total_num_kv_heads / num_kv_heads`` K/V shards this rank holds."""
        return self.tp_rank // self.num_kv_head_replicas

    @property
    def first_kv_head(self) -> int:
        """The index (among all KV heads) of this rank's first KV head."""
        return self.kv_shard_rank * self.num_kv_heads

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: str | None = None) -> None:
        """``shard_id`` is ``"q"``, ``"k"`` or ``"v"``; ``None`` means ``[q | k | v]`` concatenated."""
        q_size, kv_size, _ = self.output_partition_sizes
        kv_source = self.kv_shard_rank
        shards = {
            "q": (0, 0, q_size, self.tp_rank),
            "k": (1, q_size, kv_size, kv_source),
            "v": (2, q_size + kv_size, kv_size, kv_source),
        }
        if shard_id is None:
            total_q, total_kv = self.total_num_heads * self.head_size, self.total_num_kv_heads * self.head_size
            self._split_fused(param, loaded_weight, ["q", "k", "v"], [total_q, total_kv, total_kv])
            return
        if shard_id not in shards:
            raise ValueError(f"unknown QKV shard_id {shard_id!r}; valid: 'q', 'k', 'v'")
        self._load_fused_shard(param, loaded_weight, *shards[shard_id])


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed over ranks.

    The input is expected already split (it is the output of a column-parallel layer). The
    bias is added once: by rank 0, inside the matmul, before the all-reduce (the same sum as
    adding it after). ``reduce_results=False`` leaves the sum to the caller (fused MoE).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        *,
        reduce_results: bool = True,
    ) -> None:
        tp_size, tp_rank = resolve_tp(tp_size, tp_rank)
        self.reduce_results = reduce_results
        input_size_per_partition = divide(input_size, tp_size, "input size")
        super().__init__(
            input_size,
            output_size,
            input_size_per_partition,
            [output_size],
            bias,
            quant_config,
            prefix,
            params_dtype,
            tp_size,
            tp_rank,
        )

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        if is_per_shard(param):
            load_shard_entry(param, loaded_weight, 0)
            return
        input_dim = getattr(param, "input_dim", None)
        if input_dim is not None:
            columns = param.size(input_dim)
            loaded_weight = loaded_weight.narrow(input_dim, self.tp_rank * columns, columns)
        copy_weight(param.data, loaded_weight)

    def forward(self, x: Tensor) -> Tensor:
        output = self.linear_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1 and self.reduce_results:
            output = tensor_parallel_all_reduce(output)
        return output
