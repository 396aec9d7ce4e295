"""The tensor-parallel process group of this process: rank, size and the collectives layers use.

One process per rank. Rank 0 runs the engine core (scheduler, sampler); every rank runs the
model on its shard. Two groups:

* the *data* group (the default group: NCCL on GPUs, gloo on CPUs): the all-reduces inside the
  model and the logits gather to rank 0, with ``--distributed-timeout`` so a hung rank becomes an error;
* the *control* group (always gloo, no practical timeout): rank 0 broadcasts each step's
  small message to the workers, who may wait there for as long as the server idles.

Before :func:`init_tensor_parallel` (or with one rank) ``get_tp_size()`` is 1 and the layers
build unsharded, so single-device code never touches ``torch.distributed``.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from framework.errors import ConfigError, brief

log = logging.getLogger("fw.distributed")

#: The workers' wait for rank 0's next step: effectively forever (an idle server sends nothing).
CONTROL_TIMEOUT = datetime.timedelta(days=30)


@dataclass(slots=True)
class TensorParallelState:
    """What this process is in the tensor-parallel group (``rank`` of ``size``)."""

    rank: int = 0
    size: int = 1
    control_group: Any = None
    #: the symmetric-memory all-reduce (``--all-reduce symm_mem``); None: NCCL / gloo only
    fast_all_reduce: Any = None
    fused_all_reduce_norm: Any = None  # FlashInferFusedAllReduceNorm with --all-reduce flashinfer
    #: the group name this engine set symmetric memory up on (see note_symm_mem_set_up)
    symm_mem_group: str | None = None


_state = TensorParallelState()

#: Names of the process groups that earlier engines of this process set torch symmetric memory up
#: for. torch keeps each name's set-up (its store) for the life of the process, and a later engine
#: gets a group of the same name (names restart once a group is destroyed), so its rendezvous would
#: wait forever on the old store: symmetric memory is set up by one engine per process and name.
#: An engine's group is added when it leaves (:func:`destroy_tensor_parallel`).
SYMM_MEM_GROUPS_OF_EARLIER_ENGINES: set[str] = set()


def note_symm_mem_set_up(group_name: str) -> None:
    """Record that this engine sets symmetric memory up on ``group_name`` (before its rendezvous)."""
    _state.symm_mem_group = group_name


def get_tp_rank() -> int:
    """This process's tensor-parallel rank (0 without tensor parallelism)."""
    return _state.rank


def get_tp_size() -> int:
    """The number of tensor-parallel ranks (1 without tensor parallelism)."""
    return _state.size


def is_tensor_parallel() -> bool:
    return _state.size > 1


def rendezvous_store(
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    check_workers: Callable[[], str | None] | None = None,
) -> dist.TCPStore:
    """Meet every rank at ``master_addr:master_port`` (rank 0 hosts the TCP store).

    Rank 0 listens on ``master_addr`` only (torch's own store would listen on every interface):
    the store accepts any process that reaches it, so the node network must be private.
    Raises :class:`ConfigError` naming the address and the ranks that never arrived when the
    rendezvous does not complete within ``timeout_s``, or at once when ``check_workers()`` (this
    node's worker processes) reports one that exited.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        listen_fd = _listen(master_addr, master_port) if rank == 0 else None
        store = dist.TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
    except Exception as error:  # torch raises RuntimeError / DistNetworkError with a long text
        role = "host the rendezvous on" if rank == 0 else "reach rank 0 at"
        raise ConfigError(
            f"tensor-parallel rank {rank} could not {role} {master_addr}:{master_port} within "
            f"{timeout_s:g} s ({brief(error)}); check --master-addr, "
            "--master-port and that node 0 is running (--rendezvous-timeout sets the wait)"
        ) from None
    store.set(f"fw/joined/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    keys = [f"fw/joined/{r}" for r in range(world_size)]
    while True:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            return store
        reason = check_workers() if check_workers is not None else None
        if reason is not None:
            raise ConfigError(f"{reason} before the tensor-parallel rendezvous completed (its error is printed above)")
        if time.monotonic() > deadline:
            raise ConfigError(
                f"tensor-parallel rendezvous at {master_addr}:{master_port} timed out after {timeout_s:g} s: "
                f"rank(s) {', '.join(map(str, missing))} of {world_size} never joined (start every node "
                "with the same --master-addr/--master-port, --num-nodes and its own --node-rank)"
            )
        time.sleep(0.05)


def _listen(address: str, port: int) -> int:
    """A socket listening on ``address:port`` only, as a file descriptor the TCP store takes over."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return socket.create_server((address, port), family=family, backlog=512).detach()


def init_tensor_parallel(
    rank: int,
    world_size: int,
    device: torch.device,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    rendezvous_timeout_s: float = 300.0,
    timeout_s: float = 600.0,
    check_workers: Callable[[], str | None] | None = None,
) -> None:
    """Join the tensor-parallel group as ``rank`` of ``world_size``; layers built after this are sharded.

    NCCL on CUDA devices (this rank's device becomes current), gloo on CPU. ``timeout_s`` bounds
    every collective of the model, so a hung rank fails the step instead of hanging it.
    ``check_workers`` reports a local worker that died before the rendezvous completed.
    """
    if world_size & (world_size - 1) or world_size < 1:
        raise ConfigError(f"the tensor-parallel size must be a power of two; got {world_size}")
    if world_size == 1:
        _state.rank, _state.size = 0, 1
        return
    store = rendezvous_store(master_addr, master_port, rank, world_size, rendezvous_timeout_s, check_workers)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    options: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **options
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _state.rank, _state.size, _state.control_group = rank, world_size, control
    log.info("tensor-parallel rank %d of %d on %s (%s)", rank, world_size, device, backend)


def destroy_tensor_parallel(timeout_s: float = 30.0) -> None:
    """Leave the group (idempotent); layers built afterwards are unsharded again.

    Every rank should call it at about the same time: NCCL's teardown finalises the communicator
    with its peers. It runs on a daemon thread so that a peer that is already gone costs at most
    ``timeout_s`` (then the process exits without a clean teardown) instead of a hang.
    """
    for name in ("fast_all_reduce", "fused_all_reduce_norm"):
        if getattr(_state, name) is not None:
            getattr(_state, name).close()
            setattr(_state, name, None)
    if _state.symm_mem_group is not None:
        SYMM_MEM_GROUPS_OF_EARLIER_ENGINES.add(_state.symm_mem_group)
        _state.symm_mem_group = None
    if dist.is_initialized():

        def destroy() -> None:
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone: nothing left to tear down cleanly
                pass

        thread = threading.Thread(target=destroy, name="fw-destroy-process-group", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("leaving the tensor-parallel group did not finish in %.0f s; going on without it", timeout_s)
    _state.rank, _state.size, _state.control_group = 0, 1, None


# --- collectives ----------------------------------------------------------------------------


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks; use the returned tensor (capturable in a CUDA graph).

    NCCL (gloo on CPUs) sums ``x`` in place; with ``--all-reduce symm_mem`` a small tensor's sum
    is a new tensor (see :mod:`framework.distributed.fast_all_reduce`).
    """
    if _state.size > 1:
        if _state.fast_all_reduce is not None:
            return _state.fast_all_reduce.all_reduce(x)
        dist.all_reduce(x)
    return x


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm(all_reduce(x), residual, weight, eps, offset)``: the sum of every rank's
    partial ``x``, plus the residual stream, normalised; returns ``(normalised, new_residual)``.

    With ``--all-reduce flashinfer`` and a tensor that fits its workspace, one FlashInfer kernel
    does all three (:mod:`framework.distributed.flashinfer_all_reduce`); otherwise the all-reduce
    of :func:`all_reduce`, then ``fused_add_rms_norm`` (the norm layer's kernel).
    """
    fused = _state.fused_all_reduce_norm
    if fused is not None and fused.fits(x):
        return fused(x, residual, weight, eps, offset)
    return fused_add_rms_norm(all_reduce(x), residual, weight, eps, offset)


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order, on rank 0 alone; every other
    rank sends its ``x`` and gets it back unchanged (e.g. the logits, which only rank 0 samples)."""
    if _state.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_state.size)] if _state.rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=dim) if parts is not None else x


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place, on the data group (queued on the stream with NCCL)."""
    if _state.size > 1:
        dist.broadcast(x, src=0)
    return x


def min_over_ranks(value: int, group: dist.ProcessGroup | None = None) -> int:
    """The smallest ``value`` any rank of ``group`` holds (default: this engine's tensor-parallel
    ranks, over the gloo control group), e.g. the KV cache that fits the tightest device."""
    if group is None:
        if _state.size == 1:
            return value
        group = _state.control_group
    tensor = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


_encoder = msgspec.msgpack.Encoder()


def broadcast_message(message: Any, message_type: type) -> Any:
    """Rank 0 sends ``message`` (a msgspec struct) to every rank; every rank returns it.

    Two gloo broadcasts on the control group: the length, then the msgpack bytes. Workers pass
    ``None`` and block here until rank 0 sends (no timeout: an idle server sends nothing).
    """
    group = _state.control_group
    if _state.rank == 0:
        payload = _encoder.encode(message)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=group)
        return message
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    return msgspec.msgpack.decode(buffer.numpy().tobytes(), type=message_type)
