"""``--all-reduce flashinfer``: the all-reduce of a row-parallel layer, the residual add and the
RMS norm after it in one kernel, FlashInfer's port of TensorRT-LLM's fused all-reduce (as vLLM's
all-reduce + RMS norm fusion uses it on Hopper).

Decoder stacks whose layers leave their all-reduce to the next norm (see
``framework.layers.RMSNorm.reduces_input``) call
:func:`framework.distributed.all_reduce_add_rms_norm`, which takes this path for tensors of at
most ``max_tokens`` rows (decode steps) and otherwise all-reduces (symm_mem or NCCL) and then
runs the norm kernel. The one-shot Lamport protocol writes each rank's rows into every peer's
buffer and polls for them, with no barrier round trip; the buffers are torch symmetric memory on
the default group (no NVLink multicast). FlashInfer compiles the kernel just in time on first use
(minutes) unless an ahead-of-time build or an earlier JIT build is on disk. (A JIT build is reused
through ninja, which rebuilds it if FlashInfer's sources or the compiler changed since: then
``auto`` waits for that build too.)

``--all-reduce auto`` takes it (bf16 models, GPUs of one host) where that build is already
on disk (:func:`unavailable_reason`; what it gives is in docs/benchmarks.md); ``auto`` never
starts the build, and falls back to the plain all-reduce if the set-up fails.
``--all-reduce flashinfer`` asks for it (building it if needed) and fails where it cannot run.
Known limits: a failure while the workspace is being built on one rank only (e.g. FlashInfer's
JIT build) leaves the others waiting in its barrier until ``--distributed-timeout``. Models whose
norms do not take the all-reduce (GLM-4, StableLM, Gemma, DeepSeek) get no workspace: the engine
keeps the plain all-reduce for them.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from framework.distributed.state import note_symm_mem_set_up
from framework.errors import ConfigError, brief

log = logging.getLogger("fw.distributed")

#: the activation dtypes the fused kernel sums (fp32 through its fp32 Lamport buffers)
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def unavailable_reason() -> str | None:
    """Why ``--all-reduce auto`` does not take the fused kernel on this machine, None where it can:
    FlashInfer must import and its communication module must be built already (FlashInfer's
    ahead-of-time package or an earlier JIT build); ``auto`` never waits for that build."""
    try:
        from flashinfer.jit.comm import gen_trtllm_comm_module

        spec = gen_trtllm_comm_module()
        built, ahead_of_time = spec.is_compiled, spec.is_aot
    except Exception as error:  # not installed, or FlashInfer failing at import on this machine
        return f"FlashInfer is not available ({brief(error)})"
    if not built:
        return (
            "FlashInfer's communication module is not built yet; --all-reduce flashinfer builds it once "
            "(about 7 minutes) into FlashInfer's cache"
        )
    if os.environ.get("FLASHINFER_DISABLE_JIT") and not ahead_of_time:
        return "FLASHINFER_DISABLE_JIT is set and the module is a JIT build, which FlashInfer then refuses to load"
    return None


class FlashInferFusedAllReduceNorm:
    """``(rms_norm(sum over ranks of x + residual), sum + residual)`` in one FlashInfer kernel for
    ``[tokens <= max_tokens, hidden_size]`` tensors of ``dtype``; see :meth:`fits`.

    Build it on every rank at the same time (the workspace is allocated and exchanged collectively).
    """

    def __init__(
        self,
        device: torch.device,
        max_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if dtype not in FUSED_DTYPES:
            raise ConfigError(
                f"--all-reduce flashinfer fuses bf16, fp16 and fp32 activations; this model runs in {dtype}"
            )
        from flashinfer.comm import trtllm_ar

        self.group = group or dist.group.WORLD
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.max_tokens, self.hidden_size, self.dtype = max_tokens, hidden_size, dtype
        # the workspace is torch symmetric memory on this group: once per process and group name
        note_symm_mem_set_up(self.group.group_name)
        with torch.cuda.device(device):
            self._handles, self.workspace, self.metadata = trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion(
                tp_rank=self.rank,
                tp_size=self.size,
                max_token_num=max_tokens,
                hidden_dim=hidden_size,
                use_fp32_lamport=dtype == torch.float32,
                group=self.group,
                create_metadata=True,
                use_symm_dev_mem=False,
            )
        self._fuse = trtllm_ar.trtllm_allreduce_fusion
        self._destroy = trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion
        self._pattern = trtllm_ar.AllReduceFusionPattern.kARResidualRMSNorm
        log.info(
            "FlashInfer fused all-reduce + RMS norm on %s: %d ranks, up to %d tokens of %d",
            device,
            self.size,
            max_tokens,
            hidden_size,
        )

    def fits(self, x: torch.Tensor) -> bool:
        """Whether the fused kernel takes ``x`` (the same answer on every rank for the same shape)."""
        return (
            x.dtype == self.dtype
            and x.dim() == 2
            and 0 < x.shape[0] <= self.max_tokens
            and x.shape[1] == self.hidden_size
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = x.contiguous(), residual.contiguous()
        normed, new_residual = torch.empty_like(x), torch.empty_like(x)
        self._fuse(
            allreduce_in=x,
            world_size=self.size,
            world_rank=self.rank,
            token_num=x.shape[0],
            hidden_dim=self.hidden_size,
            workspace_ptrs=self.workspace,
            launch_with_pdl=False,
            trigger_completion_at_end=True,
            fp32_acc=True,
            pattern_code=self._pattern,
            use_oneshot=True,
            allreduce_out=None,
            residual_in=residual,
            residual_out=new_residual,
            norm_out=normed,
            quant_out=None,
            scale_out=None,
            rms_gamma=weight,
            rms_eps=float(eps),
            scale_factor=None,
            layout_code=None,
            weight_bias=float(offset) or None,
        )
        return normed, new_residual

    def close(self) -> None:
        """Free the workspace (before the process group goes)."""
        if self.workspace is not None:
            self.workspace = None
            self._destroy(self._handles, self.group)
