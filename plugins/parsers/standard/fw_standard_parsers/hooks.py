"""Entry point of the ``standard_parsers`` plugin: parsers by name, and which ones a chat template wants."""

from __future__ import annotations

from typing import Any

from framework import hookimpl
from framework.specs import ParserSpec

TOOL_PARSERS = {
    "qwen": ("hermes:HermesToolParser", "Qwen 2.5 / Qwen 3 / Hermes: JSON inside <tool_call>...</tool_call>"),
    "hermes": ("hermes:HermesToolParser", "alias of qwen"),
    "qwen_coder": (
        "qwen_coder:QwenCoderToolParser",
        "Qwen3-Coder: <tool_call><function=name><parameter=k>v</parameter></function></tool_call>",
    ),
    "json": ("json_calls:JsonToolParser", "a reply that is a bare JSON call object or an array of them"),
    "mistral": ("mistral:MistralToolParser", "Mistral: [TOOL_CALLS] then a JSON array, or name[ARGS]{...}"),
    "llama3": (
        "llama3:Llama3ToolParser",
        "Llama 3.1+: JSON {name, parameters}, or after <|python_tag|>; ';' between calls",
    ),
    "harmony": (
        "harmony:HarmonyToolParser",
        "gpt-oss harmony: <|channel|>commentary to=functions.NAME<|message|>{...}<|call|>",
    ),
}

REASONING_PARSERS = {
    "qwen3": (
        "think:Qwen3ReasoningParser",
        "<think>...</think> when the reply (or the prompt) opens it, else all content",
    ),
    "deepseek_r1": ("think:DeepSeekR1ReasoningParser", "reasoning until </think> (the template opens <think>)"),
    "harmony": ("harmony:HarmonyReasoningParser", "gpt-oss harmony: the analysis channel; final -> content"),
}

#: (text in the chat template, tool parser name), most specific first.
TOOL_TEMPLATE_SIGNS = (
    ("<function=", "qwen_coder"),
    ("<tool_call>", "qwen"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3"),
    ('"parameters": dictionary of argument name and its value', "llama3"),  # Llama 3.2 / 3.3: bare JSON calls
)


@hookimpl
def register_tool_parsers() -> list[ParserSpec]:
    return [
        ParserSpec(name=name, impl=f"fw_standard_parsers.{impl}", description=description, kind="tool")
        for name, (impl, description) in TOOL_PARSERS.items()
    ]


@hookimpl
def register_reasoning_parsers() -> list[ParserSpec]:
    return [
        ParserSpec(name=name, impl=f"fw_standard_parsers.{impl}", description=description, kind="reasoning")
        for name, (impl, description) in REASONING_PARSERS.items()
    ]


@hookimpl
def default_parsers(chat_template: str | None = None) -> dict[str, Any] | None:
    """Parsers for the markup a chat template writes; None (pass) when it shows none we know."""
    if not chat_template:
        return None
    if "<|channel|>" in chat_template:  # gpt-oss: one format for both
        return {"tool": "harmony", "reasoning": "harmony"}
    tool = next((name for sign, name in TOOL_TEMPLATE_SIGNS if sign in chat_template), None)
    reasoning = None
    if "<think>" in chat_template or "</think>" in chat_template:
        reasoning = "deepseek_r1" if "<｜Assistant｜>" in chat_template else "qwen3"
    if tool is None and reasoning is None:
        return None
    return {"tool": tool, "reasoning": reasoning}
