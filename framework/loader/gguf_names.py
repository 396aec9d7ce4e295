"""GGUF file names: split shards (llama.cpp's ``gguf-split``) and the quant name in a file name.

A model in GGUF is one ``.gguf`` file or the shards ``name-00001-of-00003.gguf`` ... of a split.
The core resolves Hub repos from their file lists with these rules (it never reads GGUF bytes);
the gguf plugin groups local files with the same rules. Names are ``/``-separated paths
relative to the repo or directory; multimodal projectors (``mmproj*``) are not models.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import PurePosixPath

_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
#: The quant type at the end of a file name's stem: Q4_K_M, Q8_0, IQ4_XS, Q4_K_XL (Unsloth), F16, BF16...
_QUANT_NAME = re.compile(r"(?:^|[-_.])(I?Q\d(?:_[0-9A-Z]{1,4}){0,2}|BF16|F16|F32|MXFP4)$", re.IGNORECASE)


def split_shard_names(name: str) -> list[str] | None:
    """Every shard of the split that ``name`` belongs to, first shard first; None if ``name`` is no shard name."""
    path = PurePosixPath(name)
    m = _SPLIT_NAME.match(path.name)
    if m is None:
        return None
    count = int(m["count"])
    return [str(path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")) for i in range(1, count + 1)]


def is_projector(name: str) -> bool:
    """Whether ``name`` is a multimodal projector file (``mmproj-*.gguf``), not a language model."""
    return "mmproj" in PurePosixPath(name).name.lower()


#: Projector precisions in order of preference, when a folder holds several (F16, BF16, F32 exports...)
_PROJECTOR_PREFERENCE = ("F16", "BF16", "F32", "Q8_0")


def pick_projector(names: Iterable[str], model_file: str) -> str | None:
    """The projector (``mmproj*.gguf``) among ``names`` in ``model_file``'s folder, or None; of
    several, the first by the quant name in the file name (F16, BF16, F32, Q8_0), then by name."""
    folder = PurePosixPath(model_file).parent
    found = sorted(n for n in names if n.endswith(".gguf") and is_projector(n) and PurePosixPath(n).parent == folder)

    def rank(name: str) -> int:
        quant = quant_name(name)
        return _PROJECTOR_PREFERENCE.index(quant) if quant in _PROJECTOR_PREFERENCE else len(_PROJECTOR_PREFERENCE)

    return min(found, key=rank) if found else None


def gguf_models(names: Iterable[str]) -> list[list[str]]:
    """The distinct GGUF models among ``names`` (sorted), each the list of its files, first shard
    first; projectors and non-GGUF names are left out. A split's shards count as one model even
    when some are missing from ``names`` (the caller reports them)."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        if not name.endswith(".gguf") or is_projector(name):
            continue
        shards = split_shard_names(name)
        groups.setdefault(shards[0] if shards else name, shards or [name])
    return list(groups.values())


def quant_name(name: str) -> str | None:
    """The quant type a GGUF file name states (``Llama-3-8B-Q4_K_M-00001-of-00002.gguf`` → ``Q4_K_M``), or None."""
    stem = PurePosixPath(name).name.removesuffix(".gguf")
    m = _SPLIT_NAME.match(PurePosixPath(name).name)
    if m is not None:
        stem = m["prefix"]
    found = _QUANT_NAME.search(stem)
    return found.group(1).upper() if found else None
