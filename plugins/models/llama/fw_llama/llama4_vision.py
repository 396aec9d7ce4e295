"""The Llama 4 vision model: a ViT over each tile of an image, then a pixel-shuffle adapter.

``forward(tiles [N, 3, S, S]) -> [N, (S/p)**2 * r**2, projector_output_dim]`` (``p`` the patch
size, ``r`` the ``pixel_shuffle_ratio``), each tile on its own:

    unfold(p, stride p) + linear (no bias)   -> [(S/p)**2 patches, d], row-major
    append class_embedding                   -> [(S/p)**2 + 1, d]   (the class token is last)
    + positional_embedding_vlm, LayerNorm    -> blocks: x + attn(LN(x)); x + MLP(LN(x))
    LayerNorm, drop the class token          -> pixel shuffle -> fc1, GELU, fc2, GELU

The rotary of the attention rotates interleaved pairs (``q[2i], q[2i+1]``, a complex product) of
each head, ``head_dim / 2`` pairs: the first half by the patch's column, the second by its row,
both counted from 1; the class token is not rotated. With ``f_k = theta ** (-4k / head_dim)``::

    angles(row, col) = [(col + 1) f_0 .. (col + 1) f_{h/4 - 1} | (row + 1) f_0 .. (row + 1) f_{h/4 - 1}]

The pixel shuffle (``r`` = 1/2: ``m`` = 2) puts each ``m x m`` block of patches, its patches
row-major, into one feature vector::

    [h, w, d] -> [h/m, w/m, (x[mi, mj] x[mi, mj+1] x[mi+1, mj] x[mi+1, mj+1])]   -> [h/m * w/m, m*m*d]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.errors import ConfigError


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [N, heads, head_dim]`` with each interleaved pair rotated by ``cos, sin [N, 1, head_dim / 2]``."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class Llama4VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tiles, num = x.shape[:2]
        q, k, v = (
            proj(x).view(tiles, num, self.num_heads, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # no mask
        return self.o_proj(out.transpose(1, 2).reshape(tiles, num, -1))


class Llama4VisionMLP(nn.Module):
    """``fc2(GELU(fc1(x)))``; the adapter's variant has no biases and a GELU after ``fc2`` too."""

    def __init__(self, dim_in: int, hidden: int, dim_out: int, bias: bool, act_after: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim_in, hidden, bias=bias), nn.Linear(hidden, dim_out, bias=bias)
        self.act_after = act_after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc2(F.gelu(self.fc1(x)))
        return F.gelu(x) if self.act_after else x


class Llama4VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(dim, eps), nn.LayerNorm(dim, eps)
        self.self_attn = Llama4VisionAttention(dim, num_heads)
        self.mlp = Llama4VisionMLP(dim, hidden, dim, bias=True, act_after=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama4VisionModel(nn.Module):
    """The vision model of a ``vision_config`` (transformers' ``Llama4VisionConfig`` keys); its
    parameter names are the checkpoint's under ``vision_model.``."""

    def __init__(self, vision_config: dict[str, Any]) -> None:
        super().__init__()
        get = vision_config.get
        dim, num_heads = int(get("hidden_size", 768)), int(get("num_attention_heads", 16))
        self.patch_size, self.image_size = int(get("patch_size", 14)), int(get("image_size", 448))
        self.head_dim, self.side = dim // num_heads, self.image_size // self.patch_size
        self.merge = int(round(1 / float(get("pixel_shuffle_ratio", 0.5))))
        hidden = int(get("intermediate_size", 5632))
        if self.head_dim % 4 or self.side % self.merge or hidden != dim * self.merge**2:
            raise ConfigError(
                f"Llama 4 vision config: head_dim {self.head_dim} must be a multiple of 4, the tile's "
                f"{self.side} patches a multiple of {self.merge}, and intermediate_size {hidden} equal to "
                f"hidden_size * {self.merge**2} (what the pixel shuffle feeds the adapter)"
            )
        rope = get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta") or get("rope_theta") or 10000.0)
        self.patch_embedding = nn.Module()
        self.patch_embedding.linear = nn.Linear(int(get("num_channels", 3)) * self.patch_size**2, dim, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(dim))
        self.positional_embedding_vlm = nn.Parameter(torch.empty(self.side**2 + 1, dim))
        eps = 1e-5  # transformers' and Meta's LayerNorms keep torch's default (configs' norm_eps agree)
        self.layernorm_pre, self.layernorm_post = nn.LayerNorm(dim, eps), nn.LayerNorm(dim, eps)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            Llama4VisionBlock(dim, num_heads, hidden, eps) for _ in range(int(get("num_hidden_layers", 34)))
        )
        self.vision_adapter = nn.Module()
        self.vision_adapter.mlp = Llama4VisionMLP(
            hidden, int(get("projector_input_dim", 4096)), int(get("projector_output_dim", 4096)), False, True
        )

    def rotary(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[side**2 + 1, 1, head_dim / 2]``: the patches row-major, then the class token."""
        quarter = self.head_dim // 4
        freqs = self.theta ** (-torch.arange(quarter, dtype=torch.float, device=device) * 4 / self.head_dim)
        index = torch.arange(self.side**2, device=device)
        row, col = index // self.side + 1, index % self.side + 1
        angles = torch.cat((col[:, None] * freqs, row[:, None] * freqs), dim=-1)
        angles = torch.cat((angles, angles.new_zeros(1, 2 * quarter)))[:, None]
        return angles.cos(), angles.sin()

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, side**2, d] -> [N, (side/m)**2, m*m*d]`` (the module docstring's blocks)."""
        m, half = self.merge, self.side // self.merge
        blocks = x.view(x.shape[0], half, m, half, m, x.shape[-1]).permute(0, 1, 3, 2, 4, 5)
        return blocks.reshape(x.shape[0], half * half, -1)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.linear.weight
        patches = F.unfold(tiles.to(weight.dtype), self.patch_size, stride=self.patch_size).transpose(1, 2)
        x = self.patch_embedding.linear(patches)  # [N, side**2, d]
        x = torch.cat((x, self.class_embedding.expand(x.shape[0], 1, -1)), dim=1) + self.positional_embedding_vlm
        x = self.layernorm_pre(x)
        cos, sin = self.rotary(x.device)
        for block in self.model.layers:
            x = block(x, cos, sin)
        x = self.layernorm_post(x)[:, :-1]
        return self.vision_adapter.mlp(self.pixel_shuffle(x))
