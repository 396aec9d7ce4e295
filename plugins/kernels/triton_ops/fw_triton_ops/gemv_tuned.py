"""One-row GEMV settings measured on a GPU model, for the ``linear`` op (:func:`fw_triton_ops.gemv.linear`).

``TUNED_ONE_ROW[device name][(N, K)]`` is the fastest setting of the sweep for one row of
``[1, K] @ [N, K]^T`` in bf16, or ``None`` where cuBLAS (``F.linear``) was not beaten by 1 %: the
shapes one tensor-parallel rank holds of Llama-3-8B, Llama-3-70B, Qwen3-32B and Qwen3-0.6B at TP=1
and TP=2. Measured with the weights read from HBM (copies cycled through 512 MB, as a decode step
reads each weight once), each call replayed from a CUDA graph::

    python benchmarks/gemv_bandwidth.py --shape llama3-8b qwen3-32b llama3-70b qwen3-0.6b --tp 1 2 --rows 1

(``docs/benchmarks/2026-11-30-h200x2-gemv-cold-27df6aa.json``; comments: the GEMV's and cuBLAS's
microseconds, the layers of that shape). Shapes not listed take :func:`fw_triton_ops.gemv.gemv_config`'s
rule, fitted to the same sweep. Like vLLM's per-device kernel configs, a new GPU gets its own table
from the same command.
"""

from __future__ import annotations

from typing import NamedTuple


class GemvConfig(NamedTuple):
    """One launch setting of :func:`fw_triton_ops.gemv.gemv` (the benchmark sweeps these)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int = 4
    #: One row through ``tl.dot`` too (padded to 16 rows) instead of the elementwise product; more
    #: rows always take ``tl.dot``.
    tensor_cores: bool = False


TUNED_ONE_ROW: dict[str, dict[tuple[int, int], GemvConfig | None]] = {
    "NVIDIA H200": {
        (1024, 1024): GemvConfig(32, 256, 1, 4, tensor_cores=True),  # 4.3 us, cuBLAS 7.5: qwen3-0.6b TP2 o
        (1024, 1536): GemvConfig(32, 128, 4, 8),  # 5.0 us, cuBLAS 10.2: qwen3-0.6b TP2 down
        (1024, 2048): GemvConfig(32, 128, 4, 4, tensor_cores=True),  # 5.3 us, cuBLAS 12.7: qwen3-0.6b TP1 o
        (1024, 3072): GemvConfig(32, 128, 4, 4, tensor_cores=True),  # 6.2 us, cuBLAS 7.5: qwen3-0.6b TP1 down
        (2048, 1024): GemvConfig(32, 128, 1, 4, tensor_cores=True),  # 4.6 us, cuBLAS 4.7: qwen3-0.6b TP2 qkv
        (3072, 1024): GemvConfig(32, 128, 1, 4, tensor_cores=True),  # 4.9 us, cuBLAS 5.0: qwen3-0.6b TP2 gate_up
        (3072, 4096): GemvConfig(32, 128, 4, 4, tensor_cores=True),  # 10.3 us, cuBLAS 11.6: llama3-8b TP2 qkv
        (4096, 1024): GemvConfig(32, 128, 1, 4, tensor_cores=True),  # 5.1 us, cuBLAS 5.2: qwen3-0.6b TP1 qkv
        (4096, 2048): None,  # cuBLAS 7.1 us, GEMV 7.4: llama3-8b TP2 o
        (4096, 4096): GemvConfig(32, 256, 1, 4, tensor_cores=True),  # 12.0 us, cuBLAS 13.5: llama3-8b TP1 o
        (4096, 7168): GemvConfig(64, 256, 2, 4, tensor_cores=True),  # 17.9 us, cuBLAS 20.0: llama3-8b TP2 down
        (4096, 14336): GemvConfig(128, 128, 4, 4, tensor_cores=True),  # 31.1 us, cuBLAS 32.0: llama3-8b TP1 down
        (5120, 4096): None,  # cuBLAS 13.4 us, GEMV 13.6: qwen3-32b TP2 o
        (5120, 5120): None,  # cuBLAS 15.5 us, GEMV 16.0: qwen3-32b TP2 qkv
        (5120, 8192): GemvConfig(
            64, 256, 1, 4, tensor_cores=True
        ),  # 23.1 us, cuBLAS 26.3: qwen3-32b TP1 o, llama3-70b TP2 QKV
        (5120, 12800): GemvConfig(32, 128, 4, 8),  # 34.8 us, cuBLAS 38.3: qwen3-32b TP2 down
        (5120, 25600): GemvConfig(32, 128, 4, 4, tensor_cores=True),  # 65.1 us, cuBLAS 72.3: qwen3-32b TP1 down
        (6144, 1024): GemvConfig(64, 256, 1, 4, tensor_cores=True),  # 5.8 us, cuBLAS 5.9: qwen3-0.6b TP1 gate_up
        (6144, 4096): None,  # cuBLAS 15.4 us, GEMV 15.3: llama3-8b TP1 qkv
        (8192, 4096): GemvConfig(64, 256, 1, 4, tensor_cores=True),  # 18.2 us, cuBLAS 18.7: llama3-70b TP2 o
        (8192, 8192): GemvConfig(64, 256, 1, 4, tensor_cores=True),  # 33.2 us, cuBLAS 34.1: llama3-70b TP1 o
        (8192, 14336): GemvConfig(64, 256, 1, 4, tensor_cores=True),  # 56.2 us, cuBLAS 59.6: llama3-70b TP2 down
        (8192, 28672): GemvConfig(64, 256, 1, 4, tensor_cores=True),  # 107.4 us, cuBLAS 114.6: llama3-70b TP1 down
        (10240, 5120): None,  # cuBLAS 27.8 us, GEMV 27.9: qwen3-32b TP1 qkv
        (10240, 8192): GemvConfig(32, 128, 1, 4, tensor_cores=True),  # 42.2 us, cuBLAS 47.2: llama3-70b TP1 qkv
        (14336, 4096): GemvConfig(64, 128, 1, 4, tensor_cores=True),  # 30.2 us, cuBLAS 32.1: llama3-8b TP2 gate_up
        (25600, 5120): GemvConfig(128, 256, 1, 4, tensor_cores=True),  # 64.8 us, cuBLAS 68.3: qwen3-32b TP2 gate_up
        (28672, 4096): None,  # cuBLAS 57.0 us, GEMV 57.9: llama3-8b TP1 gate_up
        (28672, 8192): None,  # cuBLAS 108.6 us, GEMV 111.2: llama3-70b TP2 gate_up
        (51200, 5120): GemvConfig(128, 256, 1, 4, tensor_cores=True),  # 122.1 us, cuBLAS 134.0: qwen3-32b TP1 gate_up
        (57344, 8192): GemvConfig(64, 256, 1, 4, tensor_cores=True),  # 212.7 us, cuBLAS 219.8: llama3-70b TP1 gate_up
        (64128, 4096): GemvConfig(128, 128, 1, 4, tensor_cores=True),  # 121.6 us, cuBLAS 132.4: llama3-8b TP2 lm_head
        (64128, 8192): GemvConfig(64, 256, 1, 4, tensor_cores=True),  # 237.5 us, cuBLAS 257.2: llama3-70b TP2 lm_head
        (75968, 1024): GemvConfig(64, 128, 1, 4, tensor_cores=True),  # 38.5 us, cuBLAS 41.1: qwen3-0.6b TP2 lm_head
        (75968, 5120): GemvConfig(64, 128, 1, 4, tensor_cores=True),  # 176.2 us, cuBLAS 182.8: qwen3-32b TP2 lm_head
        (128256, 4096): GemvConfig(64, 128, 1, 4, tensor_cores=True),  # 237.5 us, cuBLAS 249.3: llama3-8b TP1 lm_head
        (128256, 8192): GemvConfig(64, 128, 1, 4, tensor_cores=True),  # 468.1 us, cuBLAS 491.5: llama3-70b TP1 lm_head
        (151936, 1024): GemvConfig(64, 128, 1, 4, tensor_cores=True),  # 72.7 us, cuBLAS 78.2: qwen3-0.6b TP1 lm_head
        (151936, 5120): GemvConfig(64, 128, 1, 4, tensor_cores=True),  # 349.4 us, cuBLAS 371.2: qwen3-32b TP1 lm_head
    }
}
