"""The Qwen3-VL vision tower: patch embedding, learned positions resampled to the grid, a ViT with
2-D rotary, the patch merger, and the DeepStack mergers.

``forward(pixel_values [num_patches, C*T*P*P], grid [t, h, w]) -> [num_patches / merge**2,
out_hidden * (1 + len(deepstack_visual_indexes))]`` for one image: the merger's output, then one
block of ``out_hidden`` columns per DeepStack layer (the features of block
``deepstack_visual_indexes[j]`` through ``deepstack_merger_list[j]``), which the decoder adds to
its hidden states after its layer ``j`` (:mod:`fw_llama.qwen3_vl`). Patches arrive in merge-block
order (``qwen2_vl_processor``); every block attends over the whole frame.

The learned position table is a ``side x side`` grid (``side = sqrt(num_position_embeddings)``)
resampled bilinearly (corners aligned) to the image's ``h x w`` patches::

    patch row r  ->  source row y = r * (side - 1) / (h - 1)  (0 when h = 1)
    embedding    =   sum over the 4 taps (floor/floor + 1 of y and of x) of weight * table[tap]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fw_llama.qwen2_5_vision import Segments, VisionAttention, block_positions

#: ``hidden_act`` of the ViT's MLP -> ``F.gelu``'s ``approximate``
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def interpolation_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, 2] taps, [N, 2] weights)``: linear interpolation (corners aligned) of ``size`` points
    on a ``side``-long axis, at the points ``index``."""
    source = index.float() * (side - 1) / max(size - 1, 1)
    floor = source.floor()
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class VisionBlock(nn.Module):
    """Pre-LayerNorm ViT block: ``x + attn(norm1(x))``, then ``+ fc2(gelu(fc1(norm2(.))))``."""

    def __init__(self, dim: int, num_heads: int, hidden: int, approximate: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = nn.Module()
        self.mlp.linear_fc1, self.mlp.linear_fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.approximate = approximate

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        mlp = self.mlp
        return x + mlp.linear_fc2(F.gelu(mlp.linear_fc1(self.norm2(x)), approximate=self.approximate))


class PatchMerger(nn.Module):
    """Each ``merge x merge`` block of patches (consecutive rows) through LayerNorm and a 2-layer
    GELU MLP; the DeepStack mergers normalise the concatenated block (``after_shuffle``), the final
    merger each patch."""

    def __init__(self, out_dim: int, dim: int, merge: int, after_shuffle: bool) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.after_shuffle = after_shuffle
        self.norm = nn.LayerNorm(self.hidden if after_shuffle else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden)) if self.after_shuffle else self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    """The tower of a ``vision_config`` (transformers' ``Qwen3VLVisionConfig`` keys)."""

    def __init__(self, vision_config: dict[str, Any]) -> None:
        super().__init__()
        get = vision_config.get
        dim, num_heads = int(get("hidden_size", 1152)), int(get("num_heads", 16))
        self.patch_size, self.merge = int(get("patch_size", 16)), int(get("spatial_merge_size", 2))
        self.temporal_patch_size, self.in_channels = int(get("temporal_patch_size", 2)), int(get("in_channels", 3))
        act = get("hidden_act", "gelu_pytorch_tanh")
        if act not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"Qwen3-VL vision hidden_act {act!r} is not supported; valid: {sorted(GELU_APPROXIMATIONS)}"
            )
        theta = float((get("rope_parameters") or {}).get("rope_theta") or get("rope_theta") or 10000.0)
        self.theta, self.spatial_dim = theta, dim // num_heads // 2  # half a head: row angles, then column angles
        num_positions = int(get("num_position_embeddings", 2304))
        self.side = int(num_positions**0.5)
        self.patch_embed = nn.Module()
        kernel = (self.temporal_patch_size, self.patch_size, self.patch_size)
        self.patch_embed.proj = nn.Conv3d(self.in_channels, dim, kernel, stride=kernel, bias=True)
        self.pos_embed = nn.Embedding(num_positions, dim)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, num_heads, int(get("intermediate_size", 4304)), GELU_APPROXIMATIONS[act])
            for _ in range(int(get("depth", 27)))
        )
        out = int(get("out_hidden_size", 3584))
        self.merger = PatchMerger(out, dim, self.merge, after_shuffle=False)
        self.deepstack_visual_indexes = list(get("deepstack_visual_indexes", [8, 16, 24]))
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(out, dim, self.merge, after_shuffle=True) for _ in self.deepstack_visual_indexes
        )

    def num_tokens(self, grid: list[int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def position_embeddings(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """``[grid_h * grid_w, dim]``: the learned table resampled to the grid, in merge-block order."""
        positions = block_positions(grid_h, grid_w, self.merge).to(self.pos_embed.weight.device)
        row_taps, row_weights = interpolation_taps(positions[:, 0], grid_h, self.side)
        col_taps, col_weights = interpolation_taps(positions[:, 1], grid_w, self.side)
        taps = (row_taps[:, :, None] * self.side + col_taps[:, None, :]).flatten(1)  # [N, 4]
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
        return (self.pos_embed(taps) * weights[..., None].to(self.pos_embed.weight.dtype)).sum(1)

    def forward(self, pixel_values: torch.Tensor, grid: list[int]) -> torch.Tensor:
        t, h, w = grid
        proj = self.patch_embed.proj
        x = F.linear(pixel_values.to(proj.weight.dtype), proj.weight.view(proj.weight.shape[0], -1), proj.bias)
        x = x + self.position_embeddings(h, w).repeat(t, 1)
        positions = block_positions(h, w, self.merge).repeat(t, 1).to(x.device)
        spatial = self.spatial_dim
        inv_freq = 1.0 / self.theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=x.device) / spatial)
        freqs = (positions[..., None].float() * inv_freq).flatten(1)  # [N, head_dim / 2]: rows, then columns
        angles = torch.cat((freqs, freqs), -1)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        frames = Segments.of([h * w] * t, x.device)
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if index in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(index)](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)
