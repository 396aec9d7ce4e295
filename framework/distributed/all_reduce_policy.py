"""The all-reduce policy: what ``--all-reduce`` means, and setting the chosen one up.

``--all-reduce`` takes ``auto`` (default), ``symm_mem``, ``nccl`` or ``flashinfer``
(:func:`~framework.distributed.fast_all_reduce.resolve_all_reduce` checks the name against the
device). Once the group exists, :meth:`AllReducePolicy.set_up` settles ``auto``: ``flashinfer``
for bf16 models of one host where FlashInfer's fused kernel is built already, else ``symm_mem``
where every rank is a Hopper-or-newer GPU of one host with peer access, else ``nccl``;
``symm_mem`` and ``flashinfer`` asked for by name must set up or fail the start. The fused
all-reduce + residual add + RMS norm comes once the model is built
(:meth:`AllReducePolicy.enable_fused_norm`), and only for models whose norms take the all-reduce.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from framework.distributed import fast_all_reduce, flashinfer_all_reduce, state
from framework.errors import ConfigError, brief

log = logging.getLogger("fw.distributed")


@dataclass(slots=True)
class AllReducePolicy:
    """One engine's all-reduce: ``name`` is what ``--all-reduce`` resolved to, then what sums the
    layers' outputs once :meth:`set_up` ran (``nccl``, ``symm_mem`` or ``flashinfer``)."""

    name: str
    device: torch.device
    num_nodes: int = 1
    #: what sums everything the fused norm does not (and everything, after a fused fallback)
    plain: str | None = None
    fused_norm_required: bool = False

    @classmethod
    def resolve(cls, name: str, device: torch.device, num_nodes: int = 1) -> AllReducePolicy:
        """The policy of ``--all-reduce name`` on ``device`` (a bad name or device is a ConfigError)."""
        return cls(fast_all_reduce.resolve_all_reduce(name, device), device, num_nodes)

    def set_up(self, dtype: torch.dtype, hidden_size: int, max_num_seqs: int) -> None:
        """Every rank, once the group exists: settle :attr:`name`, setting symm_mem up where it is chosen.

        ``auto`` on GPUs of one host takes ``flashinfer`` for bf16 models (the dtype it was measured
        in) where every rank has FlashInfer's module built (:func:`auto_flashinfer_or_not`), and
        falls back from it if its set-up fails; asked for by name, it must set up.
        """
        self.fused_norm_required = self.name == "flashinfer"
        if self.name == "auto" and self.device.type == "cuda" and dtype == torch.bfloat16 and self.num_nodes == 1:
            self.name = auto_flashinfer_or_not()
        fused = self.name == "flashinfer"
        # what sums everything no norm fuses: flashinfer takes symm_mem where it can run, as auto does
        plain = fast_all_reduce.all_reduce_for_dtype("auto" if fused else self.name, dtype)
        if plain in ("symm_mem", "auto"):
            enabled = enable_symm_mem_all_reduce(
                self.device,
                fast_all_reduce.buffer_bytes(max_num_seqs, hidden_size, dtype),
                required=plain == "symm_mem",
            )
            plain = "symm_mem" if enabled else "nccl"
        self.plain = plain
        self.name = "flashinfer" if fused else plain  # the fused kernel comes once the model is built

    def enable_fused_norm(
        self, norms_take_all_reduce: bool, architecture: str, max_num_seqs: int, hidden_size: int, dtype: torch.dtype
    ) -> None:
        """``flashinfer`` on a built model: FlashInfer's fused all-reduce + residual add + RMS norm
        when the model's norms take the all-reduce (every rank builds the same model, so all decide
        alike; before the KV cache is sized, which then leaves room for its workspace). A model
        whose norms do not keeps the plain all-reduce; under ``auto`` a set-up failure does too."""
        if self.name != "flashinfer":
            return
        if not norms_take_all_reduce:
            log.info(
                "--all-reduce flashinfer: %s's norms do not take the all-reduce; %s sums everything",
                architecture,
                self.plain,
            )
            self.name = self.plain
            return
        try:
            enable_flashinfer_all_reduce_norm(self.device, max_num_seqs, hidden_size, dtype)
        except ConfigError as error:  # raised on every rank alike
            if self.fused_norm_required:
                raise
            log.warning("--all-reduce auto: %s sums everything, since %s", self.plain, error)
            self.name = self.plain


def auto_flashinfer_or_not() -> str:
    """``--all-reduce auto`` on GPUs: ``flashinfer`` where every rank has FlashInfer's fused
    all-reduce built already (auto never waits for its JIT build), else ``auto`` (symm_mem or
    NCCL). Every rank calls it and all decide alike."""
    reason = flashinfer_all_reduce.unavailable_reason()
    if state.min_over_ranks(int(reason is None)):
        return "flashinfer"
    log.info("--all-reduce auto: no fused all-reduce + RMS norm (%s)", reason or "another rank cannot run it")
    return "auto"


def enable_symm_mem_all_reduce(device: torch.device, max_bytes: int, *, required: bool = True) -> bool:
    """Sum tensors of up to ``max_bytes`` with the symmetric-memory one-shot all-reduce from now on.

    Every rank calls it together, after :func:`init_tensor_parallel` and before any CUDA graph is
    captured. When the GPUs cannot use it (several hosts, no P2P, symmetric memory failing to set
    up on any rank) it raises :class:`ConfigError` if ``required`` (``--all-reduce symm_mem``),
    else returns False and NCCL stays (``auto``); every rank decides alike. True when enabled (and for a single rank, which sums nothing).
    """
    if state._state.size == 1:
        return True
    problem = fast_all_reduce.peer_access_problem(device, state._state.control_group, auto=not required)
    if problem is not None:
        if required:
            raise ConfigError(f"--all-reduce symm_mem: {problem}: use --all-reduce nccl")
        log.info("--all-reduce auto: NCCL, since the symmetric-memory all-reduce cannot run here (%s)", problem)
        return False
    try:  # a set-up failure fails on every rank alike (SymmMemAllReduce agrees on it first)
        state._state.fast_all_reduce = fast_all_reduce.SymmMemAllReduce(
            device, max_bytes, host_group=state._state.control_group
        )
    except ConfigError as error:
        if required:
            raise
        log.warning("--all-reduce auto: NCCL, since %s", error)
        return False
    return True


def enable_flashinfer_all_reduce_norm(
    device: torch.device, max_tokens: int, hidden_size: int, dtype: torch.dtype
) -> None:
    """``--all-reduce flashinfer``: from now on :func:`all_reduce_add_rms_norm` runs FlashInfer's
    fused kernel for up to ``max_tokens`` rows of ``hidden_size`` in ``dtype``.

    Every rank calls it together, after :func:`init_tensor_parallel` and before any CUDA graph is
    captured. Raises :class:`ConfigError` on every rank when any rank cannot run it (several hosts,
    no P2P, FlashInfer's communication module missing, failing to import or to load, its workspace
    failing before its collectives). A rank failing inside the workspace's collectives leaves the
    others waiting there until ``--distributed-timeout``.
    """
    if state._state.size == 1:
        return
    problem = fast_all_reduce.peer_access_problem(device, state._state.control_group)
    if problem is None:
        failure = None
        capability = torch.cuda.get_device_capability(device)
        if capability < (9, 0):  # FlashInfer builds its communication kernels for SM 9.x and newer
            failure = f"its kernel needs compute capability 9.0 or newer; {device} is {capability[0]}.{capability[1]}"
        else:
            try:  # the import and the load (its JIT build the first time) every rank must manage
                from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

                get_trtllm_comm_module()
            except Exception as error:  # not installed, failing at import, or the module failing to build or load
                failure = (
                    f"FlashInfer's communication module is not available ({brief(error)}); install flashinfer-python"
                )
        problem = _agreed(failure)
    if problem is not None:
        raise ConfigError(f"--all-reduce flashinfer: {problem}: use --all-reduce symm_mem or nccl")
    failure = None
    try:  # a failure before the workspace's collectives (e.g. out of memory) is every rank's, as below
        fused = flashinfer_all_reduce.FlashInferFusedAllReduceNorm(device, max_tokens, hidden_size, dtype)
    except ConfigError:
        raise  # the dtype check: the same on every rank, before any collective
    except Exception as error:
        failure = f"its workspace failed to set up ({brief(error)})"
    problem = _agreed(failure)
    if problem is not None:
        raise ConfigError(f"--all-reduce flashinfer: {problem}: use --all-reduce symm_mem or nccl")
    state._state.fused_all_reduce_norm = fused


def _agreed(failure: str | None) -> str | None:
    """This rank's ``failure``, or another rank's failure: every rank of the group calls it together
    and gets None only when none failed."""
    if not state.min_over_ranks(int(failure is None)) and failure is None:
        return "another rank cannot run it (its log says why)"
    return failure
