"""Bad GGUF input through the engine: an unsupported ggml type, corrupt or truncated files, a
fused projection that cannot be split for tensor parallelism. Each fails with a ModelLoadError or
ConfigError naming the file and tensor (no numpy/struct traceback) and leaves no model behind."""

from __future__ import annotations

import gc
import re
import struct
import weakref

import gguf
import numpy as np
import pytest
from fw_gguf.method import GGUFLinearMethod
from gguf import GGMLQuantizationType as Q

from framework import LLM
from framework.errors import ConfigError, ModelLoadError
from framework.layers import MergedColumnParallelLinear, QKVParallelLinear
from framework.loader import model_loader

pytestmark = pytest.mark.usefixtures("one_thread")


def rewrite(source, target, replace: dict[str, tuple[np.ndarray, Q]]):
    """``source`` copied to ``target`` with the tensors named in ``replace`` given new bytes and type."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for t in reader.tensors:
        data, qtype = replace.get(t.name, (t.data, t.tensor_type))
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.TQ1_0])
def test_unsupported_ggml_type_names_the_tensor_and_the_supported_types(smollm2_gguf_path, tmp_path, qtype):
    rows, cols = 576, 1536  # blk.3.ffn_down: [hidden, intermediate]; 1536 is six blocks of 256
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    packed = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    path = rewrite(smollm2_gguf_path, tmp_path / "odd-type.gguf", {"blk.3.ffn_down.weight": (packed, qtype)})
    with pytest.raises(ModelLoadError) as info:
        LLM(str(path), num_blocks=16)
    message = str(info.value)
    assert message.startswith(f"{path}: tensor blk.3.ffn_down.weight: GGUF quant type {qtype.name} is not supported")
    assert "supported: F32, F16, BF16, Q4_0" in message and "Q6_K" in message


def _patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    patched = bytearray(data)
    patched[offset : offset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return bytes(patched)


def _tensor_field_offsets(path):
    """Byte offsets of the first tensor's n_dims, first dim and data-offset fields, and its name."""
    info = gguf.GGUFReader(path).tensors[1]
    parts, at = info.field.parts, info.field.offset
    n_dims_at = at + sum(int(p.nbytes) for p in parts[:2])
    return n_dims_at, n_dims_at + 4, at + sum(int(p.nbytes) for p in parts[:5]), info.name, int(parts[5][0])


def test_corrupt_headers_fail_with_the_file_and_tensor_named(small_gguf_path, tmp_path):
    data = small_gguf_path.read_bytes()
    n_dims_at, dim_at, offset_at, name, offset = _tensor_field_offsets(small_gguf_path)
    (tensor_count,) = struct.unpack_from("<Q", data, 8)
    cases = {
        "absurd tensor count": (_patch(data, 8, "<Q", 2**62), "header is truncated"),
        "one tensor more than written": (
            _patch(data, 8, "<Q", tensor_count + 1),
            "has 0 dimensions; GGUF tensors have 1 to 4",
        ),
        "absurd key-value count": (_patch(data, 16, "<Q", 2**62), "header is truncated"),
        "absurd dimension count": (_patch(data, n_dims_at, "<I", 2**31), "header is truncated"),
        "absurd dimension": (_patch(data, dim_at, "<Q", 2**62), f"file is truncated: tensor '{name}' ends at byte"),
        "offset past the end": (_patch(data, offset_at, "<Q", 2**40), f"file is truncated: tensor '{name}'"),
        "unaligned offset": (
            _patch(data, offset_at, "<Q", offset + 4),
            f"tensor '{name}' data offset {offset + 4} is not a multiple of the file's alignment 32",
        ),
        "overlapping tensors": (_patch(data, offset_at, "<Q", 0), f"data overlaps tensor '{name}'"),
        "truncated tensor data": (data[:-100], "file is truncated: tensor 'output.weight' ends at byte"),
    }
    for case, (broken, expected) in cases.items():
        path = tmp_path / f"{case.replace(' ', '-')}.gguf"
        path.write_bytes(broken)
        with pytest.raises(ModelLoadError) as info:
            LLM(str(path), num_blocks=16)
        assert str(info.value).startswith(f"{path}: ") and expected in str(info.value), (case, str(info.value))


def test_tensor_that_does_not_fit_the_model_frees_the_partly_loaded_one(smollm2_gguf_path, tmp_path, monkeypatch):
    """The last layer's query matrix has the wrong width: loading fails after most weights are in,
    and the caller holding the error holds no model (its memory is returned)."""
    built = []
    build = model_loader.build_model

    def recording_build(*args, **kwargs):
        model = build(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr(model_loader, "build_model", recording_build)
    wrong = gguf.quants.quantize(np.ones((576, 512), dtype=np.float32), Q.Q8_0)
    path = rewrite(smollm2_gguf_path, tmp_path / "wrong-shape.gguf", {"blk.29.attn_q.weight": (wrong, Q.Q8_0)})
    with pytest.raises(ModelLoadError) as info:
        LLM(str(path), num_blocks=16)
    assert re.match(
        rf"{re.escape(str(path))}: model\.layers\.29\.self_attn\.qkv_proj shard 'q': expected packed \w+ rows",
        str(info.value),
    ), str(info.value)
    gc.collect()
    assert len(built) == 1 and built[0]() is None, "the half-loaded model is still referenced"
    assert info.value.__traceback__ is not None  # the error keeps its traceback, only the frames' locals go


class OneTensorPerLayer:
    """A QuantConfig stand-in: every layer's GGUF weight is one tensor of ``qtype`` (fused in the file)."""

    def __init__(self, qtype: Q) -> None:
        self.qtype = qtype

    def get_quant_method(self, layer, prefix):
        return GGUFLinearMethod([(None, self.qtype.name)])

    get_linear_method = get_quant_method


def test_fused_projection_in_one_gguf_tensor_is_refused_under_tensor_parallelism():
    with pytest.raises(
        ConfigError,
        match="model.layers.0.self_attn.qkv_proj: a GGUF tensor holding several fused "
        "projections cannot be split for tensor parallelism",
    ):
        QKVParallelLinear(
            256,
            64,
            4,
            2,
            quant_config=OneTensorPerLayer(Q.Q8_0),
            prefix="model.layers.0.self_attn.qkv_proj",
            tp_size=2,
            tp_rank=0,
        )
    with pytest.raises(ConfigError, match="model.layers.0.mlp.gate_up_proj: a GGUF tensor holding several fused"):
        MergedColumnParallelLinear(
            256,
            [512, 512],
            quant_config=OneTensorPerLayer(Q.Q4_K),
            prefix="model.layers.0.mlp.gate_up_proj",
            tp_size=2,
            tp_rank=1,
        )
    layer = MergedColumnParallelLinear(256, [512, 512], quant_config=OneTensorPerLayer(Q.Q4_K), tp_size=1, tp_rank=0)
    assert layer.gguf_rows == [1024]  # on one device the fused tensor loads whole
