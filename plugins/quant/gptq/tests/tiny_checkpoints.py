"""Tiny random transformers models rewritten as GPTQ / AWQ / compressed-tensors / Marlin checkpoints
by the independent writers of :mod:`reference_formats`; the transformers model gets the dequantized
weights, so it is the reference the engine must match token for token."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from fw_gptq.quantize.rtn import round_to_nearest
from safetensors.torch import load_file, save_file
from schemes import FormatScheme

LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_checkpoint(path: Path, reference, scheme: FormatScheme) -> None:
    """Rewrite the safetensors model at ``path`` in ``scheme``'s format (in place) and load the
    values it stands for into ``reference`` (the transformers model written there)."""
    tensors = load_file(str(path / "model.safetensors"))
    out, state = {}, reference.state_dict()
    for name, value in tensors.items():
        stem, _, leaf = name.rpartition(".")
        if leaf != "weight" or stem.rpartition(".")[2] not in LINEAR_LEAVES:
            out[name] = value
            continue
        rounded = round_to_nearest(value, scheme.bits, scheme.group_size, scheme.symmetric)  # the integers only
        q, scales = rounded.q.long(), rounded.scales
        zeros = None if rounded.zeros is None else rounded.zeros.long()
        k = value.shape[1]
        g_idx = torch.arange(k) // (k if scheme.group_size == -1 else scheme.group_size)
        if scheme.act_order:  # the integers stay; the groups are assigned in a permuted order
            perm = torch.randperm(k, generator=torch.Generator().manual_seed(k))
            g_idx = torch.empty_like(g_idx).index_copy_(0, perm, g_idx.clone())
        z = torch.full_like(scales, 2 ** (scheme.bits - 1)) if zeros is None else zeros.float()
        if scheme.fmt == "gptq":
            from reference_formats import write_gptq

            written = write_gptq(q, scales, zeros, g_idx, scheme.bits, v2=scheme.v2)
        elif scheme.fmt == "awq":
            from reference_formats import write_awq

            written = write_awq(q, scales, zeros)
        elif scheme.fmt == "marlin":
            from reference_formats import write_marlin

            written = write_marlin(q, scales)
        else:
            from reference_formats import write_compressed

            written = write_compressed(q, scales, zeros, scheme.bits, dtype=torch.float16)
            if scheme.act_order:
                written["weight_g_idx"] = g_idx.to(torch.int32)
        out.update({f"{stem}.{key}": t for key, t in written.items()})
        reference_weight(state, name).copy_(((q.float() - z[g_idx]) * scales[g_idx]).t())
    save_file(out, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = scheme.config()
    (path / "config.json").write_text(json.dumps(config))


def reference_weight(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The transformers tensor (or part) holding checkpoint weight ``name``: itself, or one expert's
    rows of the fused ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``."""
    if name in state:
        return state[name]
    base, expert, projection, _ = name.rsplit(".", 3)
    if projection == "down_proj":
        return state[f"{base}.down_proj"][int(expert)]
    fused = state[f"{base}.gate_up_proj"][int(expert)]
    half = fused.shape[0] // 2
    return fused[:half] if projection == "gate_proj" else fused[half:]
