"""Start-up errors of tensor parallelism: a rendezvous that cannot complete, an unshardable architecture."""

from __future__ import annotations

import json
import os
import time

import pytest
import transformers

from framework import LLM, EngineBuilder, hookimpl
from framework.distributed.config import free_port
from framework.distributed.state import rendezvous_store
from framework.errors import ConfigError
from framework.specs import ModelSpec
from framework.testing import write_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tp")
    write_tiny_model(
        path,
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        ),
    )
    return path


def test_rendezvous_with_a_missing_rank_times_out_naming_the_address_and_the_rank(tiny_llama):
    port = free_port()
    started = time.monotonic()
    with pytest.raises(ConfigError) as error:
        EngineBuilder(
            str(tiny_llama),
            device="cpu",
            tensor_parallel_size=2,
            num_nodes=2,
            node_rank=0,
            master_port=port,
            rendezvous_timeout=1.5,
        ).build()
    message = str(error.value)
    assert f"127.0.0.1:{port} timed out after 1.5 s" in message and "rank(s) 1 of 2 never joined" in message
    assert time.monotonic() - started < 30


def test_a_node_that_cannot_reach_rank_0_says_where_it_looked():
    port = free_port()
    with pytest.raises(ConfigError, match=f"rank 1 could not reach rank 0 at 127.0.0.1:{port}"):
        rendezvous_store("127.0.0.1", port, rank=1, world_size=2, timeout_s=1.0)


def test_architecture_without_tensor_parallel_support_is_refused_at_start_up(tiny_llama, tmp_path, register_fw_plugin):
    import shutil

    class NoShardingPlugin:
        @hookimpl
        def register_model_architectures(self, platform):
            return [ModelSpec(name="NoShardingForCausalLM", impl="fw_llama.model:LlamaForCausalLM")]

    register_fw_plugin(NoShardingPlugin(), name="no_sharding")
    shutil.copytree(tiny_llama, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "architectures": ["NoShardingForCausalLM"]}))
    with pytest.raises(ConfigError, match="NoShardingForCausalLM cannot be sharded for tensor parallelism"):
        LLM(str(tmp_path / "m"), device="cpu", tensor_parallel_size=2)


@pytest.mark.skipif(
    not os.path.exists("/sys/devices/system/node/node0/cpulist"), reason="no NUMA sysfs on this machine"
)
def test_a_worker_that_fails_at_start_up_fails_the_build_at_once_with_its_reason(tiny_llama, monkeypatch):
    monkeypatch.setenv("MAP_NUMA_NODE", "0,97")  # rank 0 on node 0; rank 1's node does not exist
    allowed = os.sched_getaffinity(0)
    started = time.monotonic()
    try:
        with pytest.raises(
            ConfigError,
            match=r"worker rank 1 \(pid \d+\) exited with code 1 before the tensor-parallel "
            r"rendezvous completed",
        ):
            LLM(str(tiny_llama), device="cpu", tensor_parallel_size=2, rendezvous_timeout=120)
    finally:
        os.sched_setaffinity(0, allowed)
    assert time.monotonic() - started < 100
