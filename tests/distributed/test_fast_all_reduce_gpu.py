"""The symmetric-memory one-shot all-reduce on two GPUs gives NCCL's sums, eagerly and replayed from a CUDA graph.

Run with ``make test-gpu`` (skipped unless two CUDA devices are present). Two processes are
spawned, each joins the tensor-parallel group with :func:`init_tensor_parallel`, enables
``--all-reduce symm_mem`` and compares :func:`framework.distributed.all_reduce` with
``torch.distributed.all_reduce`` (NCCL) on the same inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from framework.distributed.config import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

#: decode-sized tensors (batch x hidden), one that the symmetric buffer cannot hold and one whose
#: bf16 bytes are not a multiple of 4: NCCL sums those two
SHAPES = [(1, 128), (3, 4096), (64, 4096), (1, 7), (512, 4096)]
BUFFER_BYTES = 64 * 4096 * 4
NCCL_SUMS = {((1, 7), torch.bfloat16), ((512, 4096), torch.bfloat16), ((512, 4096), torch.float32)}
#: two ranks: one rounding of an exact sum either way, so the sums are equal; the bf16 bound
#: still catches a stale or half-written buffer
TOLERANCE = {torch.float32: dict(rtol=0, atol=0), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _inputs(rank: int, shape: tuple[int, ...], dtype: torch.dtype, round_: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + 17 * round_ + shape[0])
    return torch.randn(shape, generator=generator).to(dtype).cuda()


def _nccl_sum(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    expected = x.clone()
    dist.all_reduce(expected)
    return expected


def _context(where: str):
    return lambda message: f"{where}: {message}"


def _worker(rank: int, port: int) -> None:
    from framework import distributed
    from framework.distributed.state import _state

    device = torch.device("cuda", rank)
    distributed.init_tensor_parallel(rank, 2, device, master_port=port, rendezvous_timeout_s=60, timeout_s=60)
    try:
        distributed.enable_symm_mem_all_reduce(device, BUFFER_BYTES)
        fast = _state.fast_all_reduce
        assert fast is not None
        for dtype in (torch.bfloat16, torch.float32):
            for shape in SHAPES:
                x = _inputs(rank, shape, dtype, 0)
                expected = _nccl_sum(x)
                assert fast.fits(x) == ((shape, dtype) not in NCCL_SUMS), (shape, dtype)
                staged = x.clone()
                got = distributed.all_reduce(staged)
                # the one-shot op returns a new tensor; NCCL sums in place and returns its input
                assert (got.data_ptr() != staged.data_ptr()) == fast.fits(x), (shape, dtype)
                torch.testing.assert_close(got, expected, **TOLERANCE[dtype], msg=_context(f"eager {shape} {dtype}"))
        # captured: several all-reduces in one graph (as a decode step has; one of them NCCL's), replayed with new inputs
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for dtype in (torch.bfloat16, torch.float32):
            static = [_inputs(rank, shape, dtype, 0) for shape in [(1, 128), (3, 4096), (512, 4096), (64, 4096)]]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                for x in static:  # warm-up on the capture stream
                    distributed.all_reduce(x.clone())
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    outputs = [distributed.all_reduce(x * 1) for x in static]
            torch.cuda.synchronize()
            for round_ in range(1, 4):
                fresh = [_inputs(rank, x.shape, dtype, round_) for x in static]
                for x, new in zip(static, fresh, strict=True):
                    x.copy_(new)
                graph.replay()
                torch.cuda.synchronize()
                for x, out in zip(fresh, outputs, strict=True):
                    torch.testing.assert_close(
                        out,
                        _nccl_sum(x),
                        **TOLERANCE[dtype],
                        msg=_context(f"graph replay {round_} {tuple(x.shape)} {dtype}"),
                    )
            del graph
        torch.cuda.synchronize()
    finally:
        distributed.destroy_tensor_parallel()


def test_symm_mem_all_reduce_equals_nccl_eagerly_and_in_a_cuda_graph():
    mp.spawn(_worker, args=(free_port(),), nprocs=2, join=True)
