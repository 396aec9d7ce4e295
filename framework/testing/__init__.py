"""Test helpers for fw and for plugin authors (a pytest plugin: ``pytest_plugins = ["framework.testing"]``).

Fixtures:

* ``register_fw_plugin``: ``register_fw_plugin(obj, name="x")`` registers a plugin object (a
  module or any object with ``@hookimpl`` methods) for the current test only.
* ``fresh_plugins``: forget loaded plugins before and after the test, so a test can set
  ``FW_PLUGINS`` / ``FW_DISABLE_PLUGINS`` with ``monkeypatch`` and load again.
* ``one_thread`` (module scope): torch on one intra-op thread for a module of tiny-model tests
  (threads only add synchronisation there, and on a busy 2-core runner OpenMP's spinning threads
  make them many times slower); the previous setting is restored after the module.

The helpers live in modules by kind (``fixtures``, ``model_writers``, ``tiny_configs``,
``attention``, ``parsers``, ``parity``, ``gpu``, ``metrics``, ``quant``, ``vision``,
``vision_checks``, ``vision_llama4``, ``vision_gemma3``, ``sparse_mla``) and are all importable from here.

Conformance kits for plugin authors: attention backends (``check_attention_backend``, also on a
quantized KV dtype against attention over the dequantized cache; sparse MLA,
``check_sparse_mla_attention_backend``), tool
parsers, model parity (``ModelParityTests``), and quantization methods against
dequantize-then-matmul (``check_linear_method``, ``check_moe_method``, in :mod:`framework.testing.quant`).
"""

from __future__ import annotations

from typing import Any

from framework.testing.attention import (
    ATTENTION_CASES,
    BIDIRECTIONAL_SPAN_CASES,
    CHUNKED_ATTENTION_CASES,
    MLA_ATTENTION_CASES,
    allocate_test_cache,
    as_cached,
    check_attention_backend,
    check_mla_attention_backend,
    dense_attention,
    span_ends,
)
from framework.testing.fixtures import (
    fresh_plugins,
    one_thread,
    register_fw_plugin,
    registered_plugin,
)
from framework.testing.gpu import (
    HOPPER_SHARED_MEMORY,
    HopperCompile,
    check_kernels_used,
    check_no_sync_and_cuda_graph_replay,
    compile_for_hopper,
    count_kernel_calls,
    interpreted,
    require_triton,
)
from framework.testing.metrics import (
    metric_value,
)
from framework.testing.model_writers import (
    make_tiny_tokenizer,
    random_causal_lm,
    randomise_identity_params,
    write_grouped_moe_model,
    write_randomised_model,
    write_tiny_model,
)
from framework.testing.parity import (
    PARITY_PROMPTS,
    ModelParityTests,
    StepLaunch,
    StepOverlapLog,
    capture_logits,
    check_greedy_parity,
    check_logits_parity,
    check_preemption_parity,
    check_prefix_cache_parity,
    generate_in_new_process,
    record_step_overlaps,
    reference_greedy,
    reference_logits,
    tiny_model_fixture,
)
from framework.testing.parsers import (
    check_tool_parser_streaming,
    random_chunks,
)
from framework.testing.sparse_mla import (
    SPARSE_MLA_CASES,
    check_sparse_mla_attention_backend,
)
from framework.testing.tiny_configs import tiny_gemma4_text, tiny_llama4_text
from framework.testing.vision import (
    IMAGE_TOKEN,
    IMAGE_TOKEN_ID,
    MISTRAL3_SPECIALS,
    TINY_PREPROCESSOR,
    VISION_CHAT_TEMPLATE,
    VISION_SPECIALS,
    data_url,
    random_image,
    write_tiny_mistral3,
    write_tiny_qwen2_5_vl,
    write_tiny_qwen3_5_vl,
    write_tiny_qwen3_vl,
    write_vision_checkpoint,
)
from framework.testing.vision_checks import (
    VisionReference,
    check_image_request,
    check_preempted_image_requests,
    check_prefix_hit_inside_an_image,
    check_text_only_prompt,
    engine_logits,
    image_chat,
    qwen_vl_inputs,
)
from framework.testing.vision_gemma3 import (
    GEMMA3_CHAT_TEMPLATE,
    GEMMA3_SPECIALS,
    gemma3_inputs,
    write_gemma3_tokenizer,
    write_tiny_gemma3,
)
from framework.testing.vision_llama4 import LLAMA4_SPECIALS, write_tiny_llama4

#: everything here, importable as ``framework.testing.NAME`` (the fixtures are also seen by pytest here)
__all__ = [
    "SPARSE_MLA_CASES",
    "check_sparse_mla_attention_backend",
    "ATTENTION_CASES",
    "BIDIRECTIONAL_SPAN_CASES",
    "CHUNKED_ATTENTION_CASES",
    "MLA_ATTENTION_CASES",
    "allocate_test_cache",
    "as_cached",
    "check_attention_backend",
    "check_mla_attention_backend",
    "dense_attention",
    "span_ends",
    "fresh_plugins",
    "one_thread",
    "register_fw_plugin",
    "registered_plugin",
    "HOPPER_SHARED_MEMORY",
    "HopperCompile",
    "check_kernels_used",
    "check_no_sync_and_cuda_graph_replay",
    "compile_for_hopper",
    "count_kernel_calls",
    "interpreted",
    "require_triton",
    "metric_value",
    "make_tiny_tokenizer",
    "random_causal_lm",
    "randomise_identity_params",
    "write_grouped_moe_model",
    "write_randomised_model",
    "write_tiny_model",
    "PARITY_PROMPTS",
    "ModelParityTests",
    "StepLaunch",
    "StepOverlapLog",
    "capture_logits",
    "check_greedy_parity",
    "check_logits_parity",
    "check_preemption_parity",
    "check_prefix_cache_parity",
    "generate_in_new_process",
    "record_step_overlaps",
    "reference_greedy",
    "reference_logits",
    "tiny_model_fixture",
    "check_tool_parser_streaming",
    "random_chunks",
    "IMAGE_TOKEN",
    "IMAGE_TOKEN_ID",
    "LLAMA4_SPECIALS",
    "GEMMA3_CHAT_TEMPLATE",
    "GEMMA3_SPECIALS",
    "MISTRAL3_SPECIALS",
    "TINY_PREPROCESSOR",
    "VISION_CHAT_TEMPLATE",
    "VISION_SPECIALS",
    "data_url",
    "random_image",
    "write_tiny_qwen2_5_vl",
    "write_tiny_llama4",
    "write_tiny_gemma3",
    "write_tiny_mistral3",
    "write_tiny_qwen3_5_vl",
    "write_tiny_qwen3_vl",
    "write_vision_checkpoint",
    "tiny_gemma4_text",
    "VisionReference",
    "check_image_request",
    "check_preempted_image_requests",
    "check_prefix_hit_inside_an_image",
    "check_text_only_prompt",
    "engine_logits",
    "image_chat",
    "qwen_vl_inputs",
    "gemma3_inputs",
    "write_gemma3_tokenizer",
    "tiny_llama4_text",
    "QuantScheme",
    "check_linear_method",
    "check_moe_method",
]

_QUANT_KITS = ("QuantScheme", "check_linear_method", "check_moe_method")


def __getattr__(name: str) -> Any:
    """The quantization conformance kits (:mod:`framework.testing.quant`), imported on first use
    (they import torch; this module does not)."""
    if name in _QUANT_KITS:
        from framework.testing import quant

        return getattr(quant, name)
    raise AttributeError(f"module 'framework.testing' has no attribute {name!r}")
