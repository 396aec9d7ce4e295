"""A Hub repo holding one split GGUF loads from its name alone: the repo is listed, every shard is
downloaded, and the engine gives the tokens of the local whole file. huggingface_hub's listing and
per-file download are replaced by a fake repo of real shards (no network)."""

from __future__ import annotations

import shutil

import huggingface_hub
import pytest

from framework import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def test_split_gguf_repo_named_without_f_downloads_every_shard_and_loads(
    smollm2_gguf_path, split_gguf, tmp_path, monkeypatch
):
    upload = tmp_path / "upload"
    upload.mkdir()
    shards = split_gguf(smollm2_gguf_path, upload, 2, stem="SmolLM2-135M-Instruct-Q4_1")
    names = [f"Q4_1/{shard.name}" for shard in shards]
    snapshot, downloaded = tmp_path / "snapshot", []

    def hf_hub_download(repo_id, filename, *, revision=None, **_):
        assert repo_id == "someone/SmolLM2-GGUF" and filename in names
        downloaded.append(filename)
        (snapshot / "Q4_1").mkdir(parents=True, exist_ok=True)
        return str(shutil.copy(upload / filename.removeprefix("Q4_1/"), snapshot / filename))

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, **_: ["README.md", *names])
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM("someone/SmolLM2-GGUF", num_blocks=16)
    assert downloaded == names
    expected = LLM(str(smollm2_gguf_path), num_blocks=16).generate("The capital of France is", params)
    assert llm.generate("The capital of France is", params)[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert llm.engine.summary["checkpoint_bytes"] == sum(shard.stat().st_size for shard in shards)
