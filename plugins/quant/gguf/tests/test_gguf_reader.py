"""fw_gguf.reader: metadata, zero-copy tensors, split and directory resolution, clear errors."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from fw_gguf._fast_reader import FastGGUFReader
from fw_gguf.reader import GGUFFormatError, GGUFSourceError, open_gguf, open_gguf_model, resolve_gguf_files
from gguf import GGMLQuantizationType as Q


def _stock_metadata(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_fast_reader_fields_equal_stock_gguf_reader(small_gguf_path):
    fast, stock = FastGGUFReader(small_gguf_path), gguf.GGUFReader(small_gguf_path)
    assert list(fast.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert fast.fields[key].contents() == field.contents(), key
        assert fast.fields[key].types == field.types, key
    assert [(t.name, t.tensor_type, t.data_offset) for t in fast.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in stock.tensors
    ]


def test_metadata_is_plain_python(small_gguf_path):
    md = open_gguf(small_gguf_path).metadata
    assert md == _stock_metadata(small_gguf_path)
    assert md["test.u64"] == 2**40 + 3 and type(md["test.u64"]) is int
    assert md["test.i32"] == -7 and md["test.flag"] is True and md["test.f64"] == 0.1
    assert md["test.utf8"] == "héllo 你好 😀" and md["general.architecture"] == "llama"
    assert md["tokenizer.ggml.tokens"] == ["<s>", "</s>", "▁a", "b", "é", "你好"]
    assert md["tokenizer.ggml.scores"] == [0.0, -1.5, -2.25, 3.0, 4.5, -6.0]
    assert md["test.u8s"] == [1, 2, 255] and all(type(v) is int for v in md["test.u8s"])


def test_tensors_are_zero_copy_views_in_torch_order(small_gguf_path):
    stock = {t.name: t for t in gguf.GGUFReader(small_gguf_path).tensors}
    file = open_gguf(small_gguf_path)
    assert list(file.tensors) == list(stock)
    q = file.tensors["blk.0.attn_q.weight"]
    assert (q.qtype, q.shape, tuple(q.data.shape), q.data.dtype) == (Q.Q4_K, (8, 256), (8, 144), torch.uint8)
    k = file.tensors["blk.0.attn_k.weight"]
    assert (k.qtype, k.shape, tuple(k.data.shape)) == (Q.F16, (4, 64), (4, 128))
    assert file.tensors["blk.0.attn_norm.weight"].shape == (64,)
    for name, info in file.tensors.items():
        assert np.array_equal(info.data.numpy(), stock[name].data.view(np.uint8).reshape(info.data.shape))
        assert info.file_offset == stock[name].data_offset and info.path == small_gguf_path
    # the bytes live in the file mapping, not in a copy; writes stay private
    raw = np.fromfile(small_gguf_path, dtype=np.uint8)
    assert np.array_equal(raw[q.file_offset : q.file_offset + q.nbytes], q.data.numpy().reshape(-1))
    q.data[0, 0] ^= 0xFF
    assert open_gguf(small_gguf_path).tensors["blk.0.attn_q.weight"].data[0, 0] != q.data[0, 0]
    expected = torch.from_numpy(gguf.quants.dequantize(stock["blk.1.ffn_up.weight"].data, Q.Q5_0))
    assert torch.equal(file.tensors["blk.1.ffn_up.weight"].dequantize(), expected)


def test_real_files_open_with_expected_contents(smollm2_gguf, gemma3_gguf):
    assert smollm2_gguf.architecture == "llama" and len(smollm2_gguf.tensors) == 272
    embd = smollm2_gguf.tensors["token_embd.weight"]
    assert (embd.qtype, embd.shape, tuple(embd.data.shape)) == (Q.Q8_0, (49152, 576), (49152, 612))
    assert smollm2_gguf.metadata["tokenizer.ggml.merges"][:2] == ["Ġ t", "Ġ a"]
    assert gemma3_gguf.architecture == "gemma3" and len(gemma3_gguf.tensors) == 236
    assert len(gemma3_gguf.metadata["tokenizer.ggml.tokens"]) == 262144
    assert gemma3_gguf.metadata["tokenizer.ggml.scores"][:2] == [-1000.0, -1000.0]
    assert gemma3_gguf.tensors["blk.0.ffn_down.weight"].shape == (640, 2048)


@pytest.mark.parametrize("num_shards", [2, 3])
def test_split_model_merges_to_the_original(small_gguf_path, split_gguf, tmp_path, num_shards):
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    shards = split_gguf(small_gguf_path, shard_dir, num_shards, stem="tiny")
    single = open_gguf(small_gguf_path)
    shard_md = open_gguf(shards[0]).metadata
    assert (shard_md["split.no"], shard_md["split.count"], shard_md["split.tensors.count"]) == (0, num_shards, 6)
    assert open_gguf(shards[-1]).metadata == {
        "split.no": num_shards - 1,
        "split.count": num_shards,
        "split.tensors.count": 6,
    }
    for given in (shards[0], shards[-1], shard_dir):
        assert resolve_gguf_files(given) == shards
        merged = open_gguf_model(given)
        assert merged.paths == shards and merged.metadata == single.metadata
        assert list(merged.tensors) == list(single.tensors)
        for name, info in single.tensors.items():
            got = merged.tensors[name]
            assert (got.qtype, got.shape) == (info.qtype, info.shape) and torch.equal(got.data, info.data)
    assert len({merged.tensors[n].path for n in merged.tensors}) == num_shards


def test_missing_shard_is_named(small_gguf_path, split_gguf, tmp_path):
    (tmp_path / "shards").mkdir()
    shards = split_gguf(small_gguf_path, tmp_path / "shards", 3, stem="tiny")
    shards[1].unlink()
    with pytest.raises(GGUFSourceError, match=r"missing GGUF shard\(s\) .*: tiny-00002-of-00003\.gguf$"):
        open_gguf_model(shards[0])
    with pytest.raises(GGUFSourceError, match="tiny-00002-of-00003.gguf"):
        resolve_gguf_files(tmp_path / "shards")


def test_renamed_shard_is_not_mistaken_for_a_whole_model(small_gguf_path, split_gguf, tmp_path):
    (tmp_path / "shards").mkdir()
    shards = split_gguf(small_gguf_path, tmp_path / "shards", 2, stem="tiny")
    lone = shards[0].rename(tmp_path / "renamed.gguf")
    with pytest.raises(GGUFSourceError, match="shard 1 of a 2-file split"):
        open_gguf_model(lone)


def test_directory_with_mmproj_resolves_to_the_model(small_gguf_path, tmp_path):
    model_dir = tmp_path / "repo"
    model_dir.mkdir()
    shutil.copy(small_gguf_path, model_dir / "model-Q4_K_M.gguf")
    shutil.copy(small_gguf_path, model_dir / "mmproj-model-f16.gguf")
    (model_dir / "README.md").write_text("not a model")
    assert resolve_gguf_files(model_dir) == [model_dir / "model-Q4_K_M.gguf"]
    assert open_gguf_model(model_dir).path == model_dir / "model-Q4_K_M.gguf"


def test_directory_with_several_models_lists_them(small_gguf_path, split_gguf, tmp_path):
    shutil.copy(small_gguf_path, tmp_path / "model-Q4_K_M.gguf")
    (tmp_path / "Q8_0").mkdir()
    split_gguf(small_gguf_path, tmp_path / "Q8_0", 2, stem="model-Q8_0")
    with pytest.raises(GGUFSourceError, match="holds 2 GGUF models; pick one with --f") as info:
        resolve_gguf_files(tmp_path)
    assert "model-Q4_K_M.gguf" in str(info.value) and "Q8_0/model-Q8_0-00001-of-00002.gguf" in str(info.value)
    assert resolve_gguf_files(tmp_path / "Q8_0")[0].name == "model-Q8_0-00001-of-00002.gguf"


def test_directory_without_models_says_so(tmp_path):
    (tmp_path / "mmproj-f16.gguf").write_bytes(b"GGUF")
    with pytest.raises(GGUFSourceError, match="no .gguf model file in this directory"):
        resolve_gguf_files(tmp_path)
    with pytest.raises(GGUFSourceError, match="no such file or directory"):
        resolve_gguf_files(tmp_path / "nope")


@pytest.fixture(scope="module")
def smollm2_head(smollm2_gguf_path, smollm2_gguf):
    """The real file's header and first tensors (enough bytes to corrupt), and its layout."""
    reader = FastGGUFReader(smollm2_gguf_path)
    first = min(smollm2_gguf.tensors.values(), key=lambda t: t.file_offset)
    with open(smollm2_gguf_path, "rb") as f:
        head = f.read(first.file_offset + first.nbytes)
    return head, reader


def _write(tmp_path, data: bytes):
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    return path


def _error(path) -> str:
    with pytest.raises(GGUFFormatError) as info:
        open_gguf(path)
    message = str(info.value)
    assert message.startswith(str(path)) and "Traceback" not in message
    return message


def test_bad_magic_is_reported(tmp_path, smollm2_head):
    head, _ = smollm2_head
    assert "bad magic b'GGUX', expected b'GGUF'" in _error(_write(tmp_path, b"GGUX" + head[4:]))
    lfs = b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 98362432\n"
    assert "Git LFS pointer" in _error(_write(tmp_path, lfs))
    assert "it is 0 bytes long" in _error(_write(tmp_path, b""))


def test_truncated_file_is_reported(tmp_path, smollm2_head, smollm2_gguf_path):
    head, reader = smollm2_head
    assert "header is truncated" in _error(_write(tmp_path, head[:100_000]))  # cut inside the vocabulary
    last_info = reader.tensors[-1].field
    infos_end = last_info.offset + sum(int(p.nbytes) for p in last_info.parts)
    assert "header is truncated" in _error(_write(tmp_path, head[: infos_end - 10]))  # inside the last tensor info
    message = _error(_write(tmp_path, head))  # all tensor infos, but only the first tensor's data
    assert "file is truncated: tensor" in message and f"but the file has {len(head)} bytes" in message


def test_corrupt_header_is_reported(tmp_path, smollm2_head):
    head, reader = smollm2_head
    version = bytearray(head)
    version[4:8] = (99).to_bytes(4, "little")
    assert "GGUF version 99 is not supported by the installed gguf library" in _error(_write(tmp_path, bytes(version)))

    tensor = reader.tensors[0].field  # name_len, name, n_dims, dims, type, offset
    type_at = tensor.offset + sum(int(p.nbytes) for p in tensor.parts[:4])
    bad_type = bytearray(head)
    bad_type[type_at : type_at + 4] = (250).to_bytes(4, "little")
    assert f"tensor '{reader.tensors[0].name}' has unknown ggml type id 250" in _error(
        _write(tmp_path, bytes(bad_type))
    )

    field = reader.fields["llama.block_count"]  # key_len, key, value type, value
    vtype_at = field.offset + sum(int(p.nbytes) for p in field.parts[:2])
    bad_kv = bytearray(head)
    bad_kv[vtype_at : vtype_at + 4] = (77).to_bytes(4, "little")
    assert f"metadata value at byte {vtype_at + 4} has unknown type id 77" in _error(_write(tmp_path, bytes(bad_kv)))

    string = reader.fields["general.name"]
    len_at = string.offset + sum(int(p.nbytes) for p in string.parts[:3])
    huge = bytearray(head)
    huge[len_at : len_at + 8] = (2**40).to_bytes(8, "little")
    assert "header is truncated" in _error(_write(tmp_path, bytes(huge)))


def test_missing_file_is_a_source_error(tmp_path):
    with pytest.raises(GGUFSourceError, match="no such GGUF file"):
        open_gguf(tmp_path / "absent.gguf")
