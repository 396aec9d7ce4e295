"""Chat requests as the chat template takes them: refused fields, messages, the rendered prompt and its ids.

Shared by every endpoint that speaks through the chat template (chat completions, responses,
messages, /tokenize): they all build a :class:`~framework.server.protocol.ChatCompletionRequest`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from framework.engine.outputs import LogprobEntry
from framework.errors import ConfigError
from framework.server.chat_tokens import encode_chat
from framework.server.chat_tools import template_tool_calls
from framework.server.errors import APIError, bad_request
from framework.server.protocol import (
    DEFAULT_VALUES,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from framework.tokenizer import Tokenizer

#: The ``reasoning_effort`` values a request may give (they reach the template as ``reasoning_effort``).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """The extra variables the chat template sees: ``chat_template_kwargs``, plus ``reasoning_effort``
    when the request gives one (a kwarg of the same name wins)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        if body.reasoning_effort not in REASONING_EFFORTS:
            raise bad_request(
                f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}; got {body.reasoning_effort!r}",
                "reasoning_effort",
            )
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


def refuse_fields(body: Any, names: tuple[str, ...], accepted: dict[str, tuple[Any, ...]]) -> None:
    """A field fw does not support yet is a 400 naming it, never silently ignored (unless it is
    set to one of its ``accepted`` values, which ask for what fw does anyway)."""
    for name in names:
        value = getattr(body, name)
        if value is not None and not any(type(value) is type(ok) and value == ok for ok in accepted.get(name, ())):
            raise APIError(
                400, f"{name!r} is not supported by this server yet", param=name, code="unsupported_parameter"
            )


def reject_unsupported(body: Any, names: tuple[str, ...]) -> None:
    """:func:`refuse_fields` with the chat and completions defaults (:data:`DEFAULT_VALUES`), and
    the refused values of ``stream_options`` and ``best_of``."""
    refuse_fields(body, names, DEFAULT_VALUES)
    options = getattr(body, "stream_options", None)
    if options is not None and options.continuous_usage_stats:
        raise APIError(
            400,
            "'stream_options.continuous_usage_stats' is not supported by this server yet; "
            "'include_usage' sends the usage at the end",
            param="stream_options.continuous_usage_stats",
            code="unsupported_parameter",
        )
    if getattr(body, "best_of", None) not in (None, 1, getattr(body, "n", 1)):
        raise APIError(
            400, "'best_of' is not supported by this server yet", param="best_of", code="unsupported_parameter"
        )


def template_messages(
    messages: list[ChatMessage], allow_images: bool = False, text_only_reason: str | None = None
) -> list[dict[str, Any]]:
    """Messages as the chat template expects them; text-only content parts are joined text. With
    ``allow_images`` (a vision model's chat completion) a content with ``image_url`` parts stays a
    list of parts (:func:`framework.server.chat_images.chat_prompt_with_images` takes them)."""
    if not messages:
        raise bad_request("'messages' must hold at least one message", "messages")
    result = []
    for i, message in enumerate(messages):
        if message.role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(
                f"messages[{i}].role must be one of system, developer, user, assistant, tool; got {message.role!r}",
                f"messages[{i}].role",
            )
        content = message.content
        if isinstance(content, list) and any(part.get("type") == "image_url" for part in content):
            content = image_parts(content, i, allow_images, text_only_reason)
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"content part type {part.get('type')!r} is not supported (only 'text')",
                        param=f"messages[{i}].content[{j}].type",
                        code="unsupported_parameter",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        item: dict[str, Any] = {"role": message.role, "content": content or ""}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(message, key) is not None:
                item[key] = getattr(message, key)
        if message.tool_calls is not None:
            item["tool_calls"] = template_tool_calls(message.tool_calls)
        if message.reasoning is not None and message.reasoning_content is None:
            item["reasoning_content"] = message.reasoning
        result.append(item)
    return result


def image_parts(
    content: list[dict[str, Any]], index: int, allow_images: bool, text_only_reason: str | None = None
) -> list[dict[str, Any]]:
    """A content list with images, checked: only ``text`` and ``image_url`` parts, and images only
    where ``allow_images`` (else a 400 naming the first image part, and ``text_only_reason`` where
    the model is a vision model served without its vision tower)."""
    for j, part in enumerate(content):
        param = f"messages[{index}].content[{j}]"
        if part.get("type") == "image_url" and not allow_images:
            why = (
                f": {text_only_reason}"
                if text_only_reason
                else " (image_url parts need a vision model, through /v1/chat/completions)"
            )
            raise APIError(
                400,
                f"{param} is an image, and this model does not take images{why}",
                param=param,
                code="unsupported_parameter",
            )
        if part.get("type") == "text" and not isinstance(part.get("text"), str):
            raise bad_request(f"{param}.text must be a string", f"{param}.text")
        if part.get("type") not in ("text", "image_url"):
            raise APIError(
                400,
                f"content part type {part.get('type')!r} is not supported (only 'text' and 'image_url')",
                param=f"{param}.type",
                code="unsupported_parameter",
            )
    return content


def chat_prompt_text(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    tools: list[dict[str, Any]] | None = None,
    messages: list[dict[str, Any]] | None = None,
) -> str:
    """The rendered prompt: the messages (and ``tools``) through the model's chat template."""
    messages = template_messages(body.messages) if messages is None else messages
    kwargs = template_kwargs(body)
    add_generation_prompt = kwargs.pop("add_generation_prompt", body.add_generation_prompt)
    kwargs.pop("tools", None)
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
    except ConfigError as error:
        raise bad_request(str(error), "messages") from None
    except Exception as error:  # jinja2 errors from the model's own template
        raise bad_request(f"the chat template failed on these messages: {error}", "messages") from None


def chat_prompt(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    tools: list[dict[str, Any]] | None = None,
    messages: list[dict[str, Any]] | None = None,
    template_text: Callable[[str], str] | None = None,
) -> tuple[str, list[int]]:
    """The rendered prompt and its token ids, the client's text kept out of the control tokens
    (:func:`framework.server.chat_tokens.encode_chat`, ``template_text`` its rewrite of the
    template's text)."""
    messages = template_messages(body.messages) if messages is None else messages
    return encode_chat(
        tokenizer,
        messages,
        lambda shaped: chat_prompt_text(tokenizer, body, tools, shaped),
        {"tools": tools, "chat_template_kwargs": template_kwargs(body)},
        template_text,
    )


def chat_prompt_ids(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    return chat_prompt(tokenizer, body)[1]


def chat_logprobs(
    tokenizer: Tokenizer, entries: list[LogprobEntry] | None, token_ids: list[int]
) -> ChatLogprobs | None:
    if entries is None:
        return None
    content = []
    for token_id, (logprob, top) in zip(token_ids, entries, strict=False):
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        alternatives = [
            TopLogprob(
                token=(text := tokenizer.decode([tid], skip_special_tokens=False)),
                logprob=lp,
                bytes=list(text.encode()),
            )
            for tid, lp in top
        ]
        content.append(
            ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=alternatives)
        )
    return ChatLogprobs(content=content)
