"""``--all-reduce``: the choice of the tensor-parallel all-reduce, its validation and its errors on CPU.

The symmetric-memory all-reduce itself needs two GPUs: tests/distributed/test_fast_all_reduce_gpu.py.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from typer.testing import CliRunner

from cli.main import build_app
from framework import LLM, EngineBuilder, SamplingParams
from framework.distributed import all_reduce_policy, fast_all_reduce
from framework.distributed.fast_all_reduce import (
    MAX_BUFFER_BYTES,
    all_reduce_for_dtype,
    buffer_bytes,
    resolve_all_reduce,
)
from framework.errors import ConfigError
from framework.testing import reference_greedy, write_tiny_model


def test_resolve_all_reduce_validates_the_name_and_the_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_all_reduce("nccl", cpu) == "nccl"
    assert resolve_all_reduce("auto", cpu) == "nccl"  # gloo
    assert resolve_all_reduce("auto", cuda) == "auto"  # decided once the group exists
    assert resolve_all_reduce("symm_mem", cuda) == "symm_mem"
    with pytest.raises(
        ConfigError, match=r"--all-reduce must be one of nccl, symm_mem, auto, flashinfer; got 'custom'"
    ):
        resolve_all_reduce("custom", cuda)
    with pytest.raises(ConfigError, match=r"symm_mem needs CUDA GPUs with peer access; this engine runs on cpu"):
        resolve_all_reduce("symm_mem", cpu)
    assert resolve_all_reduce("flashinfer", cuda) == "flashinfer"
    with pytest.raises(ConfigError, match=r"flashinfer needs CUDA GPUs with peer access; this engine runs on cpu"):
        resolve_all_reduce("flashinfer", cpu)


def test_fp16_models_keep_nccl_under_auto_and_refuse_symm_mem():
    assert all_reduce_for_dtype("auto", torch.float16) == "nccl"
    assert all_reduce_for_dtype("nccl", torch.float16) == "nccl"
    with pytest.raises(
        ConfigError,
        match=r"symm_mem sums bf16 and fp32 tensors; this model runs in torch.float16: "
        r"use --dtype bf16 or --all-reduce nccl",
    ):
        all_reduce_for_dtype("symm_mem", torch.float16)
    for dtype in (torch.bfloat16, torch.float32):
        assert [all_reduce_for_dtype(name, dtype) for name in ("auto", "symm_mem", "nccl")] == [
            "auto",
            "symm_mem",
            "nccl",
        ]


def test_buffer_holds_the_largest_decode_all_reduce_up_to_a_cap():
    assert buffer_bytes(8, 128, torch.float32) == 8 * 128 * 4
    assert buffer_bytes(256, 4096, torch.bfloat16) == 2 * 2**20
    assert buffer_bytes(1024, 16384, torch.bfloat16) == MAX_BUFFER_BYTES


def test_engine_builder_refuses_a_bad_all_reduce_before_starting_anything():
    with pytest.raises(ConfigError, match="must be one of nccl, symm_mem, auto"):
        EngineBuilder("./no-such-model", device="cpu", all_reduce="NCCL")
    with pytest.raises(ConfigError, match="symm_mem needs CUDA GPUs"):
        EngineBuilder("./no-such-model", device="cpu", tensor_parallel_size=2, all_reduce="symm_mem")


@pytest.mark.parametrize("command", [["generate", "hi"], ["bench", "--num-prompts", "1"], ["serve"]])
def test_cli_all_reduce_flag_errors_name_the_valid_values(command):
    app = build_app()
    result = CliRunner().invoke(app, [*command, "--m", "./no-such-model", "--all-reduce", "fast"])
    assert result.exit_code == 2, result.output
    assert "--all-reduce must be one of nccl, symm_mem, auto, flashinfer; got 'fast'" in result.output
    result = CliRunner().invoke(
        app, [*command, "--m", "./no-such-model", "--device", "cpu", "--tp", "2", "--all-reduce", "symm_mem"]
    )
    assert result.exit_code == 2, result.output
    assert "symm_mem needs CUDA GPUs" in result.output


@pytest.mark.parametrize(
    ("flags", "device"),
    [
        ({}, "cuda"),
        ({"device": "cpu"}, "cpu"),
        ({"device": "cpu", "tensor_parallel_size": 2}, "cpu"),
        ({"tensor_parallel_size": 2, "num_nodes": 2, "node_rank": 1}, "cuda:0"),
    ],
)
def test_cli_all_reduce_check_sees_the_device_the_engine_builder_uses(flags, device, monkeypatch):
    """The CLI's early ``--all-reduce`` check and :class:`EngineBuilder` validate on one device, the
    one these flags name on a (faked) CUDA machine: node 1's first rank is its local GPU 0."""
    from cli.options import engine_kwargs

    seen: dict[str, list[torch.device]] = {"cli": [], "builder": []}
    where = "cli"

    def resolve(name, device):
        seen[where].append(device)
        return resolve_all_reduce(name, device)

    monkeypatch.setattr(fast_all_reduce, "resolve_all_reduce", resolve)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)  # the builder makes a rank's GPU current
    from framework import platform

    monkeypatch.setattr(
        platform,
        "detect_platform",
        lambda probe_device=True: platform.Platform(
            "cuda", num_devices=2, device_name="fake", compute_capability=(9, 0), probed=True
        ),
    )
    kwargs = engine_kwargs(m="./no-such-model", all_reduce="auto", **flags)
    where = "builder"
    EngineBuilder(**kwargs)
    assert seen["cli"] and seen["builder"], seen
    assert set(seen["cli"]) == set(seen["builder"]) == {torch.device(device)}, seen


def test_cli_refuses_gpu_ordinals_with_a_cpu_device_before_starting_anything():
    result = CliRunner().invoke(build_app(), ["serve", "--m", "./no-such-model", "--d", "0,1", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "--d 0,1 names GPUs but --device is cpu" in result.output


def test_tp2_on_cpu_with_all_reduce_auto_runs_gloo_and_matches_transformers(tmp_path):
    reference = write_tiny_model(
        tmp_path,
        transformers.LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=0.1,
        ),
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [5, 9, 33, 2]
    with LLM(str(tmp_path), device="cpu", tensor_parallel_size=2, num_blocks=8, all_reduce="auto") as llm:
        ids = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        assert llm.engine.summary["all_reduce"] == "nccl"  # auto on CPUs: gloo
    assert ids == reference_greedy(reference, prompt, params.max_tokens)


@pytest.mark.parametrize(
    ("hosts", "indices", "peer", "capability", "set_up", "problem"),
    [
        (["a", "a"], [0, 1], True, (9, 0), [False, False], None),
        (["a", "b"], [0, 1], True, (9, 0), [False, False], "the group spans a, b"),
        (["a", "a"], [0, 1], False, (9, 0), [False, False], "no access cuda:0 -> cuda:1, cuda:1 -> cuda:0"),
        (["a", "a"], [0, 0], True, (9, 0), [False, False], "two ranks report the same host and device ordinal"),
        (
            ["a", "a"],
            [0, 1],
            True,
            (8, 0),
            [False, False],
            "auto takes it on compute capability 9.0 and up .* these GPUs are 8.0",
        ),
        # a second engine in rank 0's process (its workers are new): its rendezvous would hang
        (["a", "a"], [0, 1], True, (9, 0), [True, False], "already set symmetric memory up for an earlier engine"),
    ],
)
def test_auto_takes_symm_mem_only_where_every_rank_can_use_it(
    monkeypatch, hosts, indices, peer, capability, set_up, problem
):
    """``--all-reduce auto``: symm_mem on one host with peer access; otherwise NCCL stays (no error),
    while ``--all-reduce symm_mem`` there is a start-up error naming the reason."""
    from framework.distributed import state

    def all_gather_object(out, mine, group=None):
        out[:] = list(zip(hosts, indices, set_up, strict=True))

    monkeypatch.setattr(state.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(state.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: peer)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    built = []
    monkeypatch.setattr(fast_all_reduce, "SymmMemAllReduce", lambda *args, **kwargs: built.append(args) or "symm")
    monkeypatch.setattr(state._state, "size", 2)
    monkeypatch.setattr(state._state, "fast_all_reduce", None)
    device = torch.device("cuda", 0)
    if problem is None:
        assert fast_all_reduce.peer_access_problem(device) is None
        assert all_reduce_policy.enable_symm_mem_all_reduce(device, 4096, required=False) is True
        assert built and state._state.fast_all_reduce == "symm"
        return
    assert re.search(problem, fast_all_reduce.peer_access_problem(device, auto=True))
    assert all_reduce_policy.enable_symm_mem_all_reduce(device, 4096, required=False) is False
    assert not built and state._state.fast_all_reduce is None  # NCCL stays
    if capability < fast_all_reduce.AUTO_MIN_CAPABILITY:  # --all-reduce symm_mem forces it there
        assert fast_all_reduce.peer_access_problem(device) is None
        assert all_reduce_policy.enable_symm_mem_all_reduce(device, 4096, required=True) is True and built
        return
    with pytest.raises(ConfigError, match=f"--all-reduce symm_mem: .*{problem}.*: use --all-reduce nccl"):
        all_reduce_policy.enable_symm_mem_all_reduce(device, 4096, required=True)


@pytest.mark.parametrize("failing", ["this rank", "another rank", "rendezvous"])
def test_a_symmetric_memory_set_up_failure_is_a_clear_error_and_auto_keeps_nccl(monkeypatch, failing):
    """The buffer is allocated, then the ranks agree on the host group before the rendezvous, so an
    allocation failure on any rank fails every rank (the "another rank" case; none waits in the
    rendezvous alone). A rendezvous that fails raises on the rank that saw it (one process here);
    ``auto`` then stays on NCCL and ``symm_mem`` is a start-up error naming the cause."""
    import contextlib
    import types

    import torch.distributed._symmetric_memory as symm_mem

    from framework.distributed import state

    class Group:
        group_name = "tp"

    def empty(*args, **kwargs):
        if failing == "this rank":
            raise RuntimeError("CUDA driver does not support multicast/VMM")
        return torch.empty(16, dtype=torch.uint8)

    def rendezvous(buffer, name):
        raise RuntimeError("rendezvous failed")

    monkeypatch.setattr(fast_all_reduce.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(fast_all_reduce, "peer_access_problem", lambda device, group=None, auto=False: None)
    monkeypatch.setattr(fast_all_reduce, "min_over_ranks", lambda ok, group: int(ok and failing != "another rank"))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(symm_mem, "rendezvous", rendezvous)
    monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce_out", object(), raising=False)
    reason = {
        "this rank": "multicast/VMM",
        "another rank": "another rank could not allocate",
        "rendezvous": "rendezvous failed",
    }[failing]
    with pytest.raises(ConfigError, match=f"could not be set up on cuda:0 .*{reason}.*use --all-reduce nccl"):
        fast_all_reduce.SymmMemAllReduce(torch.device("cuda", 0), 4096, Group())
    monkeypatch.setattr(state._state, "size", 2)
    monkeypatch.setattr(state._state, "fast_all_reduce", None)
    monkeypatch.setattr(state._state, "control_group", Group())
    monkeypatch.setattr(fast_all_reduce.dist, "group", types.SimpleNamespace(WORLD=Group()))  # the data group
    assert all_reduce_policy.enable_symm_mem_all_reduce(torch.device("cuda", 0), 4096, required=False) is False
    assert state._state.fast_all_reduce is None
    with pytest.raises(ConfigError, match=reason):
        all_reduce_policy.enable_symm_mem_all_reduce(torch.device("cuda", 0), 4096, required=True)


def test_small_tensors_are_staged_in_the_symmetric_buffer_and_the_rest_go_to_nccl(monkeypatch):
    """The dispatch of SymmMemAllReduce without GPUs: the op is replaced by one that sums two
    ranks holding the same tensor (twice the staged buffer), ``dist.all_reduce`` by a recorder."""
    from framework.distributed import fast_all_reduce

    fast = object.__new__(fast_all_reduce.SymmMemAllReduce)
    fast.device, fast.group, fast.group_name, fast.max_bytes = torch.device("cpu"), None, "0", 64
    fast.buffer = torch.zeros(64, dtype=torch.uint8)
    calls = []

    def one_shot_copy_out(staged, local, op, group_name, out):
        staged.copy_(local)
        out.copy_(staged * 2)
        calls.append(("one_shot", tuple(staged.shape), staged.dtype, staged.data_ptr() == fast.buffer.data_ptr()))

    fast._copy_out, fast._out = one_shot_copy_out, None
    monkeypatch.setattr(
        fast_all_reduce.dist, "all_reduce", lambda x, group=None: calls.append(("nccl", tuple(x.shape)))
    )
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(fast.all_reduce(x), x * 2) and calls.pop() == ("one_shot", (2, 3), torch.float32, True)
    bf16 = torch.ones(4, 8, dtype=torch.bfloat16)  # exactly the 64 bytes of the buffer
    assert torch.equal(fast.all_reduce(bf16), bf16 * 2) and calls.pop()[:3] == ("one_shot", (4, 8), torch.bfloat16)
    for too_big_or_odd in (torch.ones(17), torch.ones(3, dtype=torch.bfloat16), torch.ones(4, dtype=torch.float16)):
        assert fast.all_reduce(too_big_or_odd) is too_big_or_odd and calls.pop() == (
            "nccl",
            tuple(too_big_or_odd.shape),
        )


def test_all_reduce_add_rms_norm_takes_the_fused_kernel_for_what_fits_and_else_sums_then_normalises(monkeypatch):
    """The dispatch of a norm that takes its input's all-reduce: the fused all-reduce + add + norm
    (``--all-reduce flashinfer``) for tensors it fits, else ``all_reduce`` then the norm kernel."""
    from framework import ops
    from framework.distributed import state

    fused_rows = []

    class FakeFused:
        def fits(self, x):
            return x.shape[0] <= 2

        def __call__(self, x, residual, weight, eps, offset):
            fused_rows.append(x.shape[0])
            return ops.fused_add_rms_norm(x, residual, weight, eps, offset)

    summed = []
    monkeypatch.setattr(state, "all_reduce", lambda x: summed.append(x.shape[0]) or x * 2)  # as if two ranks held x
    monkeypatch.setattr(state._state, "fused_all_reduce_norm", FakeFused())
    weight = torch.randn(8)
    for rows in (2, 5):
        x, residual = torch.randn(rows, 8), torch.randn(rows, 8)
        got = state.all_reduce_add_rms_norm(x, residual, weight, 1e-6, 1.0, ops.fused_add_rms_norm)
        want = ops.fused_add_rms_norm(x if rows <= 2 else x * 2, residual, weight, 1e-6, 1.0)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert fused_rows == [2] and summed == [5]


def test_an_engine_that_set_symmetric_memory_up_leaves_its_group_name_to_the_guard(monkeypatch):
    """Leaving the group records the name the engine set symmetric memory up on; the peer check of
    a later engine whose default group has that name then reports it (auto keeps NCCL)."""
    from framework.distributed import state

    monkeypatch.setattr(state, "SYMM_MEM_GROUPS_OF_EARLIER_ENGINES", set())
    monkeypatch.setattr(fast_all_reduce, "SYMM_MEM_GROUPS_OF_EARLIER_ENGINES", state.SYMM_MEM_GROUPS_OF_EARLIER_ENGINES)
    state.note_symm_mem_set_up("7")
    assert not fast_all_reduce._set_up_before()  # this engine's own set-up is not an earlier engine's
    state.destroy_tensor_parallel()
    assert state.SYMM_MEM_GROUPS_OF_EARLIER_ENGINES == {"7"} and state._state.symm_mem_group is None
    from types import SimpleNamespace

    world = SimpleNamespace(group_name="7")  # a later engine's default group, named as the first's
    monkeypatch.setattr(
        fast_all_reduce, "dist", SimpleNamespace(is_initialized=lambda: True, group=SimpleNamespace(WORLD=world))
    )
    assert fast_all_reduce._set_up_before()
    world.group_name = "8"
    assert not fast_all_reduce._set_up_before()


@pytest.mark.parametrize("defers", [True, False])
def test_flashinfer_fuses_only_where_the_models_norms_take_the_all_reduce(monkeypatch, defers):
    """``--all-reduce flashinfer`` sets the fused kernel up after the model is built, and only when
    some norm takes the all-reduce; otherwise the plain all-reduce stays and the summary says so."""

    from framework.distributed.all_reduce_policy import AllReducePolicy
    from framework.engine.tensor_parallel_start import norms_take_all_reduce
    from framework.layers import RMSNorm

    norm = RMSNorm(8)
    norm.reduces_input = defers
    enabled = []
    monkeypatch.setattr(all_reduce_policy, "enable_flashinfer_all_reduce_norm", lambda *args: enabled.append(args))
    policy = AllReducePolicy("flashinfer", "cuda:0", plain="symm_mem", fused_norm_required=True)
    policy.enable_fused_norm(norms_take_all_reduce(torch.nn.Sequential(norm)), "X", 16, 8, torch.bfloat16)
    assert policy.name == ("flashinfer" if defers else "symm_mem")
    assert enabled == ([("cuda:0", 16, 8, torch.bfloat16)] if defers else [])


@pytest.mark.parametrize("built", [True, False])
def test_auto_takes_the_fused_all_reduce_only_where_flashinfers_module_is_built(monkeypatch, built):
    """``--all-reduce auto`` on GPUs asks whether FlashInfer's communication module is on disk
    (ahead of time or an earlier JIT build: auto never starts the 7-minute build)."""
    import sys
    from types import ModuleType, SimpleNamespace

    from framework.distributed.all_reduce_policy import auto_flashinfer_or_not
    from framework.distributed.flashinfer_all_reduce import unavailable_reason

    comm = ModuleType("flashinfer.jit.comm")
    comm.gen_trtllm_comm_module = lambda: SimpleNamespace(is_compiled=built, is_aot=False)  # a JIT build, or none
    monkeypatch.setitem(sys.modules, "flashinfer.jit.comm", comm)
    monkeypatch.delenv("FLASHINFER_DISABLE_JIT", raising=False)
    reason = unavailable_reason()
    assert reason is None if built else "not built yet; --all-reduce flashinfer builds it once" in reason
    assert auto_flashinfer_or_not() == ("flashinfer" if built else "auto")
    monkeypatch.setenv("FLASHINFER_DISABLE_JIT", "1")  # FlashInfer then loads ahead-of-time modules only
    assert auto_flashinfer_or_not() == "auto"
    comm.gen_trtllm_comm_module = lambda: SimpleNamespace(is_compiled=built, is_aot=built)
    assert auto_flashinfer_or_not() == ("flashinfer" if built else "auto")
    monkeypatch.setitem(sys.modules, "flashinfer.jit.comm", None)  # FlashInfer not installed: the import fails
    assert unavailable_reason().startswith("FlashInfer is not available (ModuleNotFoundError")
    assert auto_flashinfer_or_not() == "auto"


@pytest.mark.parametrize("required", [True, False])
def test_a_fused_all_reduce_that_cannot_be_set_up_fails_when_asked_for_and_falls_back_under_auto(monkeypatch, required):

    from framework.distributed.all_reduce_policy import AllReducePolicy

    def refuse(*args):
        raise ConfigError("--all-reduce flashinfer: several hosts: use --all-reduce symm_mem or nccl")

    monkeypatch.setattr(all_reduce_policy, "enable_flashinfer_all_reduce_norm", refuse)
    policy = AllReducePolicy("flashinfer", "cuda:0", plain="nccl", fused_norm_required=required)
    if required:
        with pytest.raises(ConfigError, match="several hosts"):
            policy.enable_fused_norm(True, "X", 16, 8, torch.bfloat16)
    else:
        policy.enable_fused_norm(True, "X", 16, 8, torch.bfloat16)
        assert policy.name == "nccl"


@pytest.mark.parametrize(
    "asked, dtype, num_nodes, fused, required, plain",
    [
        ("auto", torch.bfloat16, 1, "flashinfer", False, "symm_mem"),  # built on every rank: taken, and may fall back
        ("auto", torch.float32, 1, "symm_mem", False, "symm_mem"),  # only bf16 was measured: FlashInfer is not asked
        ("auto", torch.bfloat16, 2, "symm_mem", False, "symm_mem"),  # several hosts: not asked either
        ("flashinfer", torch.float32, 1, "flashinfer", True, "symm_mem"),  # by name: any fused dtype; it must set up
        ("flashinfer", torch.float16, 1, "flashinfer", True, "nccl"),  # the one-shot op does not sum fp16: NCCL does
    ],
)
def test_setting_the_all_reduce_up_asks_flashinfer_only_for_bf16_on_one_host(
    monkeypatch, asked, dtype, num_nodes, fused, required, plain
):

    from framework.distributed import all_reduce_policy

    asked_flashinfer = []
    monkeypatch.setattr(all_reduce_policy, "enable_symm_mem_all_reduce", lambda *args, required: True)
    monkeypatch.setattr(all_reduce_policy, "auto_flashinfer_or_not", lambda: asked_flashinfer.append(1) or "flashinfer")
    policy = all_reduce_policy.AllReducePolicy(asked, torch.device("cuda", 0), num_nodes)
    policy.set_up(dtype, 64, 16)
    assert policy.name == fused and policy.fused_norm_required is required
    assert asked_flashinfer == ([1] if asked == "auto" and fused == "flashinfer" else [])
    assert policy.plain == plain  # what sums the rest (and everything, after a fallback)


@pytest.mark.parametrize("failing", ["load", "workspace"])
def test_flashinfer_set_up_failures_become_a_config_error_on_every_rank(monkeypatch, failing):
    """The module load (its JIT build the first time) and the workspace run inside ``try``; the
    ranks agree, and every one raises the ConfigError that ``auto`` falls back on."""
    import sys
    from types import ModuleType

    from framework.distributed import all_reduce_policy, fast_all_reduce, flashinfer_all_reduce, state

    trtllm_ar = ModuleType("flashinfer.comm.trtllm_ar")

    def load():
        if failing == "load":
            raise RuntimeError("JIT compilation is disabled via FLASHINFER_DISABLE_JIT")

    def workspace(*args):
        raise RuntimeError("CUDA out of memory")

    trtllm_ar.get_trtllm_comm_module = load
    monkeypatch.setitem(sys.modules, "flashinfer.comm.trtllm_ar", trtllm_ar)
    monkeypatch.setattr(fast_all_reduce, "peer_access_problem", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(flashinfer_all_reduce, "FlashInferFusedAllReduceNorm", workspace)
    agreed = []
    monkeypatch.setattr(state, "min_over_ranks", lambda value: agreed.append(value) or value)
    monkeypatch.setattr(state._state, "size", 2)
    message = {
        "load": r"communication module is not available \(RuntimeError: JIT compilation is disabled",
        "workspace": r"its workspace failed to set up \(RuntimeError: CUDA out of memory\)",
    }[failing]
    with pytest.raises(ConfigError, match=message):
        all_reduce_policy.enable_flashinfer_all_reduce_norm(torch.device("cuda", 0), 16, 64, torch.bfloat16)
    assert agreed[-1] == 0 and state._state.fused_all_reduce_norm is None
