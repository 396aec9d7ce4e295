"""The SigLIP vision tower of Gemma 3 (transformers' ``SiglipVisionModel`` without its pooling head).

One image of ``image_size`` pixels square is cut into ``patch_size`` patches (a strided
convolution), each patch gets its learned position embedding, then pre-norm transformer blocks
with full (non-causal) attention among the patches and a final LayerNorm::

    [3, S, S] -> conv (p x p, stride p) -> [(S/p)^2, d] + position_embedding
              -> blocks: x + attn(LN1(x)); x + fc2(act(fc1(LN2(x))))  -> post_layernorm

The tower runs once per image inside a prefill step; its layers are plain ``nn`` modules (not
the paged-attention layers of the decoder) and it is not split across tensor-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.errors import ConfigError

#: ``hidden_act`` names -> activation
ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ConfigError(f"SigLIP hidden_size {dim} is not a multiple of num_attention_heads {num_heads}")
        self.num_heads = num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, d]`` (one image's patches) -> ``[N, d]``: every patch attends to every patch."""
        n, d = x.shape
        q, k, v = (
            proj(x).view(n, self.num_heads, -1).transpose(0, 1) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # [H, N, d / H]
        return self.out_proj(out.transpose(0, 1).reshape(n, d))


class SiglipMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ConfigError(f"SigLIP hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[act]
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, dim: int, hidden: int, num_heads: int, eps: float, act: str) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = SiglipAttention(dim, num_heads)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = SiglipMLP(dim, hidden, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, dim: int, image_size: int, patch_size: int, num_channels: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(num_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.position_embedding = nn.Embedding((image_size // patch_size) ** 2, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[3, S, S]`` -> ``[(S / p)^2, d]``, patches row-major."""
        patches = self.patch_embedding(pixel_values[None].to(self.patch_embedding.weight.dtype))[0]  # [d, S/p, S/p]
        return patches.flatten(1).t() + self.position_embedding.weight


class SiglipVisionTransformer(nn.Module):
    """The module docstring's tower; built from a checkpoint's ``vision_config``. Its names are
    transformers' under ``vision_model.`` (``embeddings``, ``encoder.layers.N``, ``post_layernorm``)."""

    def __init__(self, vision_config: dict[str, Any]) -> None:
        super().__init__()
        dim = int(vision_config.get("hidden_size", 768))
        self.image_size = int(vision_config.get("image_size", 224))
        self.patch_size = int(vision_config.get("patch_size", 16))
        if self.image_size % self.patch_size:
            raise ConfigError(f"SigLIP image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        eps = float(vision_config.get("layer_norm_eps", 1e-6))
        self.num_channels = int(vision_config.get("num_channels", 3))
        self.embeddings = SiglipVisionEmbeddings(dim, self.image_size, self.patch_size, self.num_channels)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            SiglipEncoderLayer(
                dim,
                int(vision_config.get("intermediate_size", 3072)),
                int(vision_config.get("num_attention_heads", 12)),
                eps,
                vision_config.get("hidden_act", "gelu_pytorch_tanh"),
            )
            for _ in range(int(vision_config.get("num_hidden_layers", 12)))
        )
        self.post_layernorm = nn.LayerNorm(dim, eps=eps)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image ``[num_channels, image_size, image_size]`` -> ``[patches_per_side^2, hidden]``."""
        expected = [self.num_channels, self.image_size, self.image_size]
        if list(pixel_values.shape) != expected:
            raise ConfigError(f"SigLIP takes pixels of shape {expected}; got {list(pixel_values.shape)}")
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
