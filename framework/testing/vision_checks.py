"""Checks of a vision-language model through the whole engine against transformers, shared by the
models' tests: a chat with images, a transformers reference fed the pixels fw's processor made,
and the scenarios every vision model passes (a request's logits and greedy ids, a prefix-cache
hit inside an image's span, preemption, a text-only prompt).

Logits are compared at the positions the engine computed (``capture_logits``' records, keyed by
``(request id, position)``), within 1e-4 in fp32; greedy ids exactly, the reference ignoring EOS
as the requests do (``ignore_eos``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from framework.testing.vision import IMAGE_TOKEN_ID, data_url


def image_chat(*images, text: str = "t5 t6") -> list[dict[str, Any]]:
    """One user turn: ``text``, then each image (a PNG data URL) followed by the word ``t{20 + i}``."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    for index, image in enumerate(images):
        parts += [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": f"t{20 + index}"},
        ]
    return [{"role": "user", "content": parts}]


def qwen_vl_inputs(processor, ids: list[int], images) -> dict[str, Any]:
    """transformers' inputs of the Qwen2-VL family (Qwen2.5-VL, Qwen3-VL, Qwen3.5) for ``ids``
    (image tokens expanded) and ``images`` through fw's ``processor``: the concatenated patches,
    ``image_grid_thw`` and ``mm_token_type_ids`` (no images: the ids alone)."""
    import numpy as np
    import torch

    tensor = torch.tensor([ids])
    if not images:
        return dict(input_ids=tensor)
    processed = [processor.preprocess(image) for image in images]
    return dict(
        input_ids=tensor,
        pixel_values=torch.from_numpy(np.concatenate([p.pixel_values for p in processed])),
        image_grid_thw=torch.tensor([p.grid for p in processed]),
        mm_token_type_ids=(tensor == IMAGE_TOKEN_ID).int(),
    )


@dataclass(frozen=True, slots=True)
class VisionReference:
    """A transformers vision-language ``model`` and ``inputs(ids, images)``, the keyword inputs its
    processor would give it for prompt ``ids`` (image tokens expanded) and ``images``."""

    model: Any
    inputs: Callable[[list[int], list], dict[str, Any]]

    def _inputs(self, ids: list[int], images) -> dict[str, Any]:
        import torch

        return self.inputs(ids, images) if images else dict(input_ids=torch.tensor([ids]))

    def logits(self, ids: list[int], images) -> Any:
        """``[len(ids), vocab]``: the logits at every position of ``ids``."""
        import torch

        with torch.no_grad():
            return self.model(**self._inputs(ids, images)).logits[0]

    def greedy(self, prompt_ids: list[int], images, steps: int) -> list[int]:
        """The ``steps`` greedy ids after ``prompt_ids`` (EOS does not stop them: no such id)."""
        import torch

        inputs = self._inputs(prompt_ids, images)
        with torch.no_grad():
            out = self.model.generate(
                **inputs,
                attention_mask=torch.ones_like(inputs["input_ids"]),
                max_new_tokens=steps,
                do_sample=False,
                eos_token_id=-1,
            )
        return out[0, len(prompt_ids) :].tolist()


def engine_logits(logits: dict, request_id: str, positions) -> Any:
    """``[len(positions), vocab]``: the logits ``capture_logits`` recorded for ``request_id``."""
    import torch

    return torch.stack([logits[(request_id, position)] for position in positions])


def check_image_request(
    logits: dict, request_id: str, result, reference: VisionReference, images, steps: int, *, decoded=True, first=0
) -> None:
    """``result`` (the request ``request_id`` with ``images``) against ``reference``: the logits the
    engine computed from position ``first`` on, over the prompt (``decoded``: and the decode steps,
    whose positions follow the prompt's), and its ``steps`` greedy ids."""
    import torch

    prompt, ids = result.prompt_token_ids, result.outputs[0].token_ids
    sequence = prompt + ids[:-1] if decoded else prompt
    got = engine_logits(logits, request_id, range(first, len(sequence)))
    torch.testing.assert_close(got, reference.logits(sequence, images)[first:], rtol=1e-4, atol=1e-4)
    assert ids == reference.greedy(prompt, images, steps)


def check_prefix_hit_inside_an_image(
    path, reference: VisionReference, image, params, span: tuple[int, int], num_cached: int, text="t5 t6", **engine
):
    """A chat with ``image``, sent twice to an engine of 4-token blocks whose prefix cache keeps
    ``num_cached`` tokens: the second request hits that many, which end inside the image's span
    (``span``: its first token id and its length), and continues with the reference's logits and
    greedy ids. Returns ``(llm, second result)``."""
    from framework import LLM
    from framework.testing.parity import capture_logits

    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, prefix_cache_max_tokens=num_cached, **engine)
    logits = capture_logits(llm)
    llm.chat(image_chat(image, text=text), params)
    second = llm.chat(image_chat(image, text=text), params)[0]
    start = second.prompt_token_ids.index(span[0])
    assert start < second.num_cached_tokens == num_cached < start + span[1]
    check_image_request(logits, "1-0", second, reference, [image], params.max_tokens, decoded=False, first=num_cached)
    return llm, second


def check_preempted_image_requests(
    path, reference: VisionReference, images, num_blocks: int, max_tokens: int, decoded=False, **engine
):
    """One chat per image, ``max_tokens`` greedy ids each, in ``num_blocks`` blocks of 16 without a
    prefix cache: the requests preempt each other, resume (recomputing their image tokens from the
    encoder cache) with the reference's logits and greedy ids, and each image is encoded once.
    Returns the engine."""
    from framework import LLM, SamplingParams
    from framework.testing.parity import capture_logits

    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        num_blocks=num_blocks,
        block_size=16,
        max_num_seqs=3,
        enable_prefix_caching=False,
        **engine,
    )
    logits = capture_logits(llm)  # a recomputed position keeps its last logits
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = llm.chat([image_chat(image) for image in images], params)
    assert llm.engine.core.stats().num_preemptions > 0
    for index, (image, result) in enumerate(zip(images, results, strict=True)):
        check_image_request(logits, f"{index}-0", result, reference, [image], max_tokens, decoded=decoded)
    assert llm.engine.core.runner.multimodal.num_encoder_runs == len(images)
    return llm


def check_text_only_prompt(llm, reference: VisionReference, prompt_ids: list[int], params) -> None:
    """A prompt without images on the vision model: the reference's greedy ids."""
    got = llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0].token_ids
    assert got == reference.greedy(prompt_ids, [], params.max_tokens)
