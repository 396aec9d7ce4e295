"""The contract of a weight format (safetensors in the core; GGUF and others in plugins)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from framework.tokenizer import Tokenizer


class WeightFormat(ABC):
    """An opened model source of one format.

    ``detect`` is asked, in priority order, whether a local path is in this format; the first
    format that says yes is constructed on the path and provides the config, tokenizer and
    weights. Weight names are Hugging Face checkpoint names (``model.layers.0.self_attn.q_proj.weight``)
    so every model's name mapping serves every format.
    """

    name: str = ""

    @classmethod
    @abstractmethod
    def detect(cls, path: Path, file: str | None = None) -> bool:
        """True if ``path`` (a directory or file; ``file`` = the user's ``--f``) is in this format."""

    @abstractmethod
    def __init__(self, path: Path, file: str | None = None) -> None: ...

    @abstractmethod
    def hf_config(self) -> dict[str, Any]:
        """The model's Hugging Face style config dict (``architectures``, sizes, rope, ...)."""

    def generation_config(self) -> dict[str, Any]:
        """``generation_config.json`` contents (EOS ids, defaults); empty if none."""
        return {}

    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer with its chat template and special tokens."""

    def quantization_config(self) -> dict[str, Any] | None:
        """How the weights are quantized (``{"quant_method": ...}``), or None for plain weights."""
        return None

    @abstractmethod
    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(checkpoint name, tensor)`` pairs, lazily (mmap) so memory is not doubled."""

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor ``iter_weights`` yields, for ``--isq`` recipes chosen before
        loading. The default reads the stream once; formats with an index override it."""
        return {name: tuple(tensor.shape) for name, tensor in self.iter_weights()}

    def preprocessor_config(self) -> dict[str, Any]:
        """The image processor settings of a vision model whose source has no
        ``preprocessor_config.json`` (a GGUF's vision projector states them), in that file's keys;
        empty by default (the file, where present, is read instead)."""
        return {}

    def text_only_reason(self) -> str | None:
        """Why a model of a vision family is served without images (a GGUF without its vision
        projector: where fw looked), for the refusal of an image part; None otherwise."""
        return None

    def num_weights(self) -> int | None:
        """How many tensors ``iter_weights`` yields, for the progress bar (None if unknown)."""
        return None

    def checkpoint_bytes(self) -> int | None:
        """Bytes of the weight files on disk, for the start-up summary; None when the weights come
        from no file. A format that lists its weight files in ``self.files`` gets this for free."""
        files = getattr(self, "files", None)
        return sum(Path(file).stat().st_size for file in files) if files else None
