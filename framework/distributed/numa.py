"""Optional NUMA binding of tensor-parallel ranks: ``MAP_NUMA_NODE=0,0,1,1`` (one node per local rank).

Each rank's process is pinned (``os.sched_setaffinity``) to the CPUs of its NUMA node, read from
``/sys/devices/system/node/node<N>/cpulist``, so its host-side work and memory stay near its GPU.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from framework.errors import ConfigError

log = logging.getLogger("fw.distributed")


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> ``{0, 1, 2, 3, 8, 10, 11}`` (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def bind_to_numa_node(
    local_rank: int, mapping: str | None = None, sys_root: str = "/sys/devices/system/node"
) -> set[int] | None:
    """Pin this process to the CPUs of ``MAP_NUMA_NODE``'s entry for ``local_rank``; returns them (None: unset)."""
    mapping = mapping if mapping is not None else os.environ.get("MAP_NUMA_NODE")
    if not mapping:
        return None
    nodes = [p.strip() for p in mapping.split(",")]
    if local_rank >= len(nodes) or not nodes[local_rank].isdigit():
        raise ConfigError(
            f"MAP_NUMA_NODE={mapping!r} needs a NUMA node number for local rank {local_rank} "
            "(one entry per device, e.g. 0,0,1,1)"
        )
    cpulist = Path(sys_root) / f"node{nodes[local_rank]}" / "cpulist"
    if not cpulist.exists():
        raise ConfigError(f"MAP_NUMA_NODE: NUMA node {nodes[local_rank]} does not exist ({cpulist} is missing)")
    cpus = parse_cpulist(cpulist.read_text())
    os.sched_setaffinity(0, cpus)
    log.info("local rank %d bound to NUMA node %s (%d CPUs)", local_rank, nodes[local_rank], len(cpus))
    return cpus
