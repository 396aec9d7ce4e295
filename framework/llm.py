"""The programmatic API in the shape vLLM users know: ``LLM(...).generate(...)`` and ``.chat(...)``.

from framework import LLM, SamplingParams
llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from framework import plugins
from framework.engine.args import EngineArgs
from framework.engine.builder import EngineBuilder
from framework.engine.built_engine import Engine
from framework.engine.outputs import GRAMMAR_FAILED, LogprobEntry
from framework.engine.request import FinishReason
from framework.errors import ConfigError, RequestFailedError
from framework.multimodal.inputs import load_processor
from framework.multimodal.prompt import first_image_part, vision_prompt
from framework.output_text import SequenceText
from framework.sampling_params import SamplingParams

Prompt = str | dict[str, Any]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a prompt."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass(slots=True)
class GenerationResult:
    """All outputs of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[LogprobEntry | None] | None = None
    num_cached_tokens: int = 0


class LLM:
    """An in-process engine with text in and text out.

    ``LLM(model, **options)`` takes the :class:`~framework.engine.args.EngineArgs` fields as keyword
    options (``LLM(args=EngineArgs(...))`` a built one), validated before anything loads.
    """

    def __init__(self, model: str | None = None, *, args: EngineArgs | None = None, **options: Any) -> None:
        self.engine: Engine = EngineBuilder(model, args=args, **options).build()
        self._ids = itertools.count()
        self._closed = False
        self._image_processor = None  # a vision model's, built on the first image
        plugins.call_lifecycle_sync("startup", engine=self.engine)

    def close(self) -> None:
        """Tell the plugins (``shutdown``) and stop the tensor-parallel workers, if any (they also stop
        when this process exits); idempotent."""
        if not self._closed:
            self._closed = True
            plugins.call_lifecycle_sync("shutdown", engine=self.engine)
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError(
            "a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]} (with 'images': "
            "[ImageInput, ...] for a vision model)"
        )

    def generate(
        self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Generate for every prompt (batched together); one result per prompt, in order."""
        prompts = prompts if isinstance(prompts, list) else [prompts]
        params_list = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        core = self.engine.core
        results: list[GenerationResult] = []
        sequences: dict[str, tuple[CompletionOutput, SequenceText | None, GenerationResult, SamplingParams]] = {}
        for prompt, params in zip(prompts, params_list):
            text, ids = self._prompt_ids(prompt)
            images = prompt.get("images") if isinstance(prompt, dict) else None
            result = GenerationResult(str(next(self._ids)), text, ids, [])
            results.append(result)
            for index in range(params.n):
                child = (
                    params
                    if params.n == 1
                    else params.replace(n=1, seed=None if params.seed is None else params.seed + index)
                )
                request_id = f"{result.request_id}-{index}"
                output = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
                result.outputs.append(output)
                # stop strings are matched on the text as it grows; without them the text is
                # decoded once at the end (the same text, without a per-token cost in the loop)
                sequence_text = SequenceText(self.tokenizer, child) if any(child.stop) else None
                sequences[request_id] = (output, sequence_text, result, child)
                core.add_request(request_id, ids, child, images=images)
        while core.has_unfinished():
            for step in core.step():
                if step.error is not None:  # the engine gave it up (its grammar failed to compile, or its step failed)
                    for request_id in sequences:
                        core.abort(request_id)
                    error_type = ConfigError if step.error_kind == GRAMMAR_FAILED else RequestFailedError
                    raise error_type(f"request {step.request_id}: {step.error}")
                output, sequence_text, result, _ = sequences[step.request_id]
                output.token_ids.extend(step.new_token_ids)
                if step.new_logprobs and output.logprobs is not None:
                    output.logprobs.extend(step.new_logprobs)
                if step.prompt_logprobs is not None:
                    result.prompt_logprobs = step.prompt_logprobs
                result.num_cached_tokens = step.num_cached_tokens
                if sequence_text is not None and sequence_text.add(step.new_token_ids) and step.finish_reason is None:
                    core.abort(step.request_id)
                    output.finish_reason, output.stop_reason = FinishReason.STOP.value, sequence_text.stop_string
                elif step.finish_reason is not None:
                    output.finish_reason, output.stop_reason = step.finish_reason, step.stop_token_id
        for output, sequence_text, _, child in sequences.values():
            output.text = (
                sequence_text.text
                if sequence_text is not None
                else self.tokenizer.decode(output.token_ids, child.skip_special_tokens)
            )
        return results

    def embed(self, prompts: Prompt | list[Prompt], pooling: str = "mean") -> list[list[float]]:
        """L2-normalized pooled final hidden states (``mean`` over the prompt, or the ``last`` token)."""
        prompts = prompts if isinstance(prompts, list) else [prompts]
        core, ids = self.engine.core, []
        for prompt in prompts:
            request_id = f"embd-{next(self._ids)}"
            core.add_request(request_id, self._prompt_ids(prompt)[1], SamplingParams(max_tokens=1), pooling=pooling)
            ids.append(request_id)
        found: dict[str, list[float]] = {}
        while core.has_unfinished():
            found.update((out.request_id, out.embedding) for out in core.step() if out.embedding is not None)
        return [found[request_id] for request_id in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[GenerationResult]:
        """Apply the chat template to one conversation (or a list of them) and generate.

        A vision model's messages may hold image content parts: ``{"type": "image_url", "image_url":
        {"url": "data:image/png;base64,..."}}`` or ``{"type": "image", "image": <PIL.Image>}``.
        """
        conversations = messages if messages and isinstance(messages[0], list) else [messages]

        def render(conversation: list[dict]) -> str:
            return self.tokenizer.apply_chat_template(
                conversation, tools=tools, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )

        prompts = []
        for conversation in conversations:
            if (part := first_image_part(conversation)) is None:
                ids = self.tokenizer.encode(render(conversation), add_special_tokens=False)
                prompts.append({"prompt_token_ids": ids})
                continue
            vision = self.engine.vision
            if vision is None:
                reason = self.engine.summary.get("text_only_reason")
                raise ConfigError(
                    f"{part}: this model ({self.engine.model_config.architecture}) does not take images"
                    + (f": {reason}" if reason else "")
                )
            if self._image_processor is None:
                self._image_processor = load_processor(vision)
            max_tokens = self.engine.model_config.max_model_len
            ids, images = vision_prompt(conversation, vision, self._image_processor, self.tokenizer, render, max_tokens)
            prompts.append({"prompt_token_ids": ids, "images": images})
        return self.generate(prompts, sampling_params)
