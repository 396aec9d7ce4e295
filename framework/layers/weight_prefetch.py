"""Experimental: prefetch the next linear layer's weight into L2 while HBM idles (``FW_PREFETCH_WEIGHTS``).

A decode step at a small batch alternates weight-streaming matmuls with kernels that barely touch
HBM: rotary, attention over a short context, the all-reduces, the norms. With this on, each
linear layer, right after queueing its own matmul (before its all-reduce), has a side stream
bring the first megabytes of the next linear layer's weight into L2::

    linear i    matmul queued ── after_matmul ──▶ side stream: wait for the main stream, then
                                                  prefetch_to_l2(weight of linear i+1, max_bytes)
    ...         rotary, attention, all-reduce, norm: main stream, HBM mostly idle
    linear i+1  forward pre-hook: the main stream waits for the side stream; its matmul then
                finds the start of its weight in L2

"Next" is the order the model's first forward called its linear layers in. Only layers with the
unquantized method (a plain ``weight``) take part, and only decode-sized calls (at most
:data:`MAX_ROWS` rows) prefetch. A prefetch changes no value, so outputs are identical with it
on or off. Measured on two H200s it is slower: Llama-3-8B TP=2 batch-1 decode gave 287.9 tok/s
with ``bulk`` against 308.2 without, and ``benchmarks/l2_prefetch_probe.py`` found an attention-sized
window followed by the GEMV no faster with a concurrent prefetch (docs/benchmarks.md). It stays
off unless asked for, for further experiments.

``FW_PREFETCH_WEIGHTS=METHOD[:MB]``: ``METHOD`` is ``auto``, ``bulk`` or ``load`` (see
``framework.ops.prefetch_to_l2``), ``MB`` the most one prefetch brings in (default
:data:`DEFAULT_MB`). CUDA engines only; elsewhere the setting is checked and then ignored.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from framework import ops
from framework.errors import ConfigError
from framework.kernels import get_kernel, kernels_for
from framework.layers.linear import LinearBase, UnquantizedLinearMethod
from framework.ops import PREFETCH_METHODS

log = logging.getLogger("fw.layers")

ENV = "FW_PREFETCH_WEIGHTS"
DEFAULT_MB = 32.0  # below an H200's 50 MB of L2, so that one prefetch does not evict itself
MIN_MB = 1 / 64  # 16 KiB: one bulk prefetch request
MAX_MB = 4096.0
MAX_ROWS = 64


@dataclass(frozen=True)
class PrefetchSetting:
    """How to prefetch: the ``prefetch_to_l2`` method and the most bytes per prefetch."""

    method: str
    max_bytes: int

    def describe(self) -> str:
        return f"{self.method}, up to {self.max_bytes / 2**20:g} MB per layer"


def setting_from_env(value: str | None = None) -> PrefetchSetting | None:
    """The setting that ``FW_PREFETCH_WEIGHTS`` (or ``value``) asks for; None when unset or ``off``.

    Raises :class:`ConfigError` naming the valid form for anything else.
    """
    value = (os.environ.get(ENV, "") if value is None else value).strip()
    if value in ("", "0", "off"):
        return None
    method, colon, megabytes = value.partition(":")
    problem = (f"{ENV} must be METHOD[:MB] with METHOD one of {', '.join(PREFETCH_METHODS)} and MB a number from "
               f"{MIN_MB:g} (one bulk request) to {MAX_MB:g}, or off; got {value!r}")
    if method not in PREFETCH_METHODS:
        raise ConfigError(problem)
    try:
        size = float(megabytes) if colon else DEFAULT_MB
    except ValueError:
        raise ConfigError(problem) from None
    if not MIN_MB <= size <= MAX_MB:  # NaN fails this too
        raise ConfigError(problem)
    return PrefetchSetting(method, int(size * 2**20))


class WeightPrefetcher:
    """Installs the hooks of the module docstring on ``model`` (built for CUDA ``device``)."""

    def __init__(self, model: nn.Module, setting: PrefetchSetting, device: torch.device) -> None:
        self.setting = setting
        self.layers = [m for m in model.modules()
                       if isinstance(m, LinearBase) and isinstance(m.linear_method, UnquantizedLinearMethod)]
        self.order: list[nn.Module] = []
        self.next_weight: dict[nn.Module, Tensor] = {}
        self.recorded = False
        self.pending = False
        self.side = torch.cuda.Stream(device)
        with kernels_for(device):
            self._prefetch = get_kernel("prefetch_to_l2")
        #: where the prefetches go: the reference (no Triton, or the plugin disabled) does nothing
        self.implementation = getattr(self._prefetch, "__module__", "?")
        if self._prefetch is ops.prefetch_to_l2:
            log.warning("%s is set but prefetch_to_l2 has only its torch reference here, which does nothing", ENV)
        if self.layers:  # compile the kernel and allocate its scratch now, never inside a graph capture
            try:
                self._prefetch(self.layers[0].weight, 2**16, setting.method)
            except ValueError as error:  # e.g. bulk before Hopper
                raise ConfigError(f"{ENV}={setting.method}: {error}") from None
            torch.cuda.synchronize(device)
        self._handles = [layer.register_forward_pre_hook(self._before_forward) for layer in self.layers]
        self._handles.append(model.register_forward_pre_hook(self._before_model))
        self._handles.append(model.register_forward_hook(self._after_model))
        for layer in self.layers:
            layer.after_matmul = self._after_matmul

    def _after_matmul(self, layer: nn.Module, x: Tensor) -> None:
        if not self.recorded:
            if layer not in self.order:
                self.order.append(layer)
            return
        weight = self.next_weight.get(layer)
        if weight is None or x.numel() > MAX_ROWS * x.shape[-1]:
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self._prefetch(weight, self.setting.max_bytes, self.setting.method)
        self.pending = True

    def _join(self) -> None:
        if self.pending:
            torch.cuda.current_stream().wait_stream(self.side)
            self.pending = False

    def _before_forward(self, layer: nn.Module, args: Any) -> None:
        self._join()

    def _before_model(self, model: nn.Module, args: Any) -> None:
        # a forward that raised may have left a fork unjoined; joining it now could reach into a
        # CUDA-graph capture that never saw the fork. A prefetch needs no join for correctness.
        self.pending = False

    def _after_model(self, model: nn.Module, args: Any, output: Any) -> None:
        self._join()
        if not self.recorded and self.order:
            self.next_weight = {layer: following.weight for layer, following in zip(self.order, self.order[1:], strict=False)}
            self.recorded = True

    def remove(self) -> None:
        """Take every hook off the model again."""
        for handle in self._handles:
            handle.remove()
        for layer in self.layers:
            layer.after_matmul = None
