"""Gated activations over the kernel registry: ``[..., 2 * d]`` (gate then up) -> ``[..., d]``."""

from __future__ import annotations

from torch import Tensor, nn

from framework.kernels import get_kernel


class SiluAndMul(nn.Module):
    """SwiGLU (Llama, Qwen, Mistral): ``silu(gate) * up``."""

    def __init__(self) -> None:
        super().__init__()
        self._kernel = get_kernel("silu_and_mul")

    def forward(self, x: Tensor) -> Tensor:
        return self._kernel(x)


class GeluTanhAndMul(nn.Module):
    """GeGLU with tanh-approximated GELU (Gemma): ``gelu_tanh(gate) * up``."""

    def __init__(self) -> None:
        super().__init__()
        self._kernel = get_kernel("gelu_tanh_and_mul")

    def forward(self, x: Tensor) -> Tensor:
        return self._kernel(x)
