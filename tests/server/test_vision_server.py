"""Images through the HTTP API: a real ``fw serve`` of the tiny random Qwen2.5-VL (and of the hybrid
Qwen3.5, of Llama 4 and of Gemma 3, whose image tokens attend to each other) answers the openai
client's ``image_url`` parts with transformers' greedy ids, Qwen3-VL's parts reach the engine in its
own patches, Mistral 3's with their ``[IMG_BREAK]`` / ``[IMG_END]`` spans, Llama 4's as tiles with
their tile-separated spans, and every bad image is a 400 naming its content part before anything
reaches the engine (the app with a stand-in engine client)."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import msgspec
import numpy as np
import openai
import pytest
import torch
from litestar.testing import TestClient

from framework.multimodal.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from framework.multimodal.inputs import load_processor
from framework.multimodal.prompt import vision_prompt
from framework.server.app import create_app
from framework.server.state import ServerConfig
from framework.testing import (
    VisionReference,
    image_chat,
    qwen_vl_inputs,
    random_image,
    write_tiny_gemma3,
    write_tiny_llama4,
    write_tiny_mistral3,
    write_tiny_qwen2_5_vl,
    write_tiny_qwen3_5_vl,
    write_tiny_qwen3_vl,
)
from framework.testing.vision import IMAGE_TOKEN_ID, MISTRAL3_SPECIALS
from framework.testing.vision_gemma3 import GEMMA3_SPECIALS
from framework.testing.vision_llama4 import LLAMA4_SPECIALS
from framework.tokenizer import Tokenizer

from .scripted_engine import ScriptedEngineClient, scripted_vision_engine

IMAGES = [random_image(84, 56, 1), random_image(100, 120, 2)]


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2_5_vl")
    return path, write_tiny_qwen2_5_vl(path)


def spec_of(path):
    """The spec the engine sends in Ready, from the architecture the registry serves the model with."""
    from framework import plugins, registries
    from framework.config import ModelConfig
    from framework.platform import platform_for_device

    plugins.load_plugins()
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()), dtype=torch.float32)
    model_cls = registries.model_architectures(platform_for_device("cpu")).get(config.architecture).load()
    return model_cls.vision_spec(config, json.loads((path / "preprocessor_config.json").read_text()))


@pytest.fixture(scope="module")
def vision_spec(tiny_vlm):
    return spec_of(tiny_vlm[0])


def test_openai_client_images_get_transformers_greedy_ids(tiny_vlm, vision_spec, serve_on_free_port):
    check_served_images_get_transformers_greedy_ids(*tiny_vlm, vision_spec, serve_on_free_port)


def test_openai_client_images_on_the_hybrid_qwen3_5_get_transformers_greedy_ids(tmp_path, serve_on_free_port):
    """Qwen3.5: DeltaNet state slots and interleaved M-RoPE behind the same API."""
    reference = write_tiny_qwen3_5_vl(tmp_path)
    check_served_images_get_transformers_greedy_ids(tmp_path, reference, spec_of(tmp_path), serve_on_free_port)


def test_openai_client_images_on_qwen3_vl_get_transformers_greedy_ids(tmp_path, serve_on_free_port):
    """Qwen3-VL: the DeepStack features and interleaved M-RoPE behind the same API."""
    reference = write_tiny_qwen3_vl(tmp_path)
    check_served_images_get_transformers_greedy_ids(tmp_path, reference, spec_of(tmp_path), serve_on_free_port)


def test_openai_client_mistral3_images_get_transformers_greedy_ids(tmp_path, serve_on_free_port):
    """Mistral 3: whole images with their [IMG_BREAK] / [IMG_END] spans behind the same API."""
    reference = write_tiny_mistral3(tmp_path)
    messages = image_chat(*IMAGES)
    tokenizer, processor, prompt_ids, _ = api_prompt(tmp_path, spec_of(tmp_path), messages)

    def mistral3_inputs(
        ids, images
    ):  # the images zero-padded to one batch with their sizes, as its processor sends them
        pixels = [processor.preprocess(image).pixel_values for image in images]
        height, width = max(p.shape[1] for p in pixels), max(p.shape[2] for p in pixels)
        padded = [np.pad(p, ((0, 0), (0, height - p.shape[1]), (0, width - p.shape[2]))) for p in pixels]
        sizes = torch.tensor([list(p.shape[1:]) for p in pixels])
        return dict(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(np.stack(padded)), image_sizes=sizes)

    expected = VisionReference(reference, mistral3_inputs).greedy(prompt_ids, IMAGES, 10)
    reply, _, _ = served_chat(tmp_path, messages, serve_on_free_port)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].message.content == tokenizer.decode(expected)


def api_prompt(path, spec, messages):
    """``(tokenizer, processor, prompt ids, image inputs)``: what the API process makes of
    ``messages`` for the model at ``path`` whose vision spec is ``spec``."""
    tokenizer, processor = Tokenizer.from_directory(path), load_processor(spec)
    prompt_ids, inputs = vision_prompt(
        messages,
        spec,
        processor,
        tokenizer,
        lambda shaped: tokenizer.apply_chat_template(shaped, add_generation_prompt=True),
    )
    return tokenizer, processor, prompt_ids, inputs


def served_chat(path, messages, serve_on_free_port, stream: bool = False):
    """A real ``fw serve`` of ``path`` (fp32, prefill chunks of 8) asked through the openai client
    for 10 greedy tokens of ``messages`` (EOS ignored): ``(reply, the streamed reply's text when
    ``stream``, the server's log lines)``."""
    args = ["--m", str(path), "--device", "cpu", "--dtype", "float32", "--prefill-chunk-size", "8"]
    request = dict(model=str(path), messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    streamed = None
    with serve_on_free_port(args) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(**request)
        if stream:
            chunks = client.chat.completions.create(**request, stream=True)
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    return reply, streamed, server.lines


def check_served_images_get_transformers_greedy_ids(path, reference, vision_spec, serve_on_free_port) -> None:
    """A real ``fw serve`` of the tiny VLM at ``path`` answers :data:`IMAGES` in chat (one reply,
    one stream) with transformers' greedy ids (EOS not stopping either, as ``ignore_eos``)."""
    messages = image_chat(*IMAGES)
    tokenizer, processor, prompt_ids, _ = api_prompt(path, vision_spec, messages)
    expected = VisionReference(reference, functools.partial(qwen_vl_inputs, processor)).greedy(prompt_ids, IMAGES, 10)
    reply, streamed, lines = served_chat(path, messages, serve_on_free_port, stream=True)
    assert any("images     up to 8 per prompt (Qwen2VLImageProcessor)" in line for line in lines)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].message.content == tokenizer.decode(expected) == streamed


def test_openai_client_gemma3_images_get_transformers_greedy_ids(tmp_path, serve_on_free_port):
    reference = write_tiny_gemma3(tmp_path)
    messages = image_chat(*IMAGES)
    tokenizer, processor, prompt_ids, inputs = api_prompt(tmp_path, spec_of(tmp_path), messages)
    boi, eoi = GEMMA3_SPECIALS["<start_of_image>"], GEMMA3_SPECIALS["<end_of_image>"]
    assert [prompt_ids[i.offset : i.offset + i.length] for i in inputs] == [[boi] + [IMAGE_TOKEN_ID] * 16 + [eoi]] * 2

    def gemma3_inputs(ids, images):
        ids = torch.tensor([ids])
        pixels = torch.from_numpy(np.stack([processor.preprocess(image).pixel_values for image in images]))
        return dict(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE_TOKEN_ID).long())

    expected = VisionReference(reference, gemma3_inputs).greedy(prompt_ids, IMAGES, 10)
    reply, _, lines = served_chat(tmp_path, messages, serve_on_free_port)
    assert any("(Gemma3ImageProcessor)" in line for line in lines)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].message.content == tokenizer.decode(expected)


@pytest.fixture
def vision_app(tiny_vlm, vision_spec):
    yield from scripted_app(tiny_vlm[0], vision_spec)


def scripted_app(path, vision_spec):
    """The real app over a stand-in engine client of a tiny VLM's tokenizer and vision spec."""
    engine = ScriptedEngineClient(lambda prompt: "t7")
    engine.tokenizer = Tokenizer.from_directory(path)
    engine.ready = SimpleNamespace(max_model_len=512, vocab_size=300, vision=vision_spec)
    received = []
    generate = engine.generate

    def recording_generate(request_id, prompt_token_ids, params, pooling=None, images=None):
        received.append(images)
        return generate(request_id, prompt_token_ids, params, pooling, images)

    engine.generate = recording_generate
    app = create_app(engine, ServerConfig(served_model_names=["vlm"]), start_engine=False)
    with TestClient(app, base_url="http://127.0.0.1:2000") as http:
        yield http, engine, received


def test_image_parts_reach_the_engine_as_pixels_with_their_spans(vision_app):
    http, engine, received = vision_app
    response = http.post("/v1/chat/completions", json={"messages": image_chat(*IMAGES), "max_tokens": 2})
    assert response.status_code == 200, response.text
    (images,) = received
    prompt = engine.prompt_ids[0]
    assert [(image.grid, image.length) for image in images] == [([1, 4, 6], 6), ([1, 8, 8], 16)]
    for image in images:
        assert prompt[image.offset : image.offset + image.length] == [IMAGE_TOKEN_ID] * image.length
        assert len(image.pixel_values) == 4 * image.length * 4 * 1176  # 4 patches of 3*2*14*14 floats per token
    assert prompt.count(IMAGE_TOKEN_ID) == 22


def test_qwen3_vl_image_parts_reach_the_engine_in_its_16_pixel_patches(tmp_path):
    write_tiny_qwen3_vl(tmp_path)
    for http, engine, received in scripted_app(tmp_path, spec_of(tmp_path)):
        response = http.post("/v1/chat/completions", json={"messages": image_chat(*IMAGES), "max_tokens": 2})
        assert response.status_code == 200, response.text
        (images,) = received
        prompt = engine.prompt_ids[0]
        # 84x56 -> 96x64 and 100x120 -> 96x128 pixels (multiples of 2 x 16), one token per 2x2 patches
        assert [(image.grid, image.length) for image in images] == [([1, 4, 6], 6), ([1, 8, 6], 12)]
        for image in images:
            assert prompt[image.offset : image.offset + image.length] == [IMAGE_TOKEN_ID] * image.length
            assert len(image.pixel_values) == 4 * image.length * 4 * 1536  # 4 patches of 3*2*16*16 floats per token


def test_mistral3_image_parts_reach_the_engine_as_whole_images_with_laid_out_spans(tmp_path):
    write_tiny_mistral3(tmp_path)
    breaks, end = MISTRAL3_SPECIALS["[IMG_BREAK]"], MISTRAL3_SPECIALS["[IMG_END]"]
    for http, engine, received in scripted_app(tmp_path, spec_of(tmp_path)):
        messages = image_chat(*IMAGES)
        tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert response.status_code == 200, response.text
        (images,) = received
        prompt = engine.prompt_ids[0]
        assert tokens == prompt
        # 84x56 -> 84x56 and 100x120 -> 112x112 pixels (longest edge 112, multiples of 2 x 14)
        assert [(image.shape, image.grid, image.length) for image in images] == [
            ([3, 56, 84], [4, 6], 8),
            ([3, 112, 112], [8, 8], 20),
        ]
        for image, (rows, cols) in zip(images, [(2, 3), (4, 4)], strict=True):
            span = ([IMAGE_TOKEN_ID] * cols + [breaks]) * rows
            assert prompt[image.offset : image.offset + image.length] == span[:-1] + [end]


def test_llama4_openai_client_images_get_transformers_greedy_ids(tmp_path, serve_on_free_port, monkeypatch):
    """A one-tile image and one on 2 x 2 tiles (+ the thumbnail), through ``fw serve``."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    # transformers 5.24's Llama 4 forward reads image_outputs from its language model's output,
    # which has none (5.23 did not): give that output class the attribute, for the reference only
    monkeypatch.setattr(MoeCausalLMOutputWithPast, "image_outputs", None, raising=False)
    reference = write_tiny_llama4(tmp_path)
    images = [random_image(30, 20, 1), random_image(70, 40, 3)]
    messages = image_chat(*images)
    tokenizer, processor, prompt_ids, inputs = api_prompt(tmp_path, spec_of(tmp_path), messages)
    assert [image.shape[0] for image in inputs] == [1, 5]

    def llama4_inputs(ids, images):
        pixels = np.concatenate([processor.preprocess(image).pixel_values for image in images])
        return dict(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(pixels))

    expected = VisionReference(reference, llama4_inputs).greedy(prompt_ids, images, 10)
    reply, _, _ = served_chat(tmp_path, messages, serve_on_free_port)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].message.content == tokenizer.decode(expected)


def test_llama4_image_parts_reach_the_engine_as_tiles_with_tile_separated_spans(tmp_path):
    write_tiny_llama4(tmp_path)
    ids = {name: LLAMA4_SPECIALS[f"<|{name}|>"] for name in ("image_start", "image_end", "image")}
    tile_x, tile_y = LLAMA4_SPECIALS["<|tile_x_separator|>"], LLAMA4_SPECIALS["<|tile_y_separator|>"]
    for http, engine, received in scripted_app(tmp_path, spec_of(tmp_path)):
        messages = image_chat(random_image(60, 30, 1), IMAGES[1])
        tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert response.status_code == 200, response.text
        (images,) = received
        prompt = engine.prompt_ids[0]
        assert tokens == prompt and ids["image"] not in prompt[: images[0].offset]  # placeholders replaced
        # 60x30 -> 1 x 2 tiles of 32 (padded), 100x120 -> 2 x 2 (downscaled); each + a thumbnail
        assert [(image.shape, image.grid, image.length) for image in images] == [
            ([3, 3, 32, 32], [1, 2], 17),
            ([5, 3, 32, 32], [2, 2], 27),
        ]
        patches = [IMAGE_TOKEN_ID] * 4
        for image, (rows, cols) in zip(images, [(1, 2), (2, 2)], strict=True):
            row = (patches + [tile_x]) * cols
            span = [ids["image_start"], *(row[:-1] + [tile_y]) * rows, ids["image"], *patches, ids["image_end"]]
            assert prompt[image.offset : image.offset + image.length] == span


def _bad(url: str) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "image_url", "image_url": {"url": url}}]}
    ]


def _tiff_url() -> str:
    import base64
    import io

    buffer = io.BytesIO()
    random_image(8, 8, 0).save(buffer, format="TIFF")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    "messages, message",
    [
        (_bad("data:image/png;base64,aGVsbG8gd29ybGQ="), "the data is not an image in a supported format"),
        (_bad(_tiff_url()), "the data is not an image in a supported format"),
        (_bad("data:image/svg+xml;base64,PHN2Zz4="), "unsupported image type 'image/svg+xml'"),
        (_bad("data:image/png;base64,@@@"), "not valid base64"),
        (_bad("https://example.com/cat.png"), "image URLs over http(s) are fetched only from the hosts"),
        (_bad("/etc/passwd"), "local paths and file: URLs are read only under"),
        (_bad("file:///etc/passwd"), "local paths and file: URLs are read only under"),
    ],
)
def test_bad_images_are_400s_naming_the_part_and_reach_no_engine(vision_app, messages, message):
    http, engine, _ = vision_app
    response = http.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and message in error["message"], error
    assert engine.prompts == []


def test_too_many_images_is_a_400_naming_the_first_extra_part(vision_app):
    http, engine, _ = vision_app
    response = http.post(
        "/v1/chat/completions", json={"messages": image_chat(*[random_image(56, 56, i) for i in range(9)])}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[17]" and "at most 8" in error["message"]
    assert engine.prompts == []


def test_an_image_for_a_text_only_model_is_a_400_naming_the_part():
    engine = ScriptedEngineClient(lambda prompt: "hi")
    app = create_app(engine, ServerConfig(served_model_names=["text"]), start_engine=False)
    with TestClient(app, base_url="http://127.0.0.1:2000") as http:
        response = http.post("/v1/chat/completions", json={"messages": image_chat(IMAGES[0])})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "does not take images" in error["message"]
    assert engine.prompts == []


def test_model_cards_say_whether_and_within_which_limits_the_model_takes_images():
    """fw's ``vision`` key of ``GET /v1/models``: the spec's image count, the formats and sizes the
    decoder takes and the server's body cap; null on a text-only model's card."""
    vision = scripted_vision_engine(lambda prompt: "hi")
    vision.ready.vision = msgspec.structs.replace(vision.ready.vision, max_images=3)
    expected = {
        "max_images": 3,
        "formats": ["image/bmp", "image/gif", "image/jpeg", "image/jpg", "image/png", "image/webp"],
        "max_image_bytes": MAX_IMAGE_BYTES,
        "max_image_pixels": MAX_IMAGE_PIXELS,
        "max_request_bytes": 3 << 20,
    }
    for engine, card in ((vision, expected), (ScriptedEngineClient(lambda prompt: "hi"), None)):
        config = ServerConfig(served_model_names=["m"], max_request_bytes=3 << 20)
        with TestClient(create_app(engine, config, start_engine=False), base_url="http://127.0.0.1:2000") as http:
            assert http.get("/v1/models").json()["data"][0]["vision"] == card
            assert http.get("/v1/models/m").json()["vision"] == card


def test_an_image_for_a_vision_model_served_as_text_is_a_400_saying_why():
    """A GGUF without its vision projector: the engine's summary says where fw looked, and the 400 repeats it."""
    engine = ScriptedEngineClient(lambda prompt: "hi")
    reason = "this qwen2vl GGUF takes images through its llama.cpp vision projector ... found none beside it in /m"
    engine.ready.summary = {"text_only_reason": reason}
    app = create_app(engine, ServerConfig(served_model_names=["qwen"]), start_engine=False)
    with TestClient(app, base_url="http://127.0.0.1:2000") as http:
        response = http.post("/v1/chat/completions", json={"messages": image_chat(IMAGES[0])})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]"
    assert error["message"] == f"messages[0].content[1] is an image, and this model does not take images: {reason}"
    assert engine.prompts == []


def test_images_are_decoded_and_preprocessed_off_the_event_loop(vision_app, monkeypatch):
    import asyncio

    from framework.server import chat_images

    http, _, received = vision_app
    on_loop = []
    process = chat_images.process_images

    def recording(images, processor, max_tokens=None):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop runs in this thread: a worker thread
            on_loop.append(False)
        return process(images, processor, max_tokens)

    monkeypatch.setattr(chat_images, "process_images", recording)
    response = http.post("/v1/chat/completions", json={"messages": image_chat(IMAGES[0]), "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert on_loop == [False] and len(received[0]) == 1


def test_tokenize_counts_the_image_tokens_generation_sees(vision_app):
    http, engine, _ = vision_app
    messages = image_chat(*IMAGES)
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).status_code == 200
    assert tokens == engine.prompt_ids[0] and tokens.count(IMAGE_TOKEN_ID) == 22


def test_images_past_the_context_length_are_a_400_before_their_pixels_are_made(vision_app, monkeypatch):
    http, engine, _ = vision_app
    monkeypatch.setattr(engine.ready, "max_model_len", 40)
    images = [random_image(112, 112, i) for i in range(3)]  # 16 image tokens each
    response = http.post("/v1/chat/completions", json={"messages": image_chat(*images)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (
        error["param"] == "messages[0].content[5]" and "take 48 tokens; the model's context is 40" in error["message"]
    )
    assert engine.prompts == []
