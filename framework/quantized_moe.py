"""The host side that the quantized MoE kernels share (fw-fp8, fw-gptq, fw-gguf): torch only, no Triton.

Each format's ``quantized_fused_moe`` runs two launches, as the bf16 ``fused_moe``, then sums the
``top_k`` rows of a token in float32::

    gate/up:  act[p]      = silu(x[t] @ w1[e]^T) * (x[t] @ w3[e]^T)      pair p = t * top_k + j, e = topk_ids[t, j]
    down:     per_pair[p] = (act[p] @ w2[e]^T) * topk_weights[t, j]

A program covers ``BLOCK_M`` pairs of one expert, in one of two forms:

* unsorted (decode, below :data:`SORTED_MIN_PAIRS` pairs): one program per pair, its expert read
  straight from ``topk_ids`` (``sorted_ids`` is then ``topk_ids`` too; the kernel uses its program id);
* sorted: the pairs grouped into blocks of ``block_m`` pairs of one expert by the kernel registry's
  ``moe_align_block_size`` op; an expert nobody chose has no block and is never read.

What lives here is what does not depend on how a format packs its weights: :class:`MoEKernelConfig`
(the launch shape of the kernels that slice K), :func:`kernel_can_run` (the activations and device
the kernels take), :func:`pair_blocks` (the form's ids and grid) and :func:`two_launches` (the
buffers between the format's two launches and the final sum). The format keeps its Triton kernels,
its ``quant_type`` parsing and its stack checks. Grids come from shapes only and nothing here syncs
with the host: every call can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from framework.kernels import get_kernel
from framework.ops import MoEActivation

#: From this many (token, expert) pairs the sorted form (blocks of one expert's pairs).
SORTED_MIN_PAIRS = 65
#: The activation dtypes the quantized MoE kernels take (fp32 under the interpreter, 16-bit on the GPU).
ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MoEKernelConfig:
    """One launch shape of a K-slicing quantized MoE kernel: whether pairs are sorted into blocks of
    ``block_m`` (unsorted: one pair a program, padded to ``block_m``), outputs per program, inputs per
    K step and per slice (``sub_k``: a power of two >= :attr:`MIN_SUB_K` dividing ``block_k``), warps,
    stages. A format subclasses it for its own defaults and smallest slice."""

    #: The smallest slice the format's kernel unpacks (``tl.dot``'s smallest K, or a packed word's worth).
    MIN_SUB_K: ClassVar[int] = 16

    sorted: bool
    block_m: int = 16
    block_n: int = 64
    block_k: int = 512
    sub_k: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m is a power of two >= 16 (tl.dot's smallest tile), not {self.block_m}")
        if self.sub_k < self.MIN_SUB_K or self.sub_k & (self.sub_k - 1) or self.block_k % self.sub_k:
            raise ValueError(
                f"sub_k is a power of two >= {self.MIN_SUB_K} dividing block_k; "
                f"got sub_k {self.sub_k}, block_k {self.block_k}"
            )

    def k_step(self, k: int) -> int:
        """The K step of a launch over ``k`` inputs: ``block_k``, or no longer than ``k`` needs (whole slices)."""
        return max(self.sub_k, min(self.block_k, next_power_of_2(k)))

    def launch_meta(self, hidden: Tensor) -> dict:
        """The constexprs and launch options every launch of this shape takes, for activations ``hidden``."""
        return dict(
            FP32=hidden.dtype == torch.float32,
            SORTED=self.sorted,
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            SUB_K=self.sub_k,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints, as ``triton.cdiv``."""
    return -(-a // b)


def kernel_can_run(hidden: Tensor, activation: MoEActivation, *, gelu_tanh: bool = False) -> bool:
    """Whether the kernels take these activations: plain SwiGLU (no clamp, no biases; GeGLU too
    where the format's kernel has its epilogue: ``gelu_tanh=True``), a float dtype of
    :data:`ACT_DTYPES`, on CUDA (or anywhere under ``TRITON_INTERPRET=1``). The format adds its own
    test of the stacks."""
    return (
        activation.swiglu_limit is None
        and (gelu_tanh or not activation.gelu_tanh)
        and activation.w13_bias is None
        and activation.w2_bias is None
        and hidden.dtype in ACT_DTYPES
        and (hidden.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    )


class PairBlocks(NamedTuple):
    """The ids a launch's programs read and how many there are (the grid's first dimension).

    Sorted: ``sorted_ids [num_blocks * block_m]`` pair ids (padding ``>= num_pairs``) and
    ``expert_ids [num_blocks]`` (``-1``: a block with nothing to do). Unsorted: both are
    ``topk_ids.reshape(-1)`` and ``num_programs == num_pairs``."""

    sorted_ids: Tensor
    expert_ids: Tensor
    num_programs: int
    num_pairs: int


def pair_blocks(topk_ids: Tensor, num_experts: int, block_m: int, sorted: bool) -> PairBlocks:
    """The (token, expert) pairs of ``topk_ids [T, top_k]`` in the form ``sorted`` asks for."""
    num_pairs = topk_ids.numel()
    if sorted:
        sorted_ids, expert_ids = get_kernel("moe_align_block_size")(topk_ids, num_experts, block_m)
        return PairBlocks(sorted_ids, expert_ids, expert_ids.numel(), num_pairs)
    expert_ids = topk_ids.reshape(-1)  # one program per pair: its expert straight from topk_ids
    return PairBlocks(expert_ids, expert_ids, num_pairs, num_pairs)


def two_launches(
    hidden: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    inter: int,
    gate_up: Callable[[Tensor], None],
    down: Callable[[Tensor, Tensor, Tensor], None],
) -> Tensor:
    """Run the format's launches and sum each token's rows: ``gate_up(act)`` fills ``act [P, inter]``,
    then ``down(act, per_pair, weights)`` fills ``per_pair [P, H]`` from it with ``weights [P]`` (the
    routing weights in float32), ``P = T * top_k``. Returns a new ``[T, H]`` tensor of ``hidden.dtype``."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    gate_up(act)
    per_pair = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    down(act, per_pair, topk_weights.reshape(-1).float())
    return per_pair.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
