"""Open a model source, build the model on the meta device and stream its weights in.

The model is constructed under ``torch.device("meta")`` (no memory, no init cost), then
materialised once on the target device with ``to_empty``; each checkpoint tensor is copied
from the mmap'd file into its parameter by the parameter's ``weight_loader``. Peak memory is
the model plus one tensor, never two copies of the model.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from framework import registries
from framework.errors import ModelLoadError
from framework.kernels import kernels_for
from framework.loader.checkpoint_slice import materialize
from framework.loader.format import WeightFormat

log = logging.getLogger("fw.loader")


def open_model_source(path: Path, file: str | None = None, load_format: str = "auto") -> WeightFormat:
    """The format named ``load_format``, or the first registered one (by priority) that recognises ``path``."""
    if load_format != "auto":
        return registries.weight_formats().get(load_format).load()(path, file)
    formats = list(registries.weight_formats())
    for spec in formats:
        format_cls = spec.load()
        if format_cls.detect(path, file):
            return format_cls(path, file)
    names = ", ".join(spec.name for spec in formats)
    raise ModelLoadError(
        f"{path}: no installed weight format recognises it (tried: {names}); "
        "expected a directory with config.json and *.safetensors, or a .gguf file with the gguf plugin"
    )


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(model_cls: type[nn.Module], model_config, quant_config, device: torch.device) -> nn.Module:
    """Construct on meta, then allocate (uninitialised) on ``device`` in the model's dtype; the
    layers choose the kernels of ``device``'s platform (:func:`framework.kernels.kernels_for`)."""
    with torch.device("meta"), default_dtype(model_config.dtype), kernels_for(device):
        model = model_cls(model_config, quant_config, prefix="")
    return model.to_empty(device=device)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy checkpoint tensors into the model's parameters; return the parameter names filled.

    Checkpoint names fold into fused parameters through the model's ``packed_modules_mapping``
    (``{"q_proj": ("qkv_proj", "q"), ...}``); names the model lists in
    ``ignored_weight_patterns`` are skipped. A model with other layouts (stacked MoE experts)
    defines ``map_weight_name(name) -> (name, loader_args)``, asked first: ``loader_args`` is a
    tuple passed to the parameter's ``weight_loader`` after the tensor, or None to go on with
    the (possibly renamed) name through ``packed_modules_mapping``. A model may replace all of
    this with its own ``load_weights(weights)`` returning the loaded names.

    A format may yield lazy :class:`~framework.loader.checkpoint_slice.CheckpointSlice` objects
    (safetensors under tensor parallelism, GGUF expert stacks): the core layers' loaders read
    just their part of them; every other loader, and a model's own ``load_weights``, gets whole
    tensors, unless the model sets ``reads_checkpoint_slices = True`` (then it must narrow and
    :func:`~framework.loader.checkpoint_slice.materialize` them itself).
    """
    if hasattr(model, "load_weights"):
        if not reads_checkpoint_slices(model):
            weights = ((name, materialize(tensor)) for name, tensor in weights)
        return model.load_weights(weights)
    return load_parameters(model, weights)


def load_parameters(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """:func:`load_weights`'s generic path (names folded, each tensor given to its parameter's
    ``weight_loader``), also for a model's own ``load_weights`` that only renames or re-lays out
    some tensors first."""
    packed = getattr(model, "packed_modules_mapping", {})
    ignored = getattr(model, "ignored_weight_patterns", ())
    map_name = getattr(model, "map_weight_name", None)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(pattern in name for pattern in ignored):
            continue
        if name.endswith((".k_scale", ".v_scale")) and _load_kv_scale(model, name, tensor):
            continue
        loader_args = None
        if map_name is not None:
            name, loader_args = map_name(name)
        if loader_args is None:
            loader_args = ()
            for source, (target, shard) in packed.items():
                if f".{source}." in name:
                    name, loader_args = name.replace(f".{source}.", f".{target}."), (shard,)
                    break
        param = params.get(name)
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        if not reads_checkpoint_slices(getattr(loader, "__self__", loader)):  # a bound method: its layer
            tensor = materialize(tensor)
        if loader is None:
            _copy_checked(param, tensor, name)
        else:
            loader(param, tensor, *loader_args)
        loaded.add(name)
    return loaded


def _load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Hand a checkpoint ``...self_attn[.k_proj|.v_proj].k_scale`` (vLLM's and compressed-tensors'
    names for fp8 KV-cache scales) to the ``Attention`` layer under that ``self_attn``; False if
    there is none (the name is then an ordinary parameter)."""
    from framework.layers.attention import Attention

    owner, _, which = name.rpartition(".")
    for projection in (".k_proj", ".v_proj"):
        owner = owner.removesuffix(projection)
    for _name, child in model.get_submodule(owner).named_children() if _has_module(model, owner) else []:
        if isinstance(child, Attention):
            child.set_checkpoint_scale(which, materialize(tensor))
            return True
    return False


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def reads_checkpoint_slices(owner: object) -> bool:
    """Whether ``owner`` (a model with its own ``load_weights``, the layer a parameter's
    ``weight_loader`` is bound to, or the loader itself when it is not a bound method) takes lazy
    CheckpointSlices: it says so with ``reads_checkpoint_slices = True`` (the core layers whose
    loaders only narrow and copy: ``LinearBase``, ``VocabEmbedding``, ``FusedMoE``; a quant
    method's ``functools.partial`` loader that reads a slice's packed source). Everything else
    gets whole tensors."""
    return bool(getattr(owner, "reads_checkpoint_slices", False))


def _copy_checked(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ModelLoadError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
        )
    param.data.copy_(tensor)


def finish_loading(model: nn.Module, device: torch.device) -> None:
    """After weights: let every module's quant method (linear layers, vocabulary tables, FusedMoE)
    repack, then modules with computed buffers fill them (``init_buffers(device)``, which may read
    other layers' processed weights: MLA dequantizes a quantized ``kv_b_proj`` there)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    for module in model.modules():
        init = getattr(module, "init_buffers", None)
        if init is not None:
            init(device)


def with_progress(
    weights: Iterable[tuple[str, torch.Tensor]], total: int | None, label: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Wrap the weight stream in a progress bar on an interactive terminal."""
    if not sys.stderr.isatty():
        yield from weights
        return
    from rich.progress import track

    yield from track(weights, total=total, description=label, transient=True)


def check_all_loaded(model: nn.Module, loaded: set[str], source: str) -> None:
    """Every parameter must have come from the checkpoint (tied ones count once).

    A module filled piece by piece (stacked MoE experts) reports the pieces it still lacks
    through ``missing_weights() -> [description]``.
    """
    tied = getattr(model, "tied_parameter_names", set())
    missing = [name for name, _ in model.named_parameters() if name not in loaded and name not in tied]
    for module_name, module in model.named_modules():
        if (report := getattr(module, "missing_weights", None)) is not None:
            missing += [f"{module_name}.{piece}" for piece in report()]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ModelLoadError(f"{source}: the checkpoint lacks weights for {shown}")
