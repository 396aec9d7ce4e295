"""Which quantization method an engine runs, and its config: the checkpoint's, ``--quantization``'s or ``--isq``'s.

The ``resolve_quantization_method`` hook names the method from the checkpoint's
``quantization_config`` and the requested one (first non-``None`` answer wins; ``None`` means an
unquantized model). A requested method the checkpoint does not declare is refused before any
weight is read, and so is a method whose plugin reports it cannot run on this platform.
"""

from __future__ import annotations

import torch

from framework import isq, plugins, registries
from framework.config import ModelConfig
from framework.errors import ConfigError
from framework.loader.format import WeightFormat
from framework.platform import Platform
from framework.quantization import QuantConfig, build_quant_config


def resolve_quant_config(
    source: WeightFormat,
    config: ModelConfig,
    requested: str | None,
    platform: Platform,
    device: torch.device,
    model_cls: type[torch.nn.Module],
    isq_type: str | None = None,
) -> QuantConfig | None:
    """The quantization config to build ``model_cls`` with (``None``: unquantized), verified for
    ``config``'s dtype and ``device``, its ``packed_modules_mapping`` taken from ``model_cls``.
    With ``isq_type`` (``--isq``): the config of the method offering it (:mod:`framework.isq`).

    Raises :class:`ConfigError` when ``requested`` disagrees with the checkpoint's method, or the
    method cannot run on ``platform`` (the message lists the reasons)."""
    if isq_type is not None:
        quant_config = isq.build_isq_config(isq_type, source, config, device, config.source)
        quant_config.packed_modules_mapping = dict(getattr(model_cls, "packed_modules_mapping", {}))
        return quant_config
    checkpoint = source.quantization_config()
    declared = (checkpoint or {}).get("quant_method")
    if requested is not None and declared is not None and declared != requested:
        raise ConfigError(
            f"--quantization {requested} disagrees with the checkpoint {config.source}, "
            f"which is quantized with {declared!r}: leave --quantization out (the checkpoint's "
            f"method is used) or give --quantization {declared}"
        )
    name = plugins.call_first(
        "resolve_quantization_method",
        model_config=config,
        quantization_config=checkpoint,
        requested=requested,
        platform=platform,
    )
    if name is None:
        return None
    spec = registries.quantization_methods(platform).get(name)
    reasons = spec.unavailable_reasons(platform)
    if reasons:
        raise ConfigError(f"quantization method {name!r} cannot run here: {'; '.join(reasons)}")
    quant_config = build_quant_config(spec.load(), checkpoint or {}, config, device)
    quant_config.packed_modules_mapping = dict(getattr(model_cls, "packed_modules_mapping", {}))
    return quant_config
