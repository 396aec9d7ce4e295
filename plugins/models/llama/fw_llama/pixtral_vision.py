"""The Pixtral vision tower (Mistral 3's encoder): a patch convolution, RMSNorm, and pre-norm ViT
blocks with 2-D rotary over the patch grid, attending over the whole image.

``forward(pixel_values [3, H, W], num_layers) -> [H/p * W/p, hidden]`` for one image, patches in
row-major order: the hidden states after the first ``num_layers`` blocks (Mistral 3's
``vision_feature_layer`` picks them; -1 is every block).

The rotary angles of a patch at (row r, column c), ``f`` being the ``head_dim / 2`` frequencies
of a ``head_dim`` rotary::

    angles = [r * f[0], r * f[2], r * f[4], ... | c * f[1], c * f[3], c * f[5], ...]   (head_dim / 2)
    q, k rotate NeoX-style by cat(angles, angles)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.layers import RMSNorm

#: the tower's and projector's ``hidden_act`` names
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class PixtralAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num = x.shape[0]
        q, k, v = (
            proj(x).view(num, self.num_heads, self.head_dim).transpose(0, 1)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # one image: no mask
        return self.o_proj(out.transpose(0, 1).reshape(num, -1))


class PixtralMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int, act: str) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim, 1e-5), RMSNorm(dim, 1e-5)
        self.attention = PixtralAttention(dim, num_heads)
        self.feed_forward = PixtralMLP(dim, hidden, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralVisionTransformer(nn.Module):
    """The tower of a ``vision_config`` (transformers' ``PixtralVisionConfig`` keys); its parameter
    names are the checkpoint's under ``vision_tower.``."""

    def __init__(self, vision_config: dict[str, Any]) -> None:
        super().__init__()
        get = vision_config.get
        dim, num_heads = int(get("hidden_size", 1024)), int(get("num_attention_heads", 16))
        self.patch_size, self.head_dim = int(get("patch_size", 16)), dim // num_heads
        rope = get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"the Pixtral tower takes axial rope only, not {rope.get('rope_type')!r}")
        self.theta = float(rope.get("rope_theta") or get("rope_theta") or 10000.0)
        self.patch_conv = nn.Conv2d(int(get("num_channels", 3)), dim, self.patch_size, self.patch_size, bias=False)
        self.ln_pre = RMSNorm(dim, 1e-5)
        self.transformer = nn.Module()
        act = get("hidden_act", "gelu")
        self.transformer.layers = nn.ModuleList(
            PixtralBlock(dim, num_heads, int(get("intermediate_size", 4096)), act)
            for _ in range(int(get("num_hidden_layers", 24)))
        )

    def rotary(self, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[rows * cols, head_dim]`` of the row-major patch grid (module docstring)."""
        dim = self.head_dim
        freqs = 1.0 / self.theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim)
        row, col = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
        angles = torch.cat((row.reshape(-1, 1) * freqs[0::2], col.reshape(-1, 1) * freqs[1::2]), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, num_layers: int) -> torch.Tensor:
        weight = self.patch_conv.weight
        patches = self.patch_conv(pixel_values.to(weight.dtype)[None])[0]  # [hidden, H/p, W/p]
        rows, cols = patches.shape[1:]
        x = self.ln_pre(patches.flatten(1).t())
        cos, sin = self.rotary(rows, cols, x.device)
        for block in self.transformer.layers[:num_layers]:
            x = block(x, cos, sin)
        return x
