"""The per-step context that attention layers read (set by the model runner).

Models keep the signature ``forward(input_ids, positions)``; everything else an attention
layer needs for the step comes from here, as in nano-vllm and vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from framework.attention_backend import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    metadata: AttentionMetadata
    backend: Any
    kv_caches: list[Any]  # per layer, indexed by Attention.layer_index
    #: hybrid models: per linear-attention layer, indexed by GatedDeltaNetAttention.state_index
    state_caches: list[Any] = field(default_factory=list)


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    """The context of the step being executed; only valid inside :func:`forward_context`."""
    assert _current is not None, "attention ran outside a forward context"
    return _current


@contextlib.contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, context
    try:
        yield context
    finally:
        _current = previous
