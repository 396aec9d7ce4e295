"""``prefetch_to_l2``: bring a weight into the GPU's L2 cache ahead of the matmul that reads it.

Two ways, both a single launch that changes no value:

* ``bulk``: each lane of a few one-warp programs issues ``cp.async.bulk.prefetch.L2`` for a
  16 KiB chunk (Hopper, compute capability 9.0 and up). Fire-and-forget: the kernel ends as soon
  as the requests are queued, and the copy engine fills L2 behind it.
* ``load``: ``programs`` programs load their share of the bytes with ``evict_last`` and write one
  sum each to a scratch buffer (so nothing is dead code). Works on every CUDA GPU; it ends when
  the bytes have arrived.

``auto`` is ``bulk`` where the chip has it, else ``load``. ``benchmarks/l2_prefetch_probe.py``
measures both against no prefetch; ``framework.layers.weight_prefetch`` is the engine's user.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from framework.ops import check_prefetch_method

BULK_CHUNK_BYTES = 16384  # one cp.async.bulk.prefetch.L2 request (a multiple of 16)
BULK_LANES = 32
LOAD_BLOCK = 2048


@triton.jit
def _load_to_l2_kernel(x_ptr, num_elements, sink_ptr, BLOCK: tl.constexpr):
    """Each program loads a strided share of ``x`` with ``evict_last`` and writes one sum."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, num_elements, programs * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offsets, mask=offsets < num_elements, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(sink_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _bulk_prefetch_kernel(x_ptr, num_bytes, sink_ptr, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Each lane asks for ``CHUNK`` bytes at a time to be brought into L2; nothing waits for them."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    lanes = tl.arange(0, LANES)
    issued = tl.zeros([LANES], tl.int32)
    for start in range(pid * LANES * CHUNK, num_bytes, programs * LANES * CHUNK):
        offsets = start + lanes * CHUNK
        pointers = x_ptr + tl.where(offsets < num_bytes, offsets, 0)
        issued += tl.inline_asm_elementwise(
            asm=f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK};\n\tmov.u32 $0, 1;",
            constraints="=r,l", args=[pointers], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + pid * LANES + lanes, issued)


@functools.cache
def _has_bulk_prefetch(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


@functools.cache
def _sink(device: torch.device) -> torch.Tensor:
    """Scratch the kernels write to; one per device, allocated before any graph capture uses it."""
    return torch.empty(256 * BULK_LANES, dtype=torch.float32, device=device)


def prefetch_to_l2(tensor: torch.Tensor, max_bytes: int, method: str = "auto", programs: int = 16) -> None:
    """Bring the first ``max_bytes`` of contiguous ``tensor`` into L2 (see the module docstring).

    Raises ``ValueError`` for an unknown method and for ``bulk`` on a GPU before Hopper. A tensor
    whose address is not 16-byte aligned (which ``bulk`` needs) is prefetched by ``load``.
    """
    check_prefetch_method(method)
    if not tensor.is_cuda or not tensor.is_contiguous() or max_bytes <= 0:
        return
    has_bulk = _has_bulk_prefetch(tensor.device.index or 0)
    if method == "bulk" and not has_bulk:
        raise ValueError(f"prefetch method 'bulk' needs compute capability 9.0 (Hopper) or newer; "
                         f"{torch.cuda.get_device_name(tensor.device)} has "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(tensor.device)))}: use 'load' or 'auto'")
    programs = min(programs, 256)
    sink = _sink(tensor.device)
    if method == "auto":
        method = "bulk" if has_bulk else "load"
    if method == "bulk" and tensor.data_ptr() % 16:
        method = "load"
    num_bytes = min(max_bytes, tensor.numel() * tensor.element_size())
    if method == "bulk":
        num_bytes = num_bytes // BULK_CHUNK_BYTES * BULK_CHUNK_BYTES  # whole requests only
        if num_bytes:
            _bulk_prefetch_kernel[(programs,)](tensor.view(-1).view(torch.uint8), num_bytes, sink,
                                               CHUNK=BULK_CHUNK_BYTES, LANES=BULK_LANES, num_warps=1)
        return
    elements = num_bytes // tensor.element_size()
    if elements:
        _load_to_l2_kernel[(programs,)](tensor.view(-1), elements, sink, BLOCK=LOAD_BLOCK, num_warps=8)
