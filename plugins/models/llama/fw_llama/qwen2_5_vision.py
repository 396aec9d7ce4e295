"""The Qwen2.5-VL vision tower: patch embedding, windowed ViT blocks with 2-D rotary, patch merger.

``forward(pixel_values [num_patches, C*T*P*P], grid [t, h, w]) -> [num_patches / merge**2, out_hidden]``
for one image. Patches arrive in merge-block order (``qwen2_vl_processor``). Most blocks attend
within windows of ``window_size`` pixels; the blocks of ``fullatt_block_indexes`` attend over the
whole image. Windows are formed over merged blocks::

    merged grid (h/m x w/m), windows of  window_size / patch_size / m  merged blocks per side
    window_index: merged-block order -> window-major order (the hidden rows are permuted by it
    before the blocks and back after the merger)

Attention is dense within each window or image: the windows (or frames) are padded into one
batch, keys past a window's end masked, so each block makes one SDPA call (:class:`Segments`).
The tower runs once per image, inside the prefill step that first reaches its tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from framework.layers import RMSNorm


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def block_positions(grid_h: int, grid_w: int, merge: int) -> torch.Tensor:
    """``[grid_h * grid_w, 2]`` (row, column) of each patch, in merge-block order."""
    rows, cols = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    return torch.stack(
        [rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten()], -1
    )


def window_index(grid_t: int, grid_h: int, grid_w: int, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merged blocks in window-major order, and the windows' patch counts (windows cut at the
    image's edge are smaller; empty ones are dropped)."""
    merged_h, merged_w = grid_h // merge, grid_w // merge
    index = torch.arange(grid_t * merged_h * merged_w).reshape(grid_t, merged_h, merged_w)
    pad_h, pad_w = -merged_h % window, -merged_w % window
    padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    num_h, num_w = (merged_h + pad_h) // window, (merged_w + pad_w) // window
    windows = padded.reshape(grid_t, num_h, window, num_w, window).permute(0, 1, 3, 2, 4)
    windows = windows.reshape(grid_t * num_h * num_w, window * window)
    counts = (windows >= 0).sum(-1)
    order = windows[windows >= 0]
    return order, [int(c) * merge * merge for c in counts if c > 0]


class Segments(NamedTuple):
    """Packed rows cut into segments (windows), as one padded batch ``[num_segments, longest]``.

    ``rows``: each packed row's place in the flattened batch; ``key_mask``: ``[num_segments, 1, 1,
    longest]``, True where a key is a row of the segment (None when all segments are as long).
    """

    num_segments: int
    longest: int
    rows: torch.Tensor
    key_mask: torch.Tensor | None

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> Segments:
        longest = max(lengths)
        starts = torch.arange(len(lengths), device=device) * longest
        sizes = torch.tensor(lengths, device=device)
        rows = torch.repeat_interleave(starts, sizes) + torch.cat([torch.arange(n, device=device) for n in lengths])
        mask = None
        if min(lengths) != longest:
            mask = (torch.arange(longest, device=device) < sizes[:, None]).view(len(lengths), 1, 1, longest)
        return cls(len(lengths), longest, rows, mask)

    def batch(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, heads, head_dim]`` -> ``[segments, heads, longest, head_dim]`` (padding rows zero)."""
        padded = x.new_zeros(self.num_segments * self.longest, *x.shape[1:])
        padded[self.rows] = x
        return padded.view(self.num_segments, self.longest, *x.shape[1:]).transpose(1, 2)

    def unbatch(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`batch`'s inverse: ``[segments, heads, longest, head_dim]`` -> ``[rows, heads, head_dim]``."""
        flat = x.transpose(1, 2).reshape(self.num_segments * self.longest, x.shape[1], x.shape[3])
        return flat[self.rows]


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        num = x.shape[0]
        q, k, v = self.qkv(x).view(num, 3, self.num_heads, self.head_dim).unbind(1)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        out = F.scaled_dot_product_attention(
            segments.batch(q), segments.batch(k), segments.batch(v), attn_mask=segments.key_mask
        )
        return self.proj(segments.unbatch(out).reshape(num, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            nn.Linear(dim, hidden),
            nn.Linear(dim, hidden),
            nn.Linear(hidden, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim, 1e-6), RMSNorm(dim, 1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMLP(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then each ``merge x merge`` block of patches (consecutive rows) through a 2-layer GELU MLP."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2_5VisionTransformer(nn.Module):
    """The tower of a ``vision_config`` (transformers' ``Qwen2_5_VLVisionConfig`` keys)."""

    def __init__(self, vision_config: dict[str, Any]) -> None:
        super().__init__()
        get = vision_config.get
        dim, self.num_heads = int(get("hidden_size", 1280)), int(get("num_heads", 16))
        self.patch_size, self.merge = int(get("patch_size", 14)), int(get("spatial_merge_size", 2))
        self.temporal_patch_size, self.in_channels = int(get("temporal_patch_size", 2)), int(get("in_channels", 3))
        self.window = int(get("window_size", 112)) // self.merge // self.patch_size
        self.full_attention = set(get("fullatt_block_indexes", [7, 15, 23, 31]))
        theta = float((get("rope_parameters") or {}).get("rope_theta") or get("rope_theta") or 10000.0)
        self.theta, self.spatial_dim = theta, dim // self.num_heads // 2  # half a head: row angles, then column angles
        self.patch_embed = nn.Module()
        kernel = (self.temporal_patch_size, self.patch_size, self.patch_size)
        self.patch_embed.proj = nn.Conv3d(self.in_channels, dim, kernel, stride=kernel, bias=False)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, self.num_heads, int(get("intermediate_size", 3420))) for _ in range(int(get("depth", 32)))
        )
        self.merger = PatchMerger(int(get("out_hidden_size", 3584)), dim, self.merge)

    def num_tokens(self, grid: list[int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def forward(self, pixel_values: torch.Tensor, grid: list[int]) -> torch.Tensor:
        t, h, w = grid
        weight = self.patch_embed.proj.weight
        x = F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1))  # the conv, stride = kernel
        unit = self.merge * self.merge
        order, window_lengths = window_index(t, h, w, self.merge, self.window)
        order = order.to(x.device)
        x = x.view(-1, unit, x.shape[-1])[order].view(x.shape)
        positions = block_positions(h, w, self.merge).repeat(t, 1).to(x.device)
        spatial = self.spatial_dim
        inv_freq = 1.0 / self.theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=x.device) / spatial)
        freqs = (positions[..., None].float() * inv_freq).flatten(1)  # [N, head_dim / 2]: rows, then columns
        freqs = freqs.view(-1, unit, freqs.shape[-1])[order].view(freqs.shape)
        cos, sin = torch.cat((freqs, freqs), -1).cos()[:, None], torch.cat((freqs, freqs), -1).sin()[:, None]
        frames = Segments.of([h * w] * t, x.device)  # full attention: each frame on its own
        windows = Segments.of(window_lengths, x.device)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if index in self.full_attention else windows)
        return self.merger(x)[torch.argsort(order)]
