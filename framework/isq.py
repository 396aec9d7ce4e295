"""In-situ quantization (``--isq TYPE``): a 16-bit checkpoint becomes a quantized model at load.

A quantization plugin offers ISQ types by listing them in its ``QuantMethodSpec.isq_types``; the
core maps each ``--isq`` name to the one method that offers it (:func:`isq_methods`) and refuses
an unknown name listing the valid ones. The method's ``QuantConfig`` implements two calls:

* ``QuantConfig.for_isq(isq_type, model_config, weight_shapes)`` (classmethod): the config that
  the model is built with, as if the checkpoint had been quantized with it. ``weight_shapes`` maps
  every checkpoint tensor name to its shape, so a recipe can choose per tensor (llama.cpp's Q4_K_M
  keeps the head and some ``v``/``down`` projections at 6 bits) before any weight is read.
* ``quant_config.quantize_weight(name, tensor)``: ``None`` to keep the tensor as it is, else the
  ``[(name, tensor)]`` a pre-quantized checkpoint of this format holds instead (GGUF: packed rows
  under the same name; GPTQ: ``qweight``/``qzeros``/``scales``; FP8: ``weight`` + ``weight_scale_inv``).
* optionally ``quant_config.save_isq_checkpoint(dst, source, weights, isq_type)``: write the
  quantized stream as a file of the format (GGUF: ``fw quantize --isq q4k SRC out.gguf``), used by
  :func:`export_checkpoint`.

:func:`quantize_stream` wraps the checkpoint's weight stream: each tensor is moved to the device,
quantized there the moment it is read and dropped, so the layers' ordinary weight loaders see a
quantized checkpoint and peak memory is the quantized model plus one 16-bit tensor (never the
16-bit model). Each checkpoint tensor is quantized on its own: a fused layer (``qkv_proj``) gets
its shards one by one, as it does from a pre-quantized file, so nothing is staged in 16 bits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from framework import registries
from framework.errors import ConfigError, UnknownNameError
from framework.loader.checkpoint_slice import materialize

if TYPE_CHECKING:
    from framework.config import ModelConfig
    from framework.loader.format import WeightFormat
    from framework.quantization import QuantConfig
    from framework.specs import QuantMethodSpec

log = logging.getLogger("fw.isq")


def isq_methods(platform: Any = None) -> dict[str, QuantMethodSpec]:
    """Every ``--isq`` name the installed plugins offer -> the quantization method offering it."""
    offered: dict[str, QuantMethodSpec] = {}
    for spec in registries.quantization_methods(platform):
        for isq_type in spec.isq_types:
            if isq_type in offered:
                raise ConfigError(
                    f"--isq {isq_type} is offered by two quantization methods, {offered[isq_type].name!r} "
                    f"and {spec.name!r}; disable one of their plugins (FW_DISABLE_PLUGINS)"
                )
            offered[isq_type] = spec
    return offered


def isq_method(isq_type: str, platform: Any = None) -> QuantMethodSpec:
    """The method offering ``isq_type``; an unknown name raises :class:`UnknownNameError` listing the valid ones."""
    offered = isq_methods(platform)
    if isq_type not in offered:
        valid = ", ".join(offered) or "(none: install a quantization plugin that offers ISQ, e.g. fw-gguf)"
        raise UnknownNameError(f"--isq: unknown in-situ quantization type {isq_type!r}; valid: {valid}")
    return offered[isq_type]


def refuse_quantized_source(source: WeightFormat, isq_type: str, where: str) -> None:
    """``--isq`` quantizes 16/32-bit weights; a checkpoint that is quantized already is an error naming its format."""
    declared = source.quantization_config()
    if declared:
        fmt = declared.get("quant_method", "an unnamed format")
        raise ConfigError(
            f"--isq {isq_type}: {where} is already quantized ({fmt}); --isq needs a bf16/fp16/fp32 checkpoint "
            f"(load this one without --isq)"
        )


def build_isq_config(
    isq_type: str, source: WeightFormat, model_config: ModelConfig, device: torch.device, where: str
) -> QuantConfig:
    """The ``QuantConfig`` that ``--isq isq_type`` builds ``source``'s model with, verified for ``device``."""
    refuse_quantized_source(source, isq_type, where)
    spec = isq_method(isq_type)
    config_cls = spec.load()
    quant_config = config_cls.for_isq(isq_type, model_config, source.weight_shapes())
    quant_config.verify(model_config, device)
    return quant_config


@dataclass(slots=True)
class IsqReport:
    """What :func:`quantize_stream` did: tensors quantized, their bytes before and after, seconds spent."""

    isq_type: str
    num_quantized: int = 0
    source_bytes: int = 0
    quantized_bytes: int = 0
    seconds: float = 0.0
    types: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        return (
            f"--isq {self.isq_type}: quantized {self.num_quantized} tensors "
            f"({self.source_bytes / 2**20:.1f} MiB -> {self.quantized_bytes / 2**20:.1f} MiB) in {self.seconds:.2f} s"
        )


def quantize_stream(
    weights: Iterable[tuple[str, Any]], quant_config: QuantConfig, device: torch.device, report: IsqReport
) -> Iterator[tuple[str, Any]]:
    """``weights`` with every tensor ``quant_config`` quantizes replaced by its quantized tensors,
    computed on ``device``; ``report`` is filled in as the stream is consumed."""
    for name, tensor in weights:
        if not _is_candidate(tensor):
            yield name, tensor
            continue
        start = time.perf_counter()
        dense = materialize(tensor).to(device)
        quantized = quant_config.quantize_weight(name, dense)
        if quantized is None:
            yield name, dense
            continue
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        report.seconds += time.perf_counter() - start
        report.num_quantized += 1
        report.source_bytes += dense.numel() * dense.element_size()
        del dense
        for out_name, out in quantized:
            report.quantized_bytes += out.numel() * out.element_size()
            yield out_name, out


def _is_candidate(tensor: Any) -> bool:
    """Matrices of floats: what a quantizer may take (norms, biases and integer tensors pass through)."""
    shape = getattr(tensor, "shape", ())
    dtype = getattr(tensor, "dtype", None)
    return len(shape) == 2 and (dtype is None or dtype.is_floating_point)


def export_checkpoint(src: str, dst: str, isq_type: str, device: str | None = None) -> tuple[Any, IsqReport]:
    """``fw quantize --isq TYPE SRC DST``: quantize ``src`` tensor by tensor (on ``device``, default
    CUDA where available) and let the method offering ``isq_type`` write ``dst``; returns what it
    wrote and the report."""
    from pathlib import Path

    from framework import plugins
    from framework.config import ModelConfig
    from framework.loader.model_loader import open_model_source, with_progress

    plugins.load_plugins()
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    source = open_model_source(Path(src))
    model_config = ModelConfig.from_hf_config(source.hf_config(), dtype=torch.bfloat16, source=str(src))
    quant_config = build_isq_config(isq_type, source, model_config, target, str(src))
    save = getattr(quant_config, "save_isq_checkpoint", None)
    if save is None:
        raise ConfigError(
            f"--isq {isq_type} quantizes at load only; fw quantize --isq writes files for: "
            f"{', '.join(n for n, s in isq_methods().items() if hasattr(s.load(), 'save_isq_checkpoint'))}"
        )
    report = IsqReport(isq_type)
    start = time.perf_counter()
    weights = quantize_stream(source.iter_weights(), quant_config, target, report)
    written = save(dst, source, with_progress(weights, source.num_weights(), f"Quantizing ({isq_type})"), isq_type)
    report.seconds = time.perf_counter() - start
    return written, report
