"""A device out-of-memory error at start-up, turned into an error that names the flag to change."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from framework.errors import ConfigError

#: start-up step -> what to change when the device runs out of memory in it
HINTS = {
    "loading the weights": "the weights do not fit: spread them over more GPUs (--tp / --d 0,1), pick a quantized "
    "checkpoint (a GGUF file with --f), or a 16-bit --dtype",
    "setting the all-reduce up": "lower --max-num-seqs (its buffers grow with it), or use --all-reduce nccl",
    "allocating the KV cache": "lower --gpu-memory-utilization or --kv-fraction, or give a smaller --mem MB",
    "capturing CUDA graphs": "lower --max-num-seqs, or turn the graphs off with --disable-cuda-graph; the KV "
    "cache leaves room with a lower --kv-fraction / --gpu-memory-utilization",
}


@contextlib.contextmanager
def out_of_memory_names_the_flag(step: str) -> Iterator[None]:
    """Re-raise a device out-of-memory error inside ``step`` as a :class:`ConfigError` with its hint."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        first_line = str(error).splitlines()[0] if str(error) else "out of memory"
        raise ConfigError(f"the device ran out of memory while {step} ({first_line}): {HINTS[step]}") from None
