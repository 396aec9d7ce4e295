"""``ParallelConfig``: how many ranks, on which nodes and devices, and where they meet."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

from framework.errors import ConfigError

#: torch.distributed's customary rendezvous port (used when several nodes must agree on one).
DEFAULT_MASTER_PORT = 29500


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (for a single-node rendezvous)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class ParallelConfig:
    """Tensor parallelism over ``tensor_parallel_size`` ranks, ``ranks_per_node`` on each of ``num_nodes``.

    Node ``n`` runs global ranks ``[n * ranks_per_node, (n + 1) * ranks_per_node)``; on GPUs
    local rank ``i`` uses CUDA device ``device_ids[i]`` (``--d``). ``rank`` is this process's
    global rank (the node's first rank unless a worker is told otherwise). Rank 0 hosts the
    rendezvous at ``master_addr:master_port`` and runs the engine core.
    """

    tensor_parallel_size: int | None = None
    num_nodes: int = 1
    node_rank: int = 0
    device_ids: list[int] | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    rendezvous_timeout: float = 300.0
    distributed_timeout: float = 600.0
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ConfigError(f"--num-nodes must be >= 1; got {self.num_nodes}")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ConfigError(
                f"--node-rank must be in [0, {self.num_nodes - 1}] for --num-nodes {self.num_nodes}; got {self.node_rank}"
            )
        if self.device_ids is not None and len(set(self.device_ids)) != len(self.device_ids):
            raise ConfigError(f"--d lists a device twice: {self.device_ids}")
        from_devices = len(self.device_ids) * self.num_nodes if self.device_ids else None
        if self.tensor_parallel_size is None:
            self.tensor_parallel_size = from_devices or self.num_nodes
        size = self.tensor_parallel_size
        if size < 1 or size & (size - 1):
            raise ConfigError(f"the tensor-parallel size must be a power of two (1, 2, 4, 8, ...); got {size}")
        if from_devices is not None and from_devices != size:
            raise ConfigError(
                f"--tp {size} disagrees with --d {','.join(map(str, self.device_ids))} on {self.num_nodes} "
                f"node(s) ({from_devices} ranks); give one of them"
            )
        if size % self.num_nodes:
            raise ConfigError(f"--tp {size} ranks cannot be spread evenly over --num-nodes {self.num_nodes}")
        if self.rank is None:
            self.rank = self.first_local_rank
        if not self.first_local_rank <= self.rank < self.first_local_rank + self.ranks_per_node:
            raise ConfigError(f"rank {self.rank} does not run on node {self.node_rank}")
        for name, value in (
            ("--rendezvous-timeout", self.rendezvous_timeout),
            ("--distributed-timeout", self.distributed_timeout),
        ):
            if value <= 0:
                raise ConfigError(f"{name} must be > 0 seconds; got {value}")

    @property
    def is_parallel(self) -> bool:
        return self.tensor_parallel_size > 1

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.num_nodes

    @property
    def first_local_rank(self) -> int:
        return self.node_rank * self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank - self.first_local_rank

    def device(self, requested: str | None) -> torch.device:
        """This rank's device: ``cuda:device_ids[local_rank]``, ``cpu``, or the requested one at TP 1."""
        if self.device_ids is not None:
            if requested and torch.device(requested).type != "cuda":
                raise ConfigError(f"--d {','.join(map(str, self.device_ids))} names GPUs but --device is {requested}")
            if requested and torch.device(requested).index is not None and len(self.device_ids) > 1:
                raise ConfigError(
                    f"--device {requested} and --d {','.join(map(str, self.device_ids))} disagree; give --d only"
                )
            return torch.device("cuda", self.device_ids[self.local_rank])
        device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
        if not self.is_parallel:
            return device
        if device.type == "cuda":
            if device.index is not None:
                raise ConfigError(
                    f"--device {requested} names one GPU; with tensor parallelism list them with --d, e.g. --d 0,1"
                )
            return torch.device("cuda", self.local_rank)
        return device
