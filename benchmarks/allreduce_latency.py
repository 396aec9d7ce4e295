"""All-reduce latency between the GPUs of this host, as tensor parallelism uses it (run on the GPU machine).

    python benchmarks/allreduce_latency.py --ranks 2 --impl nccl symm_mem --out $OUT/allreduce.json

Spawns one process per GPU, then times each implementation (``--impl``: ``nccl`` is
``torch.distributed.all_reduce``; ``symm_mem`` is fw's one-shot all-reduce on symmetric memory,
:class:`framework.distributed.fast_all_reduce.SymmMemAllReduce`) on bf16 tensors of decode sizes:
eagerly, and as 64 all-reduces captured in one CUDA graph (as a decode step replays them). Rank 0
prints one line per size and implementation (keep ``NCCL_DEBUG`` off: its log would bury them)
and writes them to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import report_header

#: bf16 elements: batch 1 of hidden 4096 and 5120, then larger batches of hidden 4096
SIZES = (4096, 5120, 65536, 4096 * 64)


def time_all_reduce(reduce: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[float, float]:
    """Microseconds per all-reduce of ``x``: eager (200 calls), and replayed from a graph of 64."""
    for _ in range(10):
        x = reduce(x)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        x = reduce(x)
    stop.record()
    torch.cuda.synchronize()
    eager = start.elapsed_time(stop) / 200 * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        x = reduce(x)  # warm-up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            y = x
            for _ in range(64):
                y = reduce(y)
    torch.cuda.synchronize()
    graph.replay()  # first replay uploads the graph
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return eager, start.elapsed_time(stop) / 10 / 64 * 1e3


def worker(rank: int, ranks: int, port: int, impls: list[str], out: str | None, run: dict[str, str]) -> None:
    """One rank: time every implementation; rank 0 prints the results and writes them to ``out``
    with ``run``'s ``date``, ``commit`` and ``command`` (taken by the launching process)."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=ranks, device_id=device)
    results = []
    for impl in impls:
        if impl == "symm_mem":
            from framework.distributed.fast_all_reduce import SymmMemAllReduce

            fast = SymmMemAllReduce(device, max(SIZES) * 2)
            reduce = fast.all_reduce
        else:

            def reduce(x: torch.Tensor) -> torch.Tensor:
                dist.all_reduce(x)
                return x

        for numel in SIZES:
            x = torch.ones(numel, dtype=torch.bfloat16, device=device)  # (the repeated sums overflow: no matter)
            eager, graphed = time_all_reduce(reduce, x)
            results.append(dict(impl=impl, kib=numel * 2 / 1024, eager_us=eager, graph_us=graphed))
            if rank == 0:
                print(
                    f"{impl:>8} all_reduce {numel * 2 / 1024:7.0f} KiB: eager {eager:6.1f} us, "
                    f"in a CUDA graph {graphed:6.1f} us",
                    flush=True,
                )
        if impl == "symm_mem":
            fast.close()
    if rank == 0 and out:
        report = {**run, "ranks": ranks, "results": results}
        Path(out).write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--port", type=int, default=29611)
    parser.add_argument("--impl", nargs="+", choices=["nccl", "symm_mem"], default=["nccl", "symm_mem"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    run = report_header()  # here: the workers' command line is not the user's
    mp.spawn(
        worker, args=(args.ranks, args.port, args.impl, str(args.out) if args.out else None, run), nprocs=args.ranks
    )


if __name__ == "__main__":
    main()
