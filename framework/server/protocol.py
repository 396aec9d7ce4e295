"""Request and response bodies of the OpenAI-compatible API, as msgspec Structs.

Requests ignore unknown fields (as OpenAI does); fields OpenAI defines that fw does not support
yet are declared with a ``None`` default so that setting one is rejected with a 400 naming it
(see :data:`UNSUPPORTED_CHAT_FIELDS`) instead of being silently ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

Stop = str | list[str] | None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    #: vLLM's usage in every chunk: not supported, so ``true`` is a 400.
    continuous_usage_stats: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    # structured outputs (framework/server/structured_outputs.py): at most one of these
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI and vLLM fields fw does not support yet: setting one is a 400 naming it.
    best_of: int | None = None
    service_tier: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    prompt_logprobs: Any = None
    priority: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class MCPExecuteFields(msgspec.Struct, kw_only=True):
    """fw extensions of every chat-like request: let the server run the MCP tools the model calls,
    for at most ``mcp_max_rounds`` rounds."""

    mcp_execute: bool = False
    mcp_max_rounds: int = 4


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: Any = None
    #: reaches the chat template as the variable ``reasoning_effort``
    reasoning_effort: str | None = None
    add_special_tokens: Any = None
    documents: Any = None
    chat_template: Any = None
    echo: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    # fw extensions (the fields of MCPExecuteFields; a Struct has one base with fields)
    mcp_execute: bool = False
    mcp_max_rounds: int = 4


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, strings, token ids, or lists of token ids (checked by the handler)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    response_format: Any = None


#: Sampling fields fw rejects when set to anything but their default (None, or what is listed).
UNSUPPORTED_SAMPLING_FIELDS = (
    "service_tier",
    "use_beam_search",
    "length_penalty",
    "prompt_logprobs",
    "priority",
    "truncate_prompt_tokens",
    "allowed_token_ids",
    "bad_words",
    "logits_processors",
    "spaces_between_special_tokens",
    "return_tokens_as_token_ids",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
)
#: Values of a refused field that ask for what fw does anyway (so they are accepted).
DEFAULT_VALUES: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "priority": (0,),
    "length_penalty": (1.0, 1),
    "continue_final_message": (False,),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    "echo": (False,),
    "bad_words": ([],),
    "logits_processors": ([],),
    "add_special_tokens": (False,),
    "documents": ([],),
    "service_tier": ("auto", "default"),
}
#: Fields that fw rejects when set (not None / not their default).
UNSUPPORTED_CHAT_FIELDS = (
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "echo",
    *UNSUPPORTED_SAMPLING_FIELDS,
)
UNSUPPORTED_COMPLETION_FIELDS = ("suffix", *UNSUPPORTED_SAMPLING_FIELDS)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


# --- responses ---------------------------------------------------------------------------
class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None

    @classmethod
    def counted(cls, prompt_tokens: int, completion_tokens: int, num_cached: int = 0) -> Usage:
        """The usage of a reply; ``prompt_tokens_details.cached_tokens`` only when some prompt tokens were cached."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details={"cached_tokens": num_cached} if num_cached else None,
        )


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed piece of a tool call: the first carries id, type and name; later ones arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class MCPCallRecord(msgspec.Struct, kw_only=True):
    """fw extension (``mcp_execute``): one tool call the server ran, and what the tool returned."""

    id: str
    name: str
    arguments: str
    result: str
    is_error: bool = False


class ResponseMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    #: fw extension: the MCP calls the server executed for this reply (``mcp_execute``).
    mcp_calls: list[MCPCallRecord] | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    #: fw extension (``mcp_execute``): calls the server ran between two rounds, with their results.
    mcp_calls: list[MCPCallRecord] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    system_fingerprint: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    model: str
    choices: list[ChatStreamChoice]
    created: int
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    choices: list[CompletionChoice]
    created: int
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class ToolCallingInfo(msgspec.Struct, kw_only=True):
    """fw extension of a model card: how this server reads tool calls for the model.

    ``path``: ``native`` (the parser the chat template's markup or ``--enforce-parser`` names),
    ``generic`` (fw's ``<tool_call>`` JSON format) or ``none``; the ``template_renders_*``
    flags say what the chat template shows (fw writes the rest into the conversation).
    """

    path: str
    parser: str | None
    auto_constrained: bool
    template_renders_tools: bool
    template_renders_tool_calls: bool
    template_renders_tool_results: bool
    description: str


class VisionInfo(msgspec.Struct, kw_only=True):
    """fw extension of a model card: the model takes images (``image_url`` content parts of chat
    completions) within these bounds; ``null`` on a text-only model's card.

    ``max_images``: per prompt (a conversation's images all count); ``formats``: the MIME types a
    ``data:`` URL may name; ``max_image_bytes`` / ``max_image_pixels``: one image, encoded /
    decoded; ``max_request_bytes``: the server's body cap (``--max-request-bytes``), which a
    conversation's images share, base64-encoded, with its text.
    """

    max_images: int
    formats: list[str]
    max_image_bytes: int
    max_image_pixels: int
    max_request_bytes: int


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "fw"
    root: str | None = None
    tool_calling: ToolCallingInfo | None = None
    vision: VisionInfo | None = None


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class TokenizeResponse(msgspec.Struct, kw_only=True):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[Any]  # strings, token ids, or lists of token ids (checked by the handler)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    # fw extension: how hidden states are pooled (mean over the input, or the last token)
    pooling: Literal["mean", "last"] = "mean"
    # OpenAI field fw does not support: setting it is a 400 naming it.
    dimensions: int | None = None


UNSUPPORTED_EMBEDDING_FIELDS = ("dimensions",)


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo
