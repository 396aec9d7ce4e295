"""One pass of calibration text through the source model, collecting each decoder linear layer's
input statistics: the Hessian ``sum x x^T`` (GPTQ), the mean absolute input per channel and a sample
of input rows (AWQ). Every layer sees the 16-bit model's activations (one pass, not layer by layer:
simpler and cheaper than the papers' sequential schedule, at some cost in accuracy)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

MAX_SAMPLE_ROWS = 512


@dataclass(slots=True)
class InputStats:
    hessian: Tensor | None = None
    abs_sum: Tensor | None = None
    num_rows: int = 0
    sample: list[Tensor] = field(default_factory=list)

    def add(self, x: Tensor, want_hessian: bool) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        if want_hessian:
            product = x.t() @ x
            self.hessian = product if self.hessian is None else self.hessian + product
        absolute = x.abs().sum(0)
        self.abs_sum = absolute if self.abs_sum is None else self.abs_sum + absolute
        self.num_rows += x.shape[0]
        kept = sum(s.shape[0] for s in self.sample)
        if kept < MAX_SAMPLE_ROWS:
            step = max(1, x.shape[0] // 64)
            self.sample.append(x[::step][: MAX_SAMPLE_ROWS - kept].clone())

    @property
    def mean_abs(self) -> Tensor:
        return self.abs_sum / max(1, self.num_rows)

    @property
    def rows(self) -> Tensor:
        return torch.cat(self.sample)


def calibration_chunks(tokenizer, text: str, num_samples: int, seq_len: int) -> list[Tensor]:
    """``num_samples`` windows of ``seq_len`` tokens of ``text`` (wrapping around a short text)."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < seq_len:
        ids = ids.repeat(seq_len // max(1, ids.numel()) + 1)
    stride = max(1, (ids.numel() - seq_len) // max(1, num_samples - 1))
    return [
        ids[i * stride : i * stride + seq_len].unsqueeze(0)
        for i in range(num_samples)
        if i * stride + seq_len <= ids.numel()
    ]


def collect_input_stats(
    model: nn.Module, linears: dict[str, nn.Linear], chunks: list[Tensor], want_hessian: bool, progress=None
) -> dict[str, InputStats]:
    """Run ``chunks`` through ``model`` and return every layer of ``linears``' input statistics."""
    stats = {name: InputStats() for name in linears}
    hooks = [
        module.register_forward_pre_hook(lambda _m, args, name=name: stats[name].add(args[0], want_hessian))
        for name, module in linears.items()
    ]
    try:
        with torch.no_grad():
            for chunk in chunks:
                model(chunk.to(next(model.parameters()).device))
                if progress is not None:
                    progress()
    finally:
        for hook in hooks:
            hook.remove()
    return stats
