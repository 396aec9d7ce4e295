"""The tensor-parallel rendezvous listens on the address it was given, not on every interface."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from framework.distributed.config import free_port
from framework.distributed.state import rendezvous_store
from framework.errors import ConfigError


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from /proc/net/tcp (Linux)")
def test_rank_0_listens_on_the_master_address_only():
    port = free_port()
    store = rendezvous_store("127.0.0.1", port, rank=0, world_size=1, timeout_s=10)
    try:
        assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, and no [::] or 0.0.0.0 listener
        store.set("k", "v")
        client = type(store)("127.0.0.1", port, 1, is_master=False)
        assert client.get("k") == b"v"
    finally:
        del store


def test_a_taken_master_port_names_the_address():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"could not host the rendezvous on 127.0.0.1:{port}"):
            rendezvous_store("127.0.0.1", port, rank=0, world_size=1, timeout_s=5)
