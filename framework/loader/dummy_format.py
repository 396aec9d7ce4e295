"""Random weights of a real architecture, without a checkpoint on disk (``load_format="dummy"``).

For benchmarks of large shapes: a directory with only ``config.json`` (and optionally a
tokenizer) is enough. The checkpoint names and shapes come from transformers' implementation of
the architecture built on the meta device, so the model's name mapping and weight loaders run
exactly as for a real checkpoint; tensors are drawn on the target device, normal(0, 0.02).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from framework.errors import ModelLoadError
from framework.loader.format import WeightFormat
from framework.tokenizer import Tokenizer


class DummyFormat(WeightFormat):
    name = "dummy"
    device: str | torch.device = "cuda" if torch.cuda.is_available() else "cpu"

    @classmethod
    def detect(cls, path: Path, file: str | None = None) -> bool:
        return False  # only when asked for by name

    def __init__(self, path: Path, file: str | None = None) -> None:
        if not (path / "config.json").exists():
            raise ModelLoadError(f"load format 'dummy' needs a directory with config.json; {path} has none")
        self.path = path

    def hf_config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def tokenizer(self) -> Tokenizer:
        if (self.path / "tokenizer.json").exists():
            return Tokenizer.from_directory(self.path)
        from framework.testing import make_tiny_tokenizer

        config = self.hf_config()  # a multimodal wrapper's vocabulary is its text model's
        vocab_size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        return Tokenizer(make_tiny_tokenizer(int(vocab_size)), eos_token="</s>")

    @functools.cached_property
    def _shapes(self) -> dict[str, torch.Size]:
        """Checkpoint names and shapes of transformers' implementation (built once, on meta)."""
        import transformers

        config = transformers.AutoConfig.for_model(**self.hf_config())
        with torch.device("meta"):
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except ValueError:  # a vision-language model (Qwen2.5-VL) is an image-text-to-text model
                model = transformers.AutoModelForImageTextToText.from_config(config)
        return {name: tensor.shape for name, tensor in model.state_dict().items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        generator = torch.Generator(device=self.device).manual_seed(0)
        for name, shape in self._shapes.items():
            if name.endswith("norm.weight") or "layernorm" in name:
                yield name, torch.ones(shape, device=self.device)
            else:
                yield name, torch.empty(shape, device=self.device).normal_(0, 0.02, generator=generator)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor ``iter_weights`` yields (for ``--isq`` recipes), without drawing any."""
        return {name: tuple(shape) for name, shape in self._shapes.items()}

    def num_weights(self) -> int | None:
        return len(self._shapes)
