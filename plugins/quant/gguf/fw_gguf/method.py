"""The ``gguf`` quantization method: weight matrices kept as GGUF blocks, dequantized to multiply.

A fused layer (``qkv_proj``, ``gate_up_proj``) is loaded from several GGUF tensors that may have
different types (Q4_K_M files store ``attn_v`` as Q6_K beside Q4_K ``attn_q``), so every shard
keeps its own packed buffer and type::

    qkv_proj:  gguf_weight_0 [q rows, bytes(Q4_K)]   gguf_weight_1 [k rows, ...]   gguf_weight_2 [v rows, bytes(Q6_K)]

On CUDA the shards stay packed and ``apply`` runs the Triton kernels of :mod:`fw_gguf.kernels`
for bf16/fp16 activations: one launch per shard into its column slice of one output; fewer than
:data:`DEQUANTIZE_MIN_ROWS` rows multiply the packed blocks directly (a GEMV for one row — for
Q8_0 / Q4_K / Q6_K the integer one, which rounds x to int8 per 32 values as llama.cpp does —
tensor-core tiles for more; 2..``MMQ_MAX_ROWS`` rows of planar Q8_0 / Q4_K / Q6_K the int8 MMQ of
:mod:`fw_gguf.kernels.mmq`, x rounded the same way), more dequantize the shards into one matrix and
use cuBLAS (unless every shard takes the MMQ at that row count: then no dequantization). After
loading, a matrix layer's shards are regrouped into the kernels' planar layout (same bytes, same
size, ``fw_gguf.kernels.decode``; ``layer.gguf_planar`` says which); the token embedding keeps the
file's layout for its row lookups (a tied head multiplies it as it is). Other activation dtypes
dequantize in torch and multiply. A layer whose tensors are all F32/F16/BF16 in the file becomes a
dense matrix in the model dtype at load (cuBLAS; no larger than the file's for 16-bit models).

On the CPU the shards stay packed in the file's layout (RAM for weights = the file's size) when
every shard is of a type :mod:`fw_gguf.cpu`'s kernels decode (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K,
Q6_K) and the kernels could be built here; ``apply`` multiplies them in fp32 through those kernels.
Other layers (other types, no compiler, or ``FW_GGUF_CPU_PACKED=0``) are dequantized once after
loading (DESIGN §4's CPU fallback). ``FW_GGUF_KEEP_PACKED=1`` keeps every layer packed and
dequantizes in torch inside ``apply`` instead (the GPU's fallback path, for tests).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import gguf
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from framework.errors import ConfigError, ModelLoadError
from framework.layers.linear import set_weight_attrs
from framework.quantization import LinearMethod, QuantConfig, QuantMethodBase

from .cpu import cpu_packable, linear_cpu
from .dequant import as_quant_type, bytes_per_row, dequantize
from .kernels.layout import KERNEL_TYPES, from_planar, to_planar

_QKV_ORDER = {"q": 0, "k": 1, "v": 2}

#: What the packed layers compute in (the dequantized weights take the activations' dtype).
GGUF_ACT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
GGUF_DEVICE_TYPES = frozenset({"cpu", "cuda"})
#: From this many rows on, CUDA ``apply`` dequantizes the shards and calls cuBLAS instead of
#: multiplying the packed blocks (prefill-sized batches are compute-bound; cuBLAS's bf16 GEMM is
#: faster there than re-decoding each weight tile for every block of rows).
DEQUANTIZE_MIN_ROWS = 256
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


class GGUFQuantConfig(QuantConfig):
    """Knows the GGUF type of every weight matrix and expert stack (``tensor_types``: HF name -> type
    name), and which matrices keep their input columns in llama.cpp's tiled value-head order
    (``input_orders``: HF name -> ``[key heads, value heads, head width]``, ``fw_gguf.hybrid``)."""

    supported_act_dtypes = GGUF_ACT_DTYPES
    supported_device_types = GGUF_DEVICE_TYPES

    def __init__(self, tensor_types: dict[str, str], input_orders: dict[str, list[int]] | None = None) -> None:
        self.tensor_types = tensor_types
        self.input_orders = dict(input_orders or {})

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> GGUFQuantConfig:
        if "tensor_types" not in config:
            raise ValueError("gguf quantization config needs 'tensor_types' (it comes from the GGUF file itself)")
        return cls(dict(config["tensor_types"]), config.get("input_orders"))

    @classmethod
    def for_isq(cls, isq_type: str, model_config: Any, weight_shapes: dict[str, tuple[int, ...]]) -> GGUFQuantConfig:
        """``--isq q4_0 .. q6k``: the types :mod:`fw_gguf.isq`'s recipe gives each matrix."""
        from .isq import isq_quant_config

        return cls.from_config(isq_quant_config(isq_type, model_config, weight_shapes))

    def quantize_weight(self, name: str, weight: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """The packed GGUF rows of ``name`` (on ``weight``'s device), as a GGUF file would hold them."""
        qtype = self.tensor_types.get(name)
        if qtype is None:
            return None
        from .quantize import quantize

        return [(name, quantize(weight, GGMLQuantizationType[qtype]))]

    def save_isq_checkpoint(self, dst: Any, source: Any, weights: Any, isq_type: str) -> Any:
        """``fw quantize --isq``: write the quantized stream as a GGUF file llama.cpp loads (:mod:`fw_gguf.writer`)."""
        from pathlib import Path

        from .writer import write_gguf

        return write_gguf(Path(dst), source, weights, self.tensor_types, isq_type)

    def shard_types(self, prefix: str) -> list[tuple[Any, str]] | None:
        """``[(shard id, GGUF type)]`` of the checkpoint tensors behind layer ``prefix``, in output order."""
        if f"{prefix}.weight" in self.tensor_types:
            return [(None, self.tensor_types[f"{prefix}.weight"])]
        parent, _, leaf = prefix.rpartition(".")
        sources = [(source, shard) for source, (target, shard) in self.packed_modules_mapping.items() if target == leaf]
        names = [(shard, f"{parent}.{source}.weight") for source, shard in sources]
        if not names or any(name not in self.tensor_types for _, name in names):
            return None
        names.sort(key=lambda item: _QKV_ORDER.get(item[0], item[0]))
        return [(shard, self.tensor_types[name]) for shard, name in names]

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethodBase | None:
        """GGUFLinearMethod for a weight matrix the file holds, GGUFFusedMoEMethod for its expert
        stacks (kept packed where they run: see ``fw_gguf.moe``); None for anything else."""
        from framework.layers.attention import Attention
        from framework.layers.fused_moe import FusedMoE

        if isinstance(layer, FusedMoE):
            from .moe import gguf_moe_method

            return gguf_moe_method(self.tensor_types, layer, prefix)
        if isinstance(layer, Attention):  # GGUF files hold no KV-cache quantization
            return None
        shards = self.shard_types(prefix)
        return None if shards is None else GGUFLinearMethod(shards, self.input_orders.get(f"{prefix}.weight"))


class GGUFLinearMethod(LinearMethod):
    """Packed GGUF shards per layer; ``weight`` is a placeholder whose loader routes shards.

    ``input_order`` ``[Hk, Hv, width]``: the file's input columns are value heads in llama.cpp's
    tiled order (``fw_gguf.hybrid``); ``apply`` gathers ``x`` into that order first (a copy of the
    activations, not of the weight) and ``dequantize`` returns the model's order."""

    supported_act_dtypes = GGUF_ACT_DTYPES
    supported_device_types = GGUF_DEVICE_TYPES

    def __init__(self, shards: list[tuple[Any, str]], input_order: list[int] | None = None) -> None:
        self.shards = shards
        self.input_order = input_order

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        rows = output_partition_sizes if len(self.shards) > 1 else [sum(output_partition_sizes)]
        if len(rows) != len(self.shards):
            raise ModelLoadError(f"{layer.prefix}: {len(self.shards)} GGUF tensors for {len(rows)} output shards")
        layer.gguf_types = [as_quant_type(GGMLQuantizationType[qtype]) for _, qtype in self.shards]
        if getattr(layer, "tp_size", 1) > 1:
            check_shardable(layer, self.shards, layer.gguf_types)
            if self.input_order is not None:
                raise ConfigError(
                    f"{layer.prefix}: its input columns are in llama.cpp's tiled value-head order, "
                    "which tensor parallelism cannot split yet; run this model on one device"
                )
        layer.gguf_input_index = None  # set after loading, on the weights' device
        layer.gguf_rows = rows
        layer.gguf_in_features = input_size_per_partition
        for index, (qtype, num_rows) in enumerate(zip(layer.gguf_types, rows)):
            packed = torch.empty(num_rows, bytes_per_row(qtype, input_size_per_partition), dtype=torch.uint8)
            layer.register_buffer(f"gguf_weight_{index}", packed)
        layer.register_buffer("gguf_dense", None)
        layer.gguf_planar = [False] * len(rows)
        layer.gguf_groups = [(index, index + 1) for index in range(len(rows))]
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(placeholder, {"weight_loader": functools.partial(self.load_shard, layer)})
        layer.register_parameter("weight", placeholder)

    def load_shard(
        self, layer: nn.Module, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy one checkpoint tensor's packed rows into its shard buffer."""
        index = next((i for i, (shard, _) in enumerate(self.shards) if shard == shard_id), None)
        if index is None:
            raise ModelLoadError(f"{layer.prefix}: no GGUF shard {shard_id!r}; shards: {[s for s, _ in self.shards]}")
        target = getattr(layer, f"gguf_weight_{index}")
        if getattr(layer, "tp_size", 1) > 1:
            loaded_weight = rank_rows(layer, loaded_weight, shard_id, index)
        if loaded_weight.dtype != torch.uint8 or loaded_weight.shape != target.shape:
            raise ModelLoadError(
                f"{layer.prefix} shard {shard_id!r}: expected packed {layer.gguf_types[index].name} rows "
                f"{tuple(target.shape)}, got {loaded_weight.dtype} {tuple(loaded_weight.shape)}"
            )
        target.copy_(loaded_weight)

    def dequantized(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The full weight ``[out, in]`` in ``dtype`` (every shard dequantized and concatenated)."""
        if layer.gguf_dense is not None:
            return layer.gguf_dense
        parts = [
            dequantize(self.file_blocks(layer, i), qtype, (rows, layer.gguf_in_features), dtype)
            for i, (qtype, rows) in enumerate(zip(layer.gguf_types, layer.gguf_rows))
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        weight = self.dequantized(layer, layer.params_dtype)
        if self.input_order is None:
            return weight
        from .hybrid import untile_index

        return weight.index_select(1, untile_index(*self.input_order, device=weight.device))

    @staticmethod
    def file_blocks(layer: nn.Module, index: int) -> torch.Tensor:
        """Shard ``index``'s bytes in the GGUF file's block layout, ``[rows, bytes per row]`` (undoing
        the merge with its neighbours and the planar regrouping, where the GPU did them)."""
        start, end = next(group for group in layer.gguf_groups if group[0] <= index < group[1])
        packed = getattr(layer, f"gguf_weight_{start}")
        if layer.gguf_planar[index]:
            packed = from_planar(packed.reshape(-1), layer.gguf_types[index]).view(packed.shape)
        first = sum(layer.gguf_rows[start:index])
        return packed[first : first + layer.gguf_rows[index]]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        keep_packed = os.environ.get("FW_GGUF_KEEP_PACKED", "") not in ("", "0")
        device = layer.gguf_weight_0.device.type
        if self.input_order is not None:
            from .hybrid import tile_index

            layer.gguf_input_index = tile_index(*self.input_order, device=layer.gguf_weight_0.device)
        if device == "cuda" and not all(qtype in _FLOAT_TYPES for qtype in layer.gguf_types):
            from .kernels.gemv import reserve_counters  # before any CUDA-graph capture uses them

            self._to_kernel_layout(layer)
            reserve_counters(layer.gguf_weight_0.device)  # the first group's matrix is always at 0
            return
        # CPU (unless kept packed), and float tensors on CUDA: the file's F32/F16/BF16 values in
        # the model dtype, no larger than the file, for cuBLAS instead of a conversion per call
        if device == "cpu" and not keep_packed and _cpu_kernels_wanted() and cpu_packable(layer.gguf_types):
            layer.gguf_cpu_kernels = True
            layer.__dict__.pop("_gguf_cpu_plan", None)  # fw_gguf.cpu.shard_plan: rebuilt from these buffers
            return
        if device not in ("cpu", "cuda") or (device == "cpu" and keep_packed):
            return
        dense = self.dequantized(layer, layer.params_dtype)
        for index in range(len(self.shards)):
            delattr(layer, f"gguf_weight_{index}")
        layer.gguf_dense = dense

    @staticmethod
    def _to_kernel_layout(layer: nn.Module) -> None:
        """Merge neighbouring shards of one kernel type into one matrix (one launch for them) and
        regroup each matrix into the kernels' planar layout. The token embedding, which also looks
        rows up, keeps the file's layout::

            Q4_K_M qkv_proj:  [q Q4_K | k Q4_K | v Q6_K]  ->  gguf_weight_0 = planar(q ; k)   (gguf_weight_1 = None)
                                                              gguf_weight_2 = planar(v)
            gguf_groups = [(0, 2), (2, 3)]
        """
        from framework.layers.embedding import LMHead, VocabEmbedding

        if isinstance(layer, VocabEmbedding) and not isinstance(layer, LMHead):
            return
        types, groups = layer.gguf_types, []
        for index, qtype in enumerate(types):
            if groups and qtype in KERNEL_TYPES and types[groups[-1][0]] == qtype:
                groups[-1] = (groups[-1][0], index + 1)
            else:
                groups.append((index, index + 1))
        for start, end in groups:
            if types[start] not in KERNEL_TYPES:
                continue
            parts = [getattr(layer, f"gguf_weight_{index}") for index in range(start, end)]
            merged = parts[0] if len(parts) == 1 else torch.cat(parts)
            planar = to_planar(merged, types[start]).view(merged.shape)
            for index in range(start, end):
                setattr(layer, f"gguf_weight_{index}", None)
                layer.gguf_planar[index] = True
            setattr(layer, f"gguf_weight_{start}", planar)
        layer.gguf_groups = groups

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.gguf_input_index is not None:
            x = x.index_select(-1, layer.gguf_input_index)
        if layer.gguf_dense is None:
            if uses_kernels(layer, x):
                return linear_packed(layer, x, bias)
            if x.device.type == "cpu" and getattr(layer, "gguf_cpu_kernels", False):
                return linear_cpu(layer, x, bias)
        return F.linear(x, self.dequantized(layer, x.dtype), bias)

    def activation_group(self, layer: nn.Module, x: torch.Tensor) -> int | None:
        """32 where ``apply`` runs the integer GEMV (one row through the kernels on a Q8_0 / Q4_K /
        Q6_K group: :mod:`fw_gguf.kernels.gemv` rounds x to int8 per 32 values), else ``None``."""
        if layer.gguf_dense is not None or not uses_kernels(layer, x) or x.numel() != x.shape[-1]:
            return None
        from .kernels.gemv import gemv_supported

        k = layer.gguf_in_features
        for index, _, group_rows in _group_slices(layer):
            qtype = layer.gguf_types[index]
            if layer.gguf_planar[index] and gemv_supported(qtype, k, group_rows * k // gguf.GGML_QUANT_SIZES[qtype][0]):
                return 32
        return None

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the table: only the looked-up packed rows are dequantized."""
        if layer.gguf_dense is not None:
            return F.embedding(input_ids, layer.gguf_dense)
        rows = self.file_blocks(layer, 0).index_select(0, input_ids.reshape(-1))
        values = dequantize(rows, layer.gguf_types[0], (rows.shape[0], layer.gguf_in_features), layer.params_dtype)
        return values.view(*input_ids.shape, layer.gguf_in_features)


def _cpu_kernels_wanted() -> bool:
    """``FW_GGUF_CPU_PACKED=0`` dequantizes every CPU layer at load (the reference the packed path is tested against)."""
    return os.environ.get("FW_GGUF_CPU_PACKED", "1") not in ("0", "")


def uses_kernels(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``apply`` runs the Triton kernels: packed shards of kernel types on CUDA, bf16/fp16 ``x``."""
    return (
        x.device.type == "cuda"
        and x.dtype in _KERNEL_DTYPES
        and x.shape[-1] == layer.gguf_in_features
        and all(qtype in KERNEL_TYPES for qtype in layer.gguf_types)
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def linear_packed(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` through the kernels, ``W`` the layer's packed shards (any layout, any
    kernel type each): one launch per group of merged shards (``layer.gguf_groups``) into its
    column slice of one ``[..., N]`` output of x's dtype. Runs wherever the kernels run (CUDA, or
    the CPU under ``TRITON_INTERPRET=1``)."""
    from .kernels.matmul import gguf_dequantize, gguf_matmul  # Triton: imported only where kernels run

    k = layer.gguf_in_features
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    rows, n = x2d.shape[0], sum(layer.gguf_rows)
    if rows >= DEQUANTIZE_MIN_ROWS and not _all_mmq(layer, rows, k):
        weight = torch.empty(n, k, dtype=x.dtype, device=x.device)
        for index, start, group_rows in _group_slices(layer):
            gguf_dequantize(
                getattr(layer, f"gguf_weight_{index}"),
                layer.gguf_types[index],
                group_rows,
                k,
                x.dtype,
                planar=layer.gguf_planar[index],
                out=weight[start : start + group_rows],
            )
        return F.linear(x, weight, bias)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        for index, start, group_rows in _group_slices(layer):
            gguf_matmul(
                x2d,
                getattr(layer, f"gguf_weight_{index}"),
                layer.gguf_types[index],
                group_rows,
                k,
                planar=layer.gguf_planar[index],
                out=out[:, start : start + group_rows],
            )
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n)


def _all_mmq(layer: nn.Module, rows: int, k: int) -> bool:
    """Whether every shard group of ``layer`` multiplies ``rows`` rows on the int8 MMQ (then no dequantization)."""
    from .kernels.mmq import mmq_takes

    return all(
        mmq_takes(
            layer.gguf_types[index],
            rows,
            k,
            group_rows * k // gguf.GGML_QUANT_SIZES[layer.gguf_types[index]][0],
            layer.gguf_planar[index],
        )
        for index, _, group_rows in _group_slices(layer)
    )


def _group_slices(layer: nn.Module) -> list[tuple[int, int, int]]:
    """``[(buffer index, first output row, rows)]`` of the layer's groups of shards."""
    rows = layer.gguf_rows
    return [(start, sum(rows[:start]), sum(rows[start:end])) for start, end in layer.gguf_groups]


# --- tensor parallelism: this rank's packed rows / bytes ---------------------------------------
#
# A GGUF matrix is rows of whole quantization blocks, so a rank's output features are whole rows
# (column-parallel layers, the vocabulary) and its input features a byte range of every row
# (row-parallel layers: the per-rank width must be a whole number of blocks).


def check_shardable(layer: nn.Module, shards: list[tuple[Any, str]], qtypes: list[GGMLQuantizationType]) -> None:
    """Refuse, at start-up, a GGUF layer that cannot be split for tensor parallelism."""
    from framework.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    if isinstance(layer, MergedColumnParallelLinear | QKVParallelLinear) and len(shards) == 1:
        raise ConfigError(
            f"{layer.prefix}: a GGUF tensor holding several fused projections cannot be split for tensor "
            "parallelism yet; run this model on one device"
        )
    if isinstance(layer, RowParallelLinear):
        for qtype in qtypes:
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            if layer.input_size_per_partition % block:
                raise ConfigError(
                    f"{layer.prefix}: {layer.input_size_per_partition} input features per rank is not a "
                    f"whole number of {qtype.name} blocks of {block}; use a smaller tensor-parallel size"
                )


def rank_rows(layer: nn.Module, loaded: torch.Tensor, shard_id: Any, index: int) -> torch.Tensor:
    """This rank's part of the full packed GGUF tensor ``loaded`` (shard ``shard_id``, buffer ``index``)."""
    from framework.layers.embedding import VocabEmbedding
    from framework.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    rank, rows = layer.tp_rank, layer.gguf_rows[index]
    if isinstance(layer, RowParallelLinear):
        width = bytes_per_row(layer.gguf_types[index], layer.input_size_per_partition)
        return loaded[:, rank * width : (rank + 1) * width]
    if isinstance(layer, VocabEmbedding):  # padded vocabulary: missing rows are zero bytes (dequantize to 0)
        part = loaded[rank * rows : (rank + 1) * rows]
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])])
        return part
    if isinstance(layer, QKVParallelLinear) and shard_id in ("k", "v"):
        source = layer.kv_shard_rank
        return loaded[source * rows : (source + 1) * rows]
    if isinstance(layer, ColumnParallelLinear):
        return loaded[rank * rows : (rank + 1) * rows]
    return loaded  # replicated
