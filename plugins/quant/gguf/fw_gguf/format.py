"""The GGUF weight format: config, tokenizer and (packed) weights from llama.cpp files."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from framework.errors import ModelLoadError
from framework.loader.format import WeightFormat
from framework.tokenizer import Tokenizer

from .config import (
    hf_config_from_gguf,
    norm_weight_offset,
    qk_unpermute_heads,
    split_per_head_norm,
    tensor_name_map,
    unpermute_qk,
)
from .dequant import UnsupportedQuantTypeError, as_quant_type
from .gemma4 import GEMMA4_ARCHITECTURES, complete_gemma4_config, gemma4_tensor_types, split_gate_up
from .gpt_oss import GPT_OSS_ARCHITECTURES, experts_are_mxfp4, mxfp4_expert_tensors
from .grouped_moe import GROUPED_MOE_ARCHITECTURES, kv_b_from_split, loads_as_float
from .hybrid import HYBRID_ARCHITECTURES, HybridLayout, fuse_qkvz, norm_is_shifted, to_hf_layout
from .lazy import GGUFTensorSlice
from .mmproj import VISION_TEXT_ARCHITECTURES, Projector, ProjectorError, find_projector, vision_hf_config
from .reader import GGUFError, open_gguf_model, resolve_gguf_files
from .rope_freqs import llama3_scaling_from_factors
from .tokenizer import chat_template, special_token_ids, stop_token_ids, tokenizer_from_gguf

log = logging.getLogger("fw.loader")


class GGUFFormat(WeightFormat):
    """A GGUF model: a ``.gguf`` file, the first shard of a split, or a directory holding one.

    A Qwen2.5-VL / Qwen3-VL / Gemma 3 text GGUF (``qwen2vl``, ``qwen3vl``, ``qwen3vlmoe``, ``gemma3``) takes
    images through its llama.cpp vision projector: the ``mmproj*.gguf`` beside it (:func:`~fw_gguf.mmproj.find_projector`), or
    the file :meth:`use_projector` names (``--mmproj``). Without one it is served as its text model
    and :meth:`text_only_reason` says where fw looked.
    """

    name = "gguf"

    @classmethod
    def detect(cls, path: Path, file: str | None = None) -> bool:
        target = path / file if file else path
        if target.is_file():
            return target.suffix == ".gguf"
        return target.is_dir() and any(target.glob("*.gguf"))

    def __init__(self, path: Path, file: str | None = None) -> None:
        target = path / file if file else path
        try:
            self.files = resolve_gguf_files(target)
            self.model = open_gguf_model(self.files[0])
        except GGUFError as exc:
            raise ModelLoadError(str(exc)) from None
        self.metadata = self.model.metadata
        self.arch = self.model.architecture
        try:
            self._text_config = self._config = hf_config_from_gguf(self.metadata, self.model.tensors.keys())
            self._names = tensor_name_map(self.arch, int(self._config["num_hidden_layers"]))
            self._add_longrope_factors()
            self._add_llama3_factors()
            if self.arch in GEMMA4_ARCHITECTURES:
                complete_gemma4_config(self._config, self.model.tensors)
            self._hybrid = HybridLayout(self.arch, self._config) if self.arch in HYBRID_ARCHITECTURES else None
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"{self.files[0]}: cannot build a model config from its metadata: {exc}") from None
        for info in self.model.tensors.values():
            try:
                as_quant_type(info.qtype)
            except UnsupportedQuantTypeError as exc:
                raise ModelLoadError(f"{self.files[0]}: tensor {info.name}: {exc}") from None
        self.projector: Projector | None = None
        self._text_only_reason: str | None = None
        self._projector_error: ModelLoadError | None = None  # the found projector's, unless --mmproj replaces it
        if self.arch in VISION_TEXT_ARCHITECTURES:
            try:
                self.use_projector(find_projector(self.files[0]))
            except ModelLoadError as exc:  # raised by hf_config unless --mmproj names another
                self._projector_error = ModelLoadError(
                    f"{exc} (found beside the model; --mmproj PATH names another, --mmproj none serves the text model)"
                )

    def use_projector(self, path: Path | None, why: str | None = None) -> None:
        """Take images through the vision projector at ``path`` (an ``mmproj*.gguf``), or serve the
        text model (None; ``why`` says why, else that none was found beside the model). Raises
        ModelLoadError for a file that is not a projector this model takes."""
        self.projector, self._config, self._projector_error = None, self._text_config, None
        if path is None:
            if self.arch in VISION_TEXT_ARCHITECTURES:
                self._text_only_reason = (
                    f"this {self.arch} GGUF takes images through its llama.cpp vision projector, an mmproj*.gguf "
                    + (
                        why
                        or f"file, and fw found none beside it in {self.files[0].parent} (name one with --mmproj PATH)"
                    )
                )
            return
        if self.arch not in VISION_TEXT_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: a vision projector (--mmproj) needs a vision model's text GGUF "
                f"({', '.join(VISION_TEXT_ARCHITECTURES)}); {self.files[0].name} is {self.arch!r}"
            )
        try:
            projector = Projector(path)
            self._config = vision_hf_config(self._text_config, self.metadata, projector)
        except (GGUFError, ProjectorError) as exc:
            raise ModelLoadError(str(exc)) from None
        for info in projector.tensors.values():
            try:
                as_quant_type(info.qtype)
            except UnsupportedQuantTypeError as exc:
                raise ModelLoadError(f"{path}: tensor {info.name}: {exc}") from None
        self.projector, self._text_only_reason = projector, None
        log.info("vision projector: %s (%s)", path, projector.projector_type)

    @property
    def wants_projector(self) -> bool:
        """Whether this is a vision model's text GGUF with no projector found beside it (the engine
        then looks in its Hub repo, :func:`framework.loader.source.hub_projector`)."""
        return self.arch in VISION_TEXT_ARCHITECTURES and self.projector is None and self._projector_error is None

    def text_only_reason(self) -> str | None:
        return self._text_only_reason

    def preprocessor_config(self) -> dict[str, Any]:
        return self.projector.preprocessor_config() if self.projector is not None else {}

    def _add_longrope_factors(self) -> None:
        """Phi-3 LongRoPE: llama.cpp keeps the short and long factors as tensors, not metadata."""
        long, short = (
            self.model.tensors.get("rope_factors_long.weight"),
            self.model.tensors.get("rope_factors_short.weight"),
        )
        if long is None or short is None:
            return
        scaling = {
            "rope_type": "longrope",
            "long_factor": long.dequantize(torch.float32).tolist(),
            "short_factor": short.dequantize(torch.float32).tolist(),
        }
        if (factor := self.metadata.get(f"{self.arch}.rope.scaling.attn_factor")) is not None:
            scaling["attention_factor"] = factor
        if (original := self.metadata.get(f"{self.arch}.rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = original
        self._config["rope_scaling"] = scaling

    def _add_llama3_factors(self) -> None:
        """Llama 3.1+ and Llama 4: llama.cpp keeps `llama3` RoPE scaling as ``rope_freqs`` factors."""
        freqs = self.model.tensors.get("rope_freqs.weight")
        if freqs is None or self.arch not in ("llama", "llama4"):
            return
        rotary_dim = self.metadata.get(f"{self.arch}.rope.dimension_count") or self._config["head_dim"]
        factors = freqs.dequantize(torch.float32).tolist()
        scaling = llama3_scaling_from_factors(factors, self._config["rope_theta"], rotary_dim)
        if scaling is not None:
            self._config["rope_scaling"] = scaling

    def hf_config(self) -> dict[str, Any]:
        if self._projector_error is not None:
            raise self._projector_error
        return dict(self._config)

    def generation_config(self) -> dict[str, Any]:
        return {"eos_token_id": stop_token_ids(self.metadata)}

    def tokenizer(self) -> Tokenizer:
        special = special_token_ids(self.metadata)
        backend = tokenizer_from_gguf(self.metadata)
        text = lambda key: None if special.get(key) is None else backend.id_to_token(special[key])  # noqa: E731
        return Tokenizer(
            backend,
            chat_template(self.metadata),
            bos_token=text("bos"),
            eos_token=text("eos"),
            pad_token=text("pad"),
            extra_eos_token_ids=frozenset(stop_token_ids(self.metadata)),
        )

    def _is_matrix(self, hf_name: str, info: Any) -> bool:
        """Weight matrices stay as GGUF bytes (handled by the gguf LinearMethod); the rest are floats
        (also the DeepSeek-V3-style routers and MLA's kv_b_proj, which fw keeps unquantized, and
        the DeltaNet conv weights)."""
        if self.arch in GROUPED_MOE_ARCHITECTURES and loads_as_float(hf_name):
            return False
        if hf_name.endswith(".linear_attn.conv1d.weight"):
            return False
        if hf_name.endswith(".in_proj_qkvz.weight"):  # Qwen3-Next: packed if attn_gate, joining it, is alike
            return self.model.tensors[info.name.replace("attn_qkv", "attn_gate")].qtype == info.qtype
        return len(info.shape) == 2 and hf_name.endswith(".weight") and "norm" not in hf_name

    def quantization_config(self) -> dict[str, Any]:
        """``tensor_types`` maps each HF weight-matrix and expert-stack name to its GGUF type name;
        ``input_orders`` names the matrices whose input columns the file keeps in another order
        (Qwen3.5's tiled ``out_proj``: ``fw_gguf.hybrid``)."""
        types = {}
        for name, info in self.model.tensors.items():
            hf_name = self._names.get(name)
            if hf_name and (self._is_matrix(hf_name, info) or len(info.shape) == 3 and ".experts." in hf_name):
                types[hf_name] = as_quant_type(info.qtype).name
        if self.arch in GEMMA4_ARCHITECTURES:
            types = gemma4_tensor_types(types)
        orders = self._hybrid.input_orders(list(types)) if self._hybrid is not None else {}
        return {"quant_method": "gguf", "tensor_types": types, "input_orders": orders}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names with packed uint8 rows (matrices, any GGUF type) or float tensors (norms, biases).

        MoE experts stacked per projection (``[experts, out, in]``) come as lazy
        :class:`~fw_gguf.lazy.GGUFTensorSlice` objects: the packed-expert method
        (``fw_gguf.moe``) copies their bytes; FusedMoE's plain weights (the CPU) dequantize only
        this rank's features, in the model's dtype, on the model's device.
        """
        offset = norm_weight_offset(self.arch)
        for name, info in self.model.tensors.items():
            hf_name = self._names.get(name)
            if hf_name is None or hf_name.endswith(".v_b_proj.weight") or self._joins_qkvz(hf_name):
                continue  # llama.cpp-only tensors (rope_freqs, ...); attn_v_b joins attn_k_b below, attn_gate attn_qkv
            if hf_name.endswith(".k_b_proj.weight"):  # MLA: llama.cpp's split kv_b_proj, joined back
                v_b = self.model.tensors[name.replace("attn_k_b", "attn_v_b")]
                yield hf_name.replace("k_b_proj", "kv_b_proj"), kv_b_from_split(info.dequantize(), v_b.dequantize())
                continue
            if hf_name.endswith(".in_proj_qkvz.weight"):  # Qwen3-Next: llama.cpp's split in_proj_qkvz, joined back
                gate = self.model.tensors[name.replace("attn_qkv", "attn_gate")]
                packed = self._is_matrix(hf_name, info)
                parts = (info.data, gate.data) if packed else (info.dequantize(), gate.dequantize())
                yield hf_name, fuse_qkvz(self._hybrid, *parts)
                continue
            if len(info.shape) == 3:  # an expert stack
                if self._is_mxfp4_gpt_oss_stack(hf_name):  # fw_fp4's method takes the checkpoint layout
                    yield from mxfp4_expert_tensors(hf_name, info.data)
                    continue
                if hf_name.endswith(".gate_up_proj.weight"):  # Gemma 4: gate and up in one stack
                    yield from split_gate_up(hf_name, GGUFTensorSlice(info))
                    continue
                yield hf_name, GGUFTensorSlice(info)
                continue
            tensor = info.data if self._is_matrix(hf_name, info) else info.dequantize(torch.float32)
            heads = qk_unpermute_heads(self.metadata, name)
            if heads is not None:
                tensor = unpermute_qk(tensor, heads)  # whole rows: works on packed bytes too
            if hf_name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
                tensor = tensor.unsqueeze(0)  # llama.cpp stores Qwen2-MoE's [1, hidden] gate as a vector
            if self._hybrid is not None:
                tensor = to_hf_layout(self._hybrid, hf_name, tensor)
            if offset and norm_is_shifted(hf_name):
                tensor = tensor - offset
            if hf_name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
                yield from split_per_head_norm(hf_name, tensor)
                continue
            yield hf_name, tensor
        if self.projector is not None:
            yield from self.projector.iter_weights()

    def _is_mxfp4_gpt_oss_stack(self, hf_name: str) -> bool:
        """A gpt-oss expert stack of a layer whose three stacks are MXFP4 (``fw_gguf.gpt_oss``)."""
        if self.arch not in GPT_OSS_ARCHITECTURES or not hf_name.endswith(".weight") or ".experts." not in hf_name:
            return False
        if getattr(self, "_tensor_types", None) is None:
            self._tensor_types = self.quantization_config()["tensor_types"]
        return experts_are_mxfp4(self._tensor_types, hf_name.rsplit(".", 2)[0])

    def _joins_qkvz(self, hf_name: str) -> bool:
        """Qwen3-Next's ``attn_gate`` (``in_proj_z``), read with ``attn_qkv`` into ``in_proj_qkvz``."""
        return self.arch == "qwen3next" and hf_name.endswith(".linear_attn.in_proj_z.weight")

    def num_weights(self) -> int | None:
        return (self.projector.num_weights() if self.projector is not None else 0) + sum(
            2 if name.endswith(".ffn_gate_up_exps.weight") or self._is_mxfp4_gpt_oss_stack(self._names[name]) else 1
            for name in self.model.tensors
            if name in self._names and ".attn_v_b." not in name and not self._joins_qkvz(self._names[name])
        )

    def checkpoint_bytes(self) -> int | None:
        text = super().checkpoint_bytes()
        return text + self.projector.path.stat().st_size if self.projector is not None and text else text
