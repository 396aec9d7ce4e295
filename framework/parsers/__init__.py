"""Output parsers: tool calls and reasoning, run per request in the API process.

The base classes (:class:`~framework.parsers.base.ToolParser`,
:class:`~framework.parsers.base.ReasoningParser`) and the shared machinery live here; the
parsers users pick by name (``qwen``, ``mistral``, ``deepseek_r1``, ...) arrive through the
``register_tool_parsers`` / ``register_reasoning_parsers`` hooks.
"""
