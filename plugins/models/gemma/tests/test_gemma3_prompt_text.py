"""Gemma 3 image prompts are token-exact with transformers' ``Gemma3Processor``: on a Gemma-shaped
BPE tokenizer (runs of newlines are one token) and Gemma 3's own chat template, the blank lines the
processor writes around each image merge with the newlines beside them, in ``LLM.chat`` and in the
API process, and the whole engine then gives transformers' logits and greedy ids.

The reference ids are ``Gemma3Processor(...)(text=<the template's output>, images=...)``, whose
text is fw's rendering of the same messages (``add_special_tokens=False``: the template writes
``<bos>``, as transformers' ``apply_chat_template`` passes it).
"""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest
import torch

from framework import LLM, SamplingParams
from framework.multimodal.inputs import load_processor
from framework.multimodal.prompt import vision_prompt, without_images
from framework.testing import capture_logits, data_url, random_image
from framework.testing.vision import IMAGE_TOKEN_ID
from framework.testing.vision_gemma3 import GEMMA3_CHAT_TEMPLATE, write_gemma3_tokenizer, write_tiny_gemma3
from framework.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGES = [random_image(30, 20, 1), random_image(60, 90, 2)]
#: a template that keeps text parts as sent (Gemma 3's trims them), so a text can end in a newline
UNTRIMMED = GEMMA3_CHAT_TEMPLATE.replace("item['text'] | trim", "item['text']")


def image(index: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(IMAGES[index])}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


#: name -> (messages, template); each message's images are IMAGES in order of appearance
CASES = {
    # "user\n" + "\n\n" is one "\n\n\n" token
    "image_opens_the_message": ([{"role": "user", "content": [image(0), text("Look at this image")]}], None),
    "image_mid_text": ([{"role": "user", "content": [text("Look at"), image(0), text("and this one")]}], None),
    # "\n\n" + "\n\n" between the two images is one "\n\n\n\n" token
    "two_images_back_to_back": (
        [{"role": "user", "content": [text("Look"), image(0), image(1), text("Be brief.")]}],
        None,
    ),
    # the system prefix ends in a blank line, right before the image
    "image_after_the_system_prefix": (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [image(0), text("Look")]}],
        None,
    ),
    "text_ending_in_a_newline_before_an_image": (
        [{"role": "user", "content": [text("Look:\n"), image(0), text("\nand this one")]}],
        UNTRIMMED,
    ),
    "images_in_two_turns": (
        [
            {"role": "user", "content": [image(0), text("Look")]},
            {"role": "assistant", "content": "model"},
            {"role": "user", "content": [text("and this one"), image(1)]},
        ],
        None,
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3-bpe")
    model = write_tiny_gemma3(path)
    write_gemma3_tokenizer(path)
    return path, model


@pytest.fixture(scope="module")
def vision(tiny):
    """fw's tokenizer, the model's ``VisionSpec`` and its image processor."""
    from fw_gemma.gemma3_vl import Gemma3ForConditionalGeneration

    from framework.config import ModelConfig

    path = tiny[0]
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()), dtype=torch.float32)
    spec = Gemma3ForConditionalGeneration.vision_spec(
        config, json.loads((path / "preprocessor_config.json").read_text())
    )
    return Tokenizer.from_directory(path), spec, load_processor(spec)


@pytest.fixture(scope="module")
def reference(tiny):
    """transformers' ``Gemma3Processor`` on the checkpoint's tokenizer and preprocessing."""
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path = tiny[0]
    settings = json.loads((path / "preprocessor_config.json").read_text())
    settings.pop("image_processor_type")
    return Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(**settings),
        tokenizer=AutoTokenizer.from_pretrained(path),
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=16,
    )


def with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    return tokenizer if template is None else dataclasses.replace(tokenizer, chat_template=template, _compiled=None)


def render_for(tokenizer: Tokenizer):
    return lambda messages: tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def images_of(messages) -> list:
    """The PIL images of ``messages``' image parts, in order."""
    urls = [data_url(i) for i in IMAGES]
    parts = [part for m in messages if isinstance(m["content"], list) for part in m["content"]]
    return [IMAGES[urls.index(part["image_url"]["url"])] for part in parts if part["type"] == "image_url"]


def processor_ids(reference, template_text: str, images: list) -> list[int]:
    return reference(text=template_text, images=images, add_special_tokens=False)["input_ids"][0]


def api_prompt(tokenizer: Tokenizer, spec, processor, messages):
    """The API process's prompt (text, ids, images) for a chat completion of ``messages``."""
    from types import SimpleNamespace

    from framework.server.chat_images import chat_prompt_with_images
    from framework.server.chat_prompt import template_messages
    from framework.server.protocol import ChatCompletionRequest
    from framework.server.state import ServerConfig

    body = msgspec.convert({"messages": messages}, ChatCompletionRequest)
    state = SimpleNamespace(
        vision=spec,
        client=SimpleNamespace(tokenizer=tokenizer),
        image_processor=lambda: processor,
        max_model_len=512,
        config=ServerConfig(),  # data URLs only, as a server started without media flags
    )
    text, ids, inputs, _ = chat_prompt_with_images(state, body, None, template_messages(body.messages, True))
    return text, ids, inputs


def check_spans(ids: list[int], inputs, spec) -> None:
    """Each image's span sits where its ``ImageInput`` says: begin, 16 image tokens, end."""
    span = [spec.placeholder_token_id] + [IMAGE_TOKEN_ID] * 16 + [spec.layout_token_ids[1]]
    assert [ids[i.offset : i.offset + i.length] for i in inputs] == [span] * len(inputs)
    assert ids.count(IMAGE_TOKEN_ID) == 16 * len(inputs)


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_ids_of_llm_chat_and_the_api_equal_gemma3_processor(case, vision, reference):
    messages, template = CASES[case]
    tokenizer, spec, processor = vision
    tokenizer = with_template(tokenizer, template)
    template_text = render_for(tokenizer)(without_images(messages))
    expected = processor_ids(reference, template_text, images_of(messages))

    ids, inputs = vision_prompt(messages, spec, processor, tokenizer, render_for(tokenizer))  # LLM.chat's
    assert ids == expected
    check_spans(ids, inputs, spec)
    text, api_ids, api_inputs = api_prompt(tokenizer, spec, processor, messages)
    assert api_ids == expected and api_inputs == inputs
    assert text == template_text.replace("<start_of_image>", "\n\n<start_of_image>\n\n")

    # the blank lines are what makes them equal: placed by id alone, the newlines tokenize otherwise
    bare = msgspec.structs.replace(spec, text_around_placeholder=("", ""))
    assert vision_prompt(messages, bare, processor, tokenizer, render_for(tokenizer))[0] != expected


def test_client_text_spelling_the_image_marker_stays_text_as_in_sanitized_transformers(vision, reference):
    """Only the template's ``<start_of_image>`` gets the blank lines; a client's is plain text, as
    transformers' ``apply_chat_template(..., sanitize_control_tokens=True)`` encodes it."""
    tokenizer, spec, processor = vision
    messages = [{"role": "user", "content": [text("Look at <start_of_image>"), image(0), text("and this one")]}]
    hf_messages = [
        {
            "role": "user",
            "content": [text("Look at <start_of_image>"), {"type": "image", "image": IMAGES[0]}, text("and this one")],
        }
    ]
    expected = reference.apply_chat_template(
        hf_messages, tokenize=True, add_generation_prompt=True, return_dict=True, sanitize_control_tokens=True
    )["input_ids"][0]
    text_out, ids, inputs = api_prompt(tokenizer, spec, processor, messages)
    assert ids == expected and len(inputs) == 1
    check_spans(ids, inputs, spec)
    assert text_out.count("<start_of_image>") == 2 and text_out.count("\n\n<start_of_image>\n\n") == 1


def test_llm_chat_matches_transformers_generate_on_the_processor_outputs(tiny, vision, reference):
    path, model = tiny
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [image(0), text("Look at"), image(1), image(0), text("and this one")]},
    ]
    tokenizer, _, _ = vision
    images = images_of(messages)
    template_text = render_for(tokenizer)(without_images(messages))
    inputs = reference(text=template_text, images=images, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=-1)
    prompt_ids = inputs["input_ids"][0].tolist()
    expected_ids = generated[0, len(prompt_ids) :].tolist()

    llm = LLM(str(path), dtype="float32", device="cpu", prefill_chunk_size=16, block_size=16)
    logits = capture_logits(llm)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    result = llm.chat(messages, params)[0]
    assert result.prompt_token_ids == prompt_ids
    assert result.outputs[0].token_ids == expected_ids
    sequence = generated[:, :-1]
    with torch.no_grad():
        expected = model(
            input_ids=sequence, pixel_values=inputs["pixel_values"], token_type_ids=(sequence == IMAGE_TOKEN_ID).long()
        ).logits[0]
    got = torch.stack([logits[("0-0", position)] for position in range(sequence.shape[1])])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    # the same prompt again: its full blocks come from the prefix cache, keyed by the images
    again = llm.chat(messages, params)[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == expected_ids
