"""GPU checks: no host synchronisation and CUDA-graph replay, Triton kernels compiled for Hopper
without a GPU, and which kernels the layers ran."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest


def check_no_sync_and_cuda_graph_replay(run, inputs, fresh_inputs) -> None:
    """``run(*inputs)`` (tensors in, a tensor or a sequence of tensors out) on CUDA: after a warm-up call
    (compilation), a second call makes no host synchronisation, and a CUDA graph captured of it,
    replayed after ``fresh_inputs()`` is copied into ``inputs``, gives exactly what an eager call gives."""
    import torch

    run(*inputs)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(*inputs)
    for static, fresh in zip(inputs, fresh_inputs(), strict=True):
        static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(outs, run(*inputs), rtol=0, atol=0)


def require_triton() -> None:
    """Skip the calling test, or at module level the whole module, when triton is not installed."""
    pytest.importorskip(
        "triton", reason="triton is not installed (pip install 'triton>=3.4'; the interpreter runs it on CPU)"
    )


#: Marks a test that runs Triton kernels under the interpreter on the CPU (the root conftest sets
#: ``TRITON_INTERPRET=1`` there; where CUDA is present the kernels compile instead and these skip).
#: The condition is a string so that pytest reads the variable when the test runs, not at import.
interpreted = pytest.mark.skipif(
    'os.environ.get("TRITON_INTERPRET") != "1"',
    reason="CPU tests run the kernels under TRITON_INTERPRET=1 (off when CUDA is present)",
)


class HopperCompile(NamedTuple):
    """One kernel variant for :func:`compile_for_hopper`: the kernel as ``"module:name"``, the types
    of its pointer arguments (``"*bf16"``, ``"*i32"``...), its constexpr values, which other
    arguments are 64-bit ints or fp32 scalars (the rest are 32-bit ints), compile options
    (``num_warps``, ``num_stages``), and which arguments to compile as multiples of 16: Triton's
    launcher specializes a kernel so for a 16-byte-aligned pointer or an int divisible by 16, and
    vectorized loads depend on it, so list them to see the PTX a GPU launch with such values runs."""

    kernel: str
    pointer_types: dict[str, str]
    constexprs: dict[str, Any]
    int64_args: tuple[str, ...] = ()
    float_args: tuple[str, ...] = ()
    options: dict[str, Any] | None = None
    divisible_by_16: tuple[str, ...] = ()


def compile_for_hopper(cases: list[HopperCompile]) -> list[str]:
    """The PTX of each ``@triton.jit`` kernel variant, compiled for sm_90 (H100/H200) through
    Triton's whole pipeline and ``ptxas``, on any machine: no GPU needed.

    The interpreter runs a kernel's arithmetic on the CPU but never lowers it; this makes a kernel
    that would not compile on the GPU machine (a bad inline-PTX instruction, an unsupported mask
    type) or could not launch there (more shared memory than an SM has) fail in CI. It runs in a
    fresh process, because a process with ``TRITON_INTERPRET=1`` (as the CPU tests have) cannot
    lower kernels. Raises the compiler's error, or ``ValueError`` for the shared memory.
    """
    import concurrent.futures
    import multiprocessing

    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
            return pool.submit(_compile_for_hopper_here, cases).result()
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def _compile_for_hopper_here(cases: list[HopperCompile]) -> list[str]:
    import importlib
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptx = []
    for case in cases:
        module, name = case.kernel.split(":")
        kernel = getattr(importlib.import_module(module), name)
        unknown = set(case.divisible_by_16) - set(inspect.signature(kernel.fn).parameters)
        if unknown:
            raise ValueError(f"{case.kernel} has no arguments {sorted(unknown)} to compile as multiples of 16")
        signature = {}
        attrs = {}
        for index, arg in enumerate(inspect.signature(kernel.fn).parameters):
            if arg in case.divisible_by_16:
                attrs[(index,)] = [["tt.divisibility", 16]]
            if arg in case.constexprs:
                signature[arg] = "constexpr"
            elif arg in case.pointer_types:
                signature[arg] = case.pointer_types[arg]
            else:
                signature[arg] = "i64" if arg in case.int64_args else "fp32" if arg in case.float_args else "i32"
        source = ASTSource(kernel, signature, constexprs=case.constexprs, attrs=attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=case.options or {})
        if compiled.metadata.shared > HOPPER_SHARED_MEMORY:  # Triton itself checks this only when loading on a GPU
            raise ValueError(
                f"{case.kernel} {case.constexprs} needs {compiled.metadata.shared} bytes of shared memory; "
                f"an H100/H200 SM has {HOPPER_SHARED_MEMORY}"
            )
        ptx.append(compiled.asm["ptx"])
    return ptx


#: Shared memory one thread block may use on an H100/H200 (227 KiB).
HOPPER_SHARED_MEMORY = 232448


@contextlib.contextmanager
def count_kernel_calls() -> Iterator[dict[str, int]]:
    """Count what the layers and engines built inside the block call: ``{"op/name": calls}`` for
    the kernel registry's implementations (``"fused_moe/triton"``, ``"rms_norm/torch"``) and
    ``{"attention/name": calls}`` for the attention backend's ``forward``.

    Layers resolve their kernels at construction (:func:`framework.kernels.get_kernel`), so build
    the engine inside the block; shared rotary modules are rebuilt for it. Replays of a CUDA graph
    do not reach Python: the counts are of eager calls and graph captures (prefill is eager).
    :func:`check_kernels_used` turns the counts into a test that a fallback fails.
    """
    import collections
    import functools

    from framework import kernels
    from framework.engine.builder import EngineBuilder
    from framework.layers import rotary

    calls: collections.Counter[str] = collections.Counter()

    def counted(key: str, function: Any) -> Any:
        @functools.wraps(function)
        def counting(*args: Any, **kwargs: Any) -> Any:
            calls[key] += 1
            return function(*args, **kwargs)

        return counting

    resolve, select_backend = kernels._resolve, EngineBuilder.select_attention_backend

    def counting_resolve(op: str, name: str | None, generation: int, device_type: str | None) -> Any:
        key = kernels._select(op, name, device_type).key  # the spec whose implementation ``_resolve`` loads
        return counted(key, resolve(op, name, generation, device_type))

    def counting_select_backend(builder: EngineBuilder) -> Any:
        backend = select_backend(builder)
        backend.forward = counted(f"attention/{builder.backend_name}", backend.forward)
        return backend

    rotary._cached_rope.cache_clear()  # a rotary module built before the block holds an uncounted kernel
    kernels._resolve, EngineBuilder.select_attention_backend = counting_resolve, counting_select_backend
    try:
        yield calls
    finally:
        kernels._resolve, EngineBuilder.select_attention_backend = resolve, select_backend
        rotary._cached_rope.cache_clear()  # nor may later models share a counting one


def check_kernels_used(calls: dict[str, int], expected: dict[str, str]) -> None:
    """Every op of ``expected`` (``{"fused_moe": "triton", "attention": "triton", ...}``; ``"attention"``
    is the attention backend) ran, through the named implementation and no other. ``calls`` come
    from :func:`count_kernel_calls`; an op that fell back to another implementation (the torch
    reference where Triton was meant), or never ran, fails with the counts of that op."""
    failures = []
    for op, name in sorted(expected.items()):
        ran = {key.partition("/")[2]: count for key, count in calls.items() if key.partition("/")[0] == op and count}
        if set(ran) != {name}:
            failures.append(f"{op}: expected only {name!r} to run, ran {ran or 'nothing'}")
    assert not failures, "; ".join(failures) + f" (all calls: {dict(sorted(calls.items()))})"
