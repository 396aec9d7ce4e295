"""Hugging Face checkpoints: ``config.json`` + ``*.safetensors`` (one file or sharded with index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from framework.distributed.state import get_tp_size
from framework.errors import ModelLoadError
from framework.loader.checkpoint_slice import CheckpointSlice
from framework.loader.format import WeightFormat
from framework.tokenizer import Tokenizer


class SafetensorsFormat(WeightFormat):
    """A directory with ``config.json`` and safetensors weights, read through mmap."""

    name = "safetensors"

    @classmethod
    def detect(cls, path: Path, file: str | None = None) -> bool:
        return path.is_dir() and (path / "config.json").exists() and any(path.glob("*.safetensors"))

    def __init__(self, path: Path, file: str | None = None) -> None:
        self.path = path
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = sorted({path / name for name in weight_map.values()})
            missing = [f.name for f in self.files if not f.exists()]
            if missing:
                raise ModelLoadError(
                    f"{path}: shards listed in model.safetensors.index.json are missing: {', '.join(missing)}"
                )
        else:
            self.files = sorted(path.glob("*.safetensors"))

    def hf_config(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / "config.json").read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{self.path / 'config.json'} is not valid JSON: {exc}") from None

    def generation_config(self) -> dict[str, Any]:
        file = self.path / "generation_config.json"
        return json.loads(file.read_text()) if file.exists() else {}

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_directory(self.path)

    def quantization_config(self) -> dict[str, Any] | None:
        return self.hf_config().get("quantization_config")

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors; under tensor parallelism lazy :class:`CheckpointSlice` objects, so that each
        rank reads only its part (``get_slice``) instead of every whole matrix."""
        lazy = get_tp_size() > 1
        for file in self.files:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    if lazy:
                        part = handle.get_slice(name)
                        yield name, CheckpointSlice(part, tuple(part.get_shape()))
                    else:
                        yield name, handle.get_tensor(name)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor, from the files' headers (no tensor is read)."""
        shapes = {}
        for file in self.files:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        return shapes

    def num_weights(self) -> int | None:
        total = 0
        for file in self.files:
            with safe_open(file, framework="pt", device="cpu") as handle:
                total += len(handle.keys())
        return total
