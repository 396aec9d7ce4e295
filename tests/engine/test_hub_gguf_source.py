"""Hub repos of GGUF files: one model is picked without --f, several are listed, splits download
every shard. The Hub is huggingface_hub's listing and per-file download, replaced here by a fake
repo (no network)."""

from __future__ import annotations

from pathlib import Path

import httpx
import huggingface_hub
import pytest
from huggingface_hub.errors import EntryNotFoundError, OfflineModeIsEnabled

from framework.errors import ModelLoadError
from framework.loader.gguf_names import gguf_models, quant_name, split_shard_names
from framework.loader.source import resolve_local_path


class FakeHub:
    """A repo ``owner/name`` holding ``files`` (empty stand-ins); records what is downloaded."""

    def __init__(self, monkeypatch, tmp_path: Path, files: list[str]) -> None:
        self.files, self.snapshot = files, tmp_path / "snapshots" / "0123abcd"
        self.downloaded: list[str] = []
        self.listed = 0
        monkeypatch.setattr(huggingface_hub, "list_repo_files", self.list_repo_files)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", self.hf_hub_download)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)

    def list_repo_files(self, repo_id, *, revision=None, **_):
        self.listed += 1
        return list(self.files)

    def hf_hub_download(self, repo_id, filename, *, revision=None, **_):
        if filename not in self.files:
            raise EntryNotFoundError(f"404: {filename}")
        self.downloaded.append(filename)
        local = self.snapshot / filename
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(b"GGUF")
        return str(local)

    def snapshot_download(self, repo_id, *, revision=None, allow_patterns=None, **_):
        self.downloaded.append(f"snapshot {allow_patterns}")
        self.snapshot.mkdir(parents=True, exist_ok=True)
        return str(self.snapshot)


BARTOWSKI = [
    "README.md",
    ".gitattributes",
    "Model-Q4_K_M.gguf",
    "Model-Q8_0.gguf",
    "Model-IQ4_XS.gguf",
    "Model-f16/Model-f16-00001-of-00002.gguf",
    "Model-f16/Model-f16-00002-of-00002.gguf",
    "mmproj-Model-f16.gguf",
]


def test_repo_of_several_gguf_models_lists_them_with_their_quant_types(monkeypatch, tmp_path):
    hub = FakeHub(monkeypatch, tmp_path, BARTOWSKI)
    with pytest.raises(ModelLoadError) as info:
        resolve_local_path("someone/Model-GGUF")
    message = str(info.value)
    assert message.startswith(
        "model 'someone/Model-GGUF' holds 4 GGUF models (quant types F16, IQ4_XS, Q4_K_M, Q8_0); pick one with --f:"
    )
    assert message.splitlines()[1:] == [
        "  Model-IQ4_XS.gguf  [IQ4_XS]",
        "  Model-Q4_K_M.gguf  [Q4_K_M]",
        "  Model-Q8_0.gguf  [Q8_0]",
        "  Model-f16/Model-f16-00001-of-00002.gguf (2 shards)  [F16]",
    ]
    assert hub.downloaded == []  # nothing fetched before the user chooses


def test_repo_of_one_gguf_model_downloads_it_without_f(monkeypatch, tmp_path):
    hub = FakeHub(monkeypatch, tmp_path, ["README.md", "Model-Q4_K_M.gguf", "mmproj-Model-f16.gguf"])
    assert resolve_local_path("someone/Model-GGUF") == hub.snapshot / "Model-Q4_K_M.gguf"
    assert hub.downloaded == ["Model-Q4_K_M.gguf"]


def test_repo_of_one_split_model_downloads_every_shard(monkeypatch, tmp_path):
    shards = [f"q4/Model-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    hub = FakeHub(monkeypatch, tmp_path, ["README.md", *reversed(shards)])
    assert resolve_local_path("someone/Model-GGUF") == hub.snapshot / shards[0]
    assert hub.downloaded == shards


def test_first_shard_named_with_f_downloads_every_shard(monkeypatch, tmp_path):
    shards = [f"Model-Q8_0-{i:05d}-of-00002.gguf" for i in (1, 2)]
    hub = FakeHub(monkeypatch, tmp_path, [*shards, "Model-Q4_K_M.gguf"])
    assert resolve_local_path("someone/Model-GGUF", file=shards[0]) == hub.snapshot  # the format joins --f
    assert hub.downloaded == shards and hub.listed == 0


def test_split_with_a_shard_missing_on_the_hub_names_it(monkeypatch, tmp_path):
    FakeHub(monkeypatch, tmp_path, ["Model-Q8_0-00001-of-00003.gguf", "Model-Q8_0-00003-of-00003.gguf"])
    with pytest.raises(
        ModelLoadError, match=r"no shard 'Model-Q8_0-00002-of-00003.gguf' of its 3-file split on the Hub"
    ):
        resolve_local_path("someone/Model-GGUF")


def test_repo_with_safetensors_keeps_the_snapshot_download(monkeypatch, tmp_path):
    hub = FakeHub(monkeypatch, tmp_path, ["config.json", "model.safetensors", "model-Q4_K_M.gguf"])
    assert resolve_local_path("someone/Model") == hub.snapshot
    assert hub.downloaded == ["snapshot ['*.json', '*.jinja', 'tokenizer*', '*.model', '*.tiktoken', '*.safetensors']"]


@pytest.mark.parametrize(
    "failure",
    [
        OfflineModeIsEnabled("offline mode is enabled"),
        httpx.ConnectError("[Errno -3] Temporary failure in name resolution"),
    ],
)
def test_unlisted_hub_falls_back_to_the_cache(monkeypatch, tmp_path, failure):
    # httpx's transport errors are not OSErrors: an unreachable Hub must still leave it to the cache
    hub = FakeHub(monkeypatch, tmp_path, [])

    def unreachable(*args, **kwargs):
        raise failure

    monkeypatch.setattr(huggingface_hub, "list_repo_files", unreachable)
    assert resolve_local_path("someone/Model-GGUF") == hub.snapshot
    assert len(hub.downloaded) == 1 and hub.downloaded[0].startswith("snapshot")


@pytest.mark.parametrize(
    ("name", "quant"),
    [
        ("Meta-Llama-3-8B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("qwen3-30b-a3b-ud-q4_k_xl-00001-of-00002.gguf", "Q4_K_XL"),
        ("gemma-3-270m-it-IQ4_NL.gguf", "IQ4_NL"),
        ("model-bf16.gguf", "BF16"),
        ("model_f16.gguf", "F16"),
        ("model.gguf", None),
        ("Qwen3-8B.gguf", None),
    ],
)
def test_quant_name_is_read_from_the_file_name(name, quant):
    assert quant_name(name) == quant


def test_gguf_models_group_split_shards_and_skip_projectors():
    names = ["b/x-00002-of-00002.gguf", "a.gguf", "b/x-00001-of-00002.gguf", "mmproj-a.gguf", "notes.txt"]
    assert gguf_models(names) == [["a.gguf"], ["b/x-00001-of-00002.gguf", "b/x-00002-of-00002.gguf"]]
    assert split_shard_names("m-00002-of-00002.gguf") == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    assert split_shard_names("m-1-of-2.gguf") is None
