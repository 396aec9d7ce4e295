"""From a model name to a loaded model: open the weight source, read its config, load its weights.

The three steps :class:`~framework.engine.builder.EngineBuilder` runs in order:

- :func:`open_source`: ``--m`` / ``--w`` / ``--f`` resolved to a local path (downloading when it
  names a Hub repo) and opened as the weight format ``--load-format`` names (or the detected one);
- :func:`read_model_config`: the :class:`ModelConfig` (the architecture's config defaults filled
  in, dtype settled for the device, the context length, every end-of-sequence id the checkpoint,
  generation config and tokenizer declare), with the tokenizer and generation config that came
  with it;
- :func:`load_model`: the architecture built on the device and every checkpoint tensor loaded
  into it. On failure nothing stays half-loaded: :func:`release_device_memory` returns what the
  partial model held before the error propagates.
"""

from __future__ import annotations

import gc
import json
import logging
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import torch

from framework import isq, plugins, registries
from framework.config import ModelConfig, resolve_dtype, with_yarn_scaling
from framework.engine.args import EngineArgs
from framework.errors import ConfigError, ModelLoadError
from framework.loader import model_loader
from framework.loader.format import WeightFormat
from framework.loader.source import hub_projector, is_hub_repo, resolve_local_path, resolve_projector_path
from framework.multimodal.inputs import VisionSpec
from framework.platform import Platform, platform_for_device
from framework.quantization import QuantConfig, verify_quant_methods
from framework.tokenizer import Tokenizer

log = logging.getLogger("fw.engine")


class OpenedSource(NamedTuple):
    path: str
    source: WeightFormat


class ModelSetup(NamedTuple):
    """What a checkpoint declares besides its weights."""

    config: ModelConfig
    tokenizer: Tokenizer
    generation_config: dict[str, Any]


def open_source(args: EngineArgs) -> OpenedSource:
    """Load the plugins, resolve ``args``'s model to a local path and open its weight format.

    A format that takes a vision projector (a GGUF's ``use_projector``) gets ``--mmproj``'s
    (``none``: serve the text model); without the flag, one that ``wants_projector`` (a vision
    GGUF with none beside it) from a Hub repo gets the projector of the model's repo folder."""
    plugins.load_plugins()
    path = resolve_local_path(args.model, args.weights, args.file, args.revision)
    source = model_loader.open_model_source(Path(path), args.file, args.load_format)
    use_projector = getattr(source, "use_projector", None)
    if args.mmproj is not None and use_projector is None:
        raise ConfigError(
            f"--mmproj names a llama.cpp vision projector for a GGUF model; this model's weights are {source.name}"
        )
    if args.mmproj == "none":
        use_projector(None, "file, and --mmproj none turned it off")
    elif args.mmproj is not None:
        use_projector(resolve_projector_path(args.mmproj, args.model, args.revision))
    elif getattr(source, "wants_projector", False) and is_hub_repo(args.model) and not args.weights:
        # a vision GGUF from the Hub with no projector beside it: its repo folder's, on demand
        projector = hub_projector(args.model, source.files[0], args.revision)
        use_projector(
            projector,
            None
            if projector
            else f"file, and fw found none beside {source.files[0].name} in the Hub repo {args.model} "
            "(name one with --mmproj PATH)",
        )
    return OpenedSource(path, source)


def with_config_defaults(hf_config: dict[str, Any], platform: Platform) -> dict[str, Any]:
    """``hf_config`` with its registered architecture's ``ModelSpec.config_defaults`` filled in
    where absent: inside ``text_config`` when the config has one, else at the top level. A config
    of an unregistered architecture comes back unchanged (building it fails later, naming it)."""
    archs = hf_config.get("architectures") or []
    registry = registries.model_architectures(platform)
    if not archs or archs[0] not in registry or not registry.get(archs[0]).config_defaults:
        return hf_config
    defaults = dict(registry.get(archs[0]).config_defaults)
    if isinstance(hf_config.get("text_config"), dict):
        return {**hf_config, "text_config": {**defaults, **hf_config["text_config"]}}
    return {**defaults, **hf_config}


def read_model_config(source: WeightFormat, args: EngineArgs, device: torch.device, source_path: str) -> ModelSetup:
    """The model's config for ``device`` (``--dtype``, ``--max-model-len``, ``--yarn-scaling-factor``
    applied), its tokenizer and generation config. ``eos_token_ids`` is the union of the ids the
    generation config, the model config and the tokenizer name."""
    hf_config = with_config_defaults(source.hf_config(), platform_for_device(device.type))
    if args.yarn_scaling_factor:
        hf_config = with_yarn_scaling(hf_config, args.yarn_scaling_factor)
    generation = source.generation_config()
    tokenizer = source.tokenizer()
    eos = set(_as_list(generation.get("eos_token_id"))) | set(_as_list(hf_config.get("eos_token_id")))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    eos |= tokenizer.extra_eos_token_ids
    dtype = resolve_dtype(args.dtype, device, hf_config.get("torch_dtype") or hf_config.get("dtype"))
    config = ModelConfig.from_hf_config(
        hf_config,
        dtype=dtype,
        max_model_len=args.max_model_len,
        eos_token_ids=frozenset(eos),
        source=str(args.model or args.weights or source_path),
    )
    return ModelSetup(config, tokenizer, generation)


def load_model(
    model_cls: type[torch.nn.Module],
    config: ModelConfig,
    quant_config: QuantConfig | None,
    source: WeightFormat,
    device: torch.device,
    seed: int,
    isq_report: isq.IsqReport | None = None,
) -> torch.nn.Module:
    """Build ``model_cls`` on ``device`` (seeded with ``seed``) and stream ``source``'s weights in; the
    model in eval mode. Every parameter must be loaded (else :class:`ModelLoadError`, naming the
    model); on any failure the partial model's device memory is returned before the error is raised.
    With ``isq_report`` (``--isq``) each matrix is quantized on ``device`` as it streams in
    (:func:`framework.isq.quantize_stream`) and the report filled in."""
    torch.manual_seed(seed)
    model = model_loader.build_model(model_cls, config, quant_config, device)
    if quant_config is not None:
        verify_quant_methods(model, config.dtype, device)
    if source.name == "dummy":
        source.device = device  # each rank draws the (identical, seeded) tensors on its own device
    weights = source.iter_weights()
    label = "Loading weights"
    if isq_report is not None:
        weights = isq.quantize_stream(weights, quant_config, device, isq_report)
        label = f"Quantizing ({isq_report.isq_type}) and loading weights"
    weights = model_loader.with_progress(weights, source.num_weights(), label)
    started = time.perf_counter()
    try:
        loaded = model_loader.load_weights(model, weights)
        model_loader.check_all_loaded(model, loaded, config.source)
        model_loader.finish_loading(model, device)
    except BaseException as error:
        del model
        release_device_memory(device, error)
        if isinstance(error, ModelLoadError) and not str(error).startswith(config.source):
            raise ModelLoadError(f"{config.source}: {error}") from None  # which model, beside which tensor
        raise
    if isq_report is not None:
        log.info("%s; load took %.2f s", isq_report.describe(), time.perf_counter() - started)
    return model.eval()


def vision_spec(
    model_cls: type[torch.nn.Module], config: ModelConfig, source_path: str, source: WeightFormat | None = None
) -> VisionSpec | None:
    """How a vision model takes images (its ``vision_spec`` with the checkpoint's
    ``preprocessor_config.json`` if the source directory has one, else what ``source`` states:
    :meth:`~framework.loader.format.WeightFormat.preprocessor_config`); None for a text model."""
    if not hasattr(model_cls, "vision_spec"):
        return None
    file = Path(source_path) / "preprocessor_config.json"
    if file.is_file():
        preprocessor = json.loads(file.read_text())
    else:
        preprocessor = source.preprocessor_config() if source is not None else {}
    return model_cls.vision_spec(config, preprocessor)


def release_device_memory(device: torch.device, error: BaseException | None = None) -> None:
    """Collect dropped tensors and return cached device memory. With ``error``, its traceback's
    finished frames lose their locals first, so a caller holding the error holds no tensors."""
    if error is not None:
        traceback.clear_frames(error.__traceback__)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
