"""All-reduce latency between the GPUs of this host, as tensor parallelism uses it (run on the GPU machine).

    NCCL_DEBUG=INFO python benchmarks/allreduce_latency.py --ranks 2

Spawns one process per GPU, then times ``torch.distributed.all_reduce`` of bf16 vectors of decode
sizes: eagerly, and as 64 all-reduces captured in one CUDA graph (as a decode step replays them).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, ranks: int, port: int) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=ranks, device_id=torch.device("cuda", rank))
    for numel in (4096, 5120, 65536, 4096 * 64):
        x = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
        for _ in range(10):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            dist.all_reduce(x)
        stop.record()
        torch.cuda.synchronize()
        eager = start.elapsed_time(stop) / 200 * 1e3
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            dist.all_reduce(x)  # warm-up on the capture stream
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(64):
                    dist.all_reduce(x)
        torch.cuda.synchronize()
        start.record()
        for _ in range(10):
            graph.replay()
        stop.record()
        torch.cuda.synchronize()
        graphed = start.elapsed_time(stop) / 10 / 64 * 1e3
        if rank == 0:
            print(f"all_reduce {numel * 2 / 1024:7.0f} KiB: eager {eager:6.1f} us, in a CUDA graph {graphed:6.1f} us", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--port", type=int, default=29611)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(worker, args=(args.ranks, args.port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
