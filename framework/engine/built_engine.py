"""``Engine``: what :class:`~framework.engine.builder.EngineBuilder` returns, the engine core with the
tokenizer, configs and summary callers need to speak text to it, and its tensor-parallel workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework import distributed
from framework.config import ModelConfig
from framework.distributed.launch import WorkerGroup
from framework.distributed.messages import StepMessage
from framework.engine.engine import EngineCore
from framework.multimodal.inputs import VisionSpec
from framework.tokenizer import Tokenizer


@dataclass(slots=True)
class Engine:
    """A built engine: the core plus what callers need to speak text to it."""

    core: EngineCore
    tokenizer: Tokenizer
    model_config: ModelConfig
    generation_config: dict[str, Any]
    attention_backend: str
    summary: dict[str, Any]
    workers: WorkerGroup | None = None  # this node's other tensor-parallel ranks (rank 0 only)
    vision: VisionSpec | None = None  # how the model takes images; None: text only

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the group (no-op on one device); idempotent."""
        if self.workers is not None:
            self.workers.stopping = True
        if distributed.is_tensor_parallel():
            try:
                distributed.broadcast_message(StepMessage(shutdown=True), StepMessage)
            except Exception:  # a worker is already gone: reaping below is all that is left
                pass
            # every rank leaves the group together (the workers on the shutdown message), then the
            # workers are reaped: terminating them first would leave rank 0's NCCL teardown waiting
            self.core.runner.release_cuda_graphs()
        distributed.destroy_tensor_parallel()
        if self.workers is not None:
            self.workers.close()
