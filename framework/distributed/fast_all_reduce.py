"""A one-shot all-reduce over NVLink peer memory (torch symmetric memory) for small tensors.

NCCL spends tens of microseconds on an all-reduce of a few KiB, even inside a CUDA graph; a
decode step of tensor parallelism runs two per layer. :class:`SymmMemAllReduce` keeps one
buffer in *symmetric memory* (``torch.distributed._symmetric_memory``: every rank allocates the
same buffer and maps its peers' buffers), and sums a tensor with
``torch.ops.symm_mem.one_shot_all_reduce_out``: one kernel in which each rank, after a barrier on
the signal pads, reads every peer's buffer over NVLink and adds them up, then meets the others at
a second barrier (so the buffer may be overwritten by the next call). No host synchronisation
and no allocation outside the caching allocator: the kernel can be captured in a CUDA graph.

The op sums only bf16 and fp32 tensors whose byte size is a multiple of 4 and that fit the
buffer; anything else (and prefill-sized tensors) goes to ``dist.all_reduce`` (NCCL). It reads
peers' memory directly, so every GPU of the group must be on this host with peer access;
NVLink multicast (``multimem_*`` ops) is not needed.

Chosen with ``EngineBuilder(all_reduce=...)`` / ``--all-reduce``: see :func:`resolve_all_reduce`.
"""

from __future__ import annotations

import logging
import socket

import torch
import torch.distributed as dist

from framework.distributed.state import SYMM_MEM_GROUPS_OF_EARLIER_ENGINES, min_over_ranks, note_symm_mem_set_up
from framework.errors import ConfigError, brief

log = logging.getLogger("fw.distributed")

#: The values of ``--all-reduce``: ``auto`` is ``symm_mem`` where every rank's GPU can use it (one
#: host, peer access, compute capability 9.0+, a bf16 or fp32 model, the first such engine of the
#: process), else ``nccl``. Measured on 2xH200: 6.5 us against NCCL's 20 us for 8 KiB
#: inside a CUDA graph (docs/tensor-parallel.md). ``flashinfer`` adds FlashInfer's fused
#: all-reduce + residual add + RMS norm (:mod:`framework.distributed.flashinfer_all_reduce`) to
#: ``symm_mem``; ``auto`` takes it too for bf16 models of one host where its module is built
#: (``EngineBuilder.set_up_all_reduce``).
ALL_REDUCE_CHOICES = ("nccl", "symm_mem", "auto", "flashinfer")

#: The largest symmetric buffer allocated (bytes): one-shot beats NCCL only for small tensors.
MAX_BUFFER_BYTES = 8 * 2**20

#: The dtypes ``torch.ops.symm_mem.one_shot_all_reduce_out`` dispatches on.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def check_all_reduce_name(name: str) -> None:
    """Raise :class:`ConfigError` listing the valid values unless ``name`` is one of them."""
    if name not in ALL_REDUCE_CHOICES:
        raise ConfigError(f"--all-reduce must be one of {', '.join(ALL_REDUCE_CHOICES)}; got {name!r}")


def resolve_all_reduce(name: str, device: torch.device) -> str:
    """What ``--all-reduce name`` means on ``device``: ``nccl``, ``symm_mem``, or ``auto`` (CUDA only:
    ``symm_mem`` if the group turns out to allow it, see :func:`peer_access_problem`).

    Raises :class:`ConfigError` for an unknown name, and for ``symm_mem`` on a device that is not
    CUDA (gloo on CPUs has no peer memory). ``auto`` on a CPU is ``nccl`` (gloo).
    """
    check_all_reduce_name(name)
    if name == "auto":
        return "auto" if device.type == "cuda" else "nccl"
    if name in ("symm_mem", "flashinfer") and device.type != "cuda":
        raise ConfigError(
            f"--all-reduce {name} needs CUDA GPUs with peer access; this engine runs on {device.type} "
            "(gloo has no peer memory): use --all-reduce nccl or auto"
        )
    return name


def all_reduce_for_dtype(name: str, dtype: torch.dtype) -> str:
    """``name`` (as :func:`resolve_all_reduce` returns it) for a model computing in ``dtype``.

    The one-shot op sums only :data:`SUPPORTED_DTYPES`: ``auto`` then keeps NCCL (the op would send
    every sum there anyway), and an explicit ``symm_mem`` raises :class:`ConfigError`.
    """
    if name not in ("symm_mem", "auto") or dtype in SUPPORTED_DTYPES:
        return name
    if name == "symm_mem":
        raise ConfigError(
            f"--all-reduce symm_mem sums bf16 and fp32 tensors; this model runs in {dtype}: "
            "use --dtype bf16 or --all-reduce nccl"
        )
    return "nccl"


def buffer_bytes(max_num_seqs: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The symmetric buffer for the largest decode all-reduce (``max_num_seqs x hidden_size``), capped."""
    return min(max_num_seqs * hidden_size * dtype.itemsize, MAX_BUFFER_BYTES)


#: ``--all-reduce auto`` takes symm_mem only on GPUs of this compute capability and up (Hopper:
#: where it was measured faster than NCCL); ``--all-reduce symm_mem`` forces it on any.
AUTO_MIN_CAPABILITY = (9, 0)


def _set_up_before() -> bool:
    """Whether an earlier engine of this process set symmetric memory up for the current default
    group's name (see :data:`framework.distributed.state.SYMM_MEM_GROUPS_OF_EARLIER_ENGINES`)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    return world is not None and world.group_name in SYMM_MEM_GROUPS_OF_EARLIER_ENGINES


def peer_access_problem(
    device: torch.device, group: dist.ProcessGroup | None = None, *, auto: bool = False
) -> str | None:
    """Why the ranks of ``group`` cannot use the symmetric-memory all-reduce, or None if they can
    (with ``auto``, also None only on GPUs of :data:`AUTO_MIN_CAPABILITY` and up).

    A collective on ``group`` (each rank sends its host name, device ordinal and whether its
    process set symmetric memory up for an earlier engine; a gloo group keeps it off the GPU);
    call it on every rank. Every rank gets the same answer.
    """
    size = dist.get_world_size(group)
    if not 2 <= size <= 8:
        return f"it supports 2 to 8 ranks; this group has {size}"
    mine = (socket.gethostname(), device.index, _set_up_before())
    everyone: list[tuple[str, int, bool] | None] = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    hosts = sorted({host for host, _, _ in everyone})
    if len(hosts) > 1:
        return f"it needs every tensor-parallel rank on one host; the group spans {', '.join(hosts)}"
    if any(set_up for _, _, set_up in everyone):
        return (
            "this process already set symmetric memory up for an earlier engine, and torch keeps that set-up "
            "for the life of the process, so a second one would never complete; start a new process to use it"
        )
    if len({(host, index) for host, index, _ in everyone}) < len(
        everyone
    ):  # e.g. one rank per container, each seeing its GPU as cuda:0
        return "two ranks report the same host and device ordinal, so their GPUs' peer access cannot be checked"
    # every rank checks every pair, so that all of them decide alike
    indices = [index for _, index, _ in everyone]
    blocked = [
        f"cuda:{a} -> cuda:{b}"
        for a in indices
        for b in indices
        if a != b and not torch.cuda.can_device_access_peer(a, b)
    ]
    if blocked:
        return f"it needs peer (P2P) access between the GPUs; no access {', '.join(blocked)}"
    capabilities = {torch.cuda.get_device_capability(index) for index in indices}  # one host: every rank sees the same
    if auto and min(capabilities) < AUTO_MIN_CAPABILITY:
        return (
            f"--all-reduce auto takes it on compute capability {'.'.join(map(str, AUTO_MIN_CAPABILITY))} and up "
            f"(measured on Hopper); these GPUs are {', '.join('.'.join(map(str, c)) for c in sorted(capabilities))} "
            "(--all-reduce symm_mem forces it)"
        )
    return None


class SymmMemAllReduce:
    """Sums small tensors over ``group`` with a one-shot all-reduce on a symmetric buffer of ``max_bytes``.

    Build it on every rank at the same time, on GPUs :func:`peer_access_problem` accepts
    (allocation and rendezvous are collective; the ranks agree on ``host_group``, e.g. a gloo
    group, when given, after allocating); raises :class:`ConfigError` on every rank when the
    allocation fails on any, and on the rank whose rendezvous fails. :meth:`all_reduce` falls back to ``dist.all_reduce`` for what the op cannot sum
    (see :meth:`fits`).
    """

    def __init__(
        self,
        device: torch.device,
        max_bytes: int,
        group: dist.ProcessGroup | None = None,
        host_group: dist.ProcessGroup | None = None,
    ) -> None:
        group = group or dist.group.WORLD
        self.group, self.group_name, self.device = group, group.group_name, device
        self.max_bytes = max(4, max_bytes - max_bytes % 16)  # whole 16-byte vectors: the op's widest loads
        # each step on every rank, then agreement on the host group before the next collective step,
        # so that a rank that fails makes every rank fail (none waits in a rendezvous alone)
        failure = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            with torch.cuda.device(device):
                self.buffer = symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=device)
            self._copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
            self._out = torch.ops.symm_mem.one_shot_all_reduce_out
        except (ImportError, AttributeError, RuntimeError) as error:
            failure = error
        if not min_over_ranks(int(failure is None), host_group or group) and failure is None:
            failure = RuntimeError("another rank could not allocate its symmetric buffer")
        if failure is None:
            try:
                note_symm_mem_set_up(self.group_name)  # even a failed rendezvous may leave its store behind
                with torch.cuda.device(device):
                    self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
            except RuntimeError as error:
                failure = error
        if failure is not None:
            self.buffer = self.handle = None
            raise ConfigError(
                f"--all-reduce symm_mem: torch symmetric memory could not be set up on {device} "
                f"({brief(failure)}); "
                "use --all-reduce nccl"
            ) from failure
        log.info(
            "symmetric-memory all-reduce on %s: %d ranks, %d KiB buffer",
            device,
            dist.get_world_size(group),
            self.max_bytes // 1024,
        )

    def fits(self, x: torch.Tensor) -> bool:
        """Whether the one-shot op can sum ``x`` (same answer on every rank for the same shape and dtype)."""
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in SUPPORTED_DTYPES and x.device == self.device and 0 < nbytes <= self.max_bytes and nbytes % 4 == 0
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (a new tensor; ``x`` itself when NCCL summed it in place)."""
        if not self.fits(x):
            dist.all_reduce(x, group=self.group)
            return x
        x = x.contiguous()
        staged = self.buffer.view(x.dtype)[: x.numel()].view(x.shape)
        out = torch.empty_like(x)
        if self._copy_out is not None and _alignment(x) == _alignment(staged):
            self._copy_out(staged, x, "sum", self.group_name, out)  # copies x into the buffer in the same kernel
        else:
            staged.copy_(x)
            self._out(staged, "sum", self.group_name, out)
        return out

    def close(self) -> None:
        """Drop the buffer (before the process group goes)."""
        self.handle = self.buffer = None


def _alignment(x: torch.Tensor) -> int:
    """The vector width (4, 8 or 16 bytes) the op uses for ``x``: what its offset and size are multiples of."""
    offset, nbytes = x.storage_offset() * x.element_size(), x.numel() * x.element_size()
    for width in (16, 8, 4):
        if offset % width == 0 and nbytes % width == 0:
            return width
    return 0
