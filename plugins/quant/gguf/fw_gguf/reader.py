"""Open GGUF files (single or split) through `gguf.GGUFReader`, with errors a user can act on.

Metadata comes back as plain Python values and tensors as zero-copy uint8 torch views of the
memory-mapped file, shaped `[*shape[:-1], bytes_per_row]` in torch order.

Split GGUFs follow llama.cpp's `gguf-split`: `name-00001-of-00003.gguf` ... with the keys
`split.no` (0-based), `split.count` and `split.tensors.count`; the first shard carries the model
metadata, every shard carries some tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUF_MAGIC, GGMLQuantizationType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from framework.loader.gguf_names import gguf_models, split_shard_names

from ._fast_reader import CorruptError, FastGGUFReader, TruncatedError, field_value
from .dequant import bytes_per_row, dequantize

_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


class GGUFError(Exception):
    """Base class of the errors this module raises."""


class GGUFFormatError(GGUFError, ValueError):
    """The file is not a readable GGUF (bad magic, truncated, corrupt header or inconsistent split)."""


class GGUFSourceError(GGUFError, ValueError):
    """The path does not name exactly one complete GGUF model (missing shards, none or several)."""


@dataclass(slots=True)
class TensorInfo:
    """One tensor of a GGUF file.

    `shape` is torch order (`[out_features, in_features]`, the reverse of GGUF's `ne`); `data` is
    a uint8 view of the file bytes shaped `[*shape[:-1], bytes_per_row]` (no copy; writes go to a
    private copy-on-write page, never to the file).
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: torch.Tensor = field(repr=False)
    path: Path = field(repr=False)
    file_offset: int = field(repr=False)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
        """The tensor's values as `dtype` on `device` (default: CPU), via `fw_gguf.dequant`."""
        data = self.data if device is None else self.data.to(device)
        return dequantize(data, self.qtype, self.shape, dtype)


@dataclass(slots=True)
class GGUFFile:
    """One opened `.gguf` file: plain-Python `metadata` and `tensors` by name, in file order."""

    path: Path
    metadata: dict[str, Any] = field(repr=False)  # the vocabulary alone can be 262k strings
    tensors: dict[str, TensorInfo] = field(repr=False)

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")


@dataclass(slots=True)
class GGUFModel:
    """A whole model: one file or every shard of a split. Metadata is the first shard's, without
    the `split.*` keys; tensors are the union of all shards."""

    paths: list[Path]
    metadata: dict[str, Any] = field(repr=False)
    tensors: dict[str, TensorInfo] = field(repr=False)

    @property
    def path(self) -> Path:
        return self.paths[0]

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")


def _check_magic(path: Path) -> None:
    with path.open("rb") as f:
        head = f.read(64)
    if len(head) < 4:
        raise GGUFFormatError(f"{path}: not a GGUF file: it is {len(head)} bytes long")
    if int.from_bytes(head[:4], "little") != GGUF_MAGIC:
        hint = ""
        if head.startswith(b"version https://git-lfs"):
            hint = " (it is a Git LFS pointer: fetch the real file with `git lfs pull`)"
        elif head.lstrip()[:1] in (b"{", b"<"):
            hint = " (it looks like JSON/HTML text, e.g. an error page saved instead of the model)"
        raise GGUFFormatError(f"{path}: not a GGUF file: bad magic {head[:4]!r}, expected b'GGUF'{hint}")
    version = int.from_bytes(head[4:8], "little")
    # a zero low half is a big-endian file, which the reader detects and byte-swaps itself
    if len(head) >= 8 and version & 0xFFFF and version not in READER_SUPPORTED_VERSIONS:
        supported = ", ".join(map(str, READER_SUPPORTED_VERSIONS))
        raise GGUFFormatError(
            f"{path}: GGUF version {version} is not supported by the installed gguf library (it reads {supported})"
        )


def open_gguf(path: str | Path) -> GGUFFile:
    """Open one `.gguf` file: parse its header with `gguf.GGUFReader` and map its tensors.

    Raises `GGUFSourceError` when `path` is not a file, and `GGUFFormatError` (naming the file and
    the problem) for anything the reader cannot make sense of: bad magic, unsupported version,
    truncated header or data, unknown tensor type, non-UTF-8 strings.
    """
    path = Path(path)
    if not path.is_file():
        raise GGUFSourceError(f"{path}: no such GGUF file")
    _check_magic(path)
    try:
        reader = FastGGUFReader(path, mode="c")  # copy-on-write: writable views that never touch the file
        metadata = {key: field_value(f) for key, f in reader.fields.items() if not key.startswith("GGUF.")}
    except (TruncatedError, CorruptError) as exc:
        raise GGUFFormatError(f"{path}: {exc}") from None
    except OSError as exc:
        raise GGUFSourceError(f"{path}: cannot be read ({exc})") from None
    except Exception as exc:  # gguf/numpy raise bare ValueError/IndexError/KeyError on bad bytes
        raise GGUFFormatError(f"{path}: corrupt GGUF ({type(exc).__name__}: {exc})") from None
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            raw = t.data.view(np.uint8).reshape(*shape[:-1], bytes_per_row(t.tensor_type, shape[-1]))
        except ValueError as exc:
            raise GGUFFormatError(
                f"{path}: tensor '{t.name}' {t.tensor_type.name} {list(shape)}: its data does not fit its shape ({exc})"
            ) from None
        tensors[t.name] = TensorInfo(t.name, t.tensor_type, shape, torch.from_numpy(raw), path, t.data_offset)
    return GGUFFile(path, metadata, tensors)


def _split_shards(path: Path) -> list[Path] | None:
    """All shard paths of a split named like `path`, or None if `path` is not a shard name."""
    names = split_shard_names(path.name)
    return None if names is None else [path.with_name(name) for name in names]


def _candidates(directory: Path) -> list[list[Path]]:
    """The distinct models under `directory` (its files, then one level of subfolders), ignoring
    multimodal projectors (`mmproj*`); each model is its list of files."""
    files = [f for f in sorted(directory.glob("*.gguf")) + sorted(directory.glob("*/*.gguf")) if f.is_file()]
    models = gguf_models(f.relative_to(directory).as_posix() for f in files)
    return [[directory / name for name in model] for model in models]


def resolve_gguf_files(path: str | Path) -> list[Path]:
    """The files of the one GGUF model that `path` names, first shard first.

    `path` is a `.gguf` file (a shard name `*-0000k-of-0000N.gguf` resolves to all N shards beside
    it) or a directory holding exactly one model, split or not, at its top level or one folder
    down; `mmproj*` files are ignored. Raises `GGUFSourceError` for missing shards (naming them),
    an empty directory, or several models (listing them, to choose one with `--f`).
    """
    path = Path(path)
    if path.is_dir():
        models = _candidates(path)
        if not models:
            raise GGUFSourceError(f"{path}: no .gguf model file in this directory (mmproj files are not models)")
        if len(models) > 1:
            names = "\n  ".join(str(m[0].relative_to(path)) for m in models)
            raise GGUFSourceError(f"{path} holds {len(models)} GGUF models; pick one with --f:\n  {names}")
        files = models[0]
    elif path.suffix != ".gguf" and not path.is_file():
        raise GGUFSourceError(f"{path}: no such file or directory")
    else:
        files = _split_shards(path) or [path]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        what = "shard" if len(files) > 1 else "file"
        raise GGUFSourceError(f"{path}: missing GGUF {what}(s) in {files[0].parent}: {', '.join(missing)}")
    return files


def open_gguf_model(path: str | Path) -> GGUFModel:
    """Resolve `path` (see `resolve_gguf_files`), open every file and merge them into a `GGUFModel`.

    Raises `GGUFFormatError` when shards disagree with their `split.*` keys (wrong index, count or
    total tensor count) or repeat a tensor name.
    """
    files = [open_gguf(p) for p in resolve_gguf_files(path)]
    first = files[0]
    if len(files) == 1 and first.metadata.get("split.count", 1) > 1:
        raise GGUFSourceError(
            f"{first.path} is shard {first.metadata.get('split.no', 0) + 1} of a {first.metadata['split.count']}-file "
            "split, but its name lacks the -0000k-of-0000N.gguf pattern that locates the other shards"
        )
    metadata = {k: v for k, v in first.metadata.items() if k not in _SPLIT_KEYS}
    tensors: dict[str, TensorInfo] = {}
    for index, file in enumerate(files):
        if len(files) > 1:
            no, count = file.metadata.get("split.no"), file.metadata.get("split.count")
            if (no, count) != (index, len(files)):
                raise GGUFFormatError(
                    f"{file.path}: split.no={no}, split.count={count}; expected shard {index} of {len(files)}"
                )
        for name, info in file.tensors.items():
            if name in tensors:
                raise GGUFFormatError(f"{file.path}: tensor '{name}' also appears in {tensors[name].path.name}")
            tensors[name] = info
    expected = first.metadata.get("split.tensors.count")
    if expected is not None and expected != len(tensors):
        raise GGUFFormatError(
            f"{first.path}: split.tensors.count={expected} but the shards hold {len(tensors)} tensors"
        )
    return GGUFModel([f.path for f in files], metadata, tensors)
