"""Writing GGUF files from a transformers model's tensors, as llama.cpp's converter lays them out
(the per-architecture renaming and relayout is the caller's), and a transformers model holding
the values such a file stores (the reference for quantized files)."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q


def write_gguf(
    path,
    arch: str,
    tensors: dict[str, torch.Tensor],
    metadata: Callable[[gguf.GGUFWriter], None],
    vocab_size: int,
    quantized: tuple[str, ...] = (),
    prepacked: dict[str, tuple[np.ndarray, Q]] | None = None,
) -> dict[str, torch.Tensor]:
    """``tensors`` (GGUF names) as a GGUF of ``arch``: float32, or Q8_0 where a name contains one of
    ``quantized``; ``prepacked`` adds tensors already packed by the caller (uint8 rows of blocks, their
    type) as they are; ``metadata(writer)`` adds the architecture's keys, this a tiny GPT-2 style
    vocabulary of ``vocab_size`` tokens. Returns the values of ``tensors`` the file holds, by GGUF name."""
    writer = gguf.GGUFWriter(path, arch)
    metadata(writer)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<s>", "</s>", "a", "b", "ab", *(f"t{i}" for i in range(5, vocab_size))])
    writer.add_token_types([3, 3, *([1] * (vocab_size - 2))])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    stored = {}
    for name, tensor in tensors.items():
        array = tensor.float().contiguous().numpy()
        if any(part in name for part in quantized):
            packed = gguf.quants.quantize(array, Q.Q8_0)
            writer.add_tensor(name, packed, raw_dtype=Q.Q8_0)
            array = gguf.quants.dequantize(packed, Q.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
        stored[name] = torch.from_numpy(np.array(array))
    for name, (data, qtype) in (prepacked or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def model_holding(reference, values: dict[str, torch.Tensor]):
    """A transformers model of ``reference``'s config with ``reference``'s weights, except the HF
    tensors named in ``values``, which take those values (e.g. what a Q8_0 file holds)."""
    model = transformers.AutoModelForCausalLM.from_config(
        reference.config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    state = reference.state_dict()
    changed = [name for name, value in values.items() if not torch.equal(state[name], value)]
    assert changed, "the file holds the reference's values exactly: nothing quantized"
    model.load_state_dict({**state, **values})
    return model
