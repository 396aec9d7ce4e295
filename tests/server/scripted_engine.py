"""An engine client whose "model" writes scripted replies, for API tests that need a model to do
something specific (call a tool, use its result) deterministically.

The tokenizer is a real byte-level BPE, so replies travel as token ids through the server's
incremental detokenizer and parsers exactly as a model's would. ``reply(prompt_text)`` picks the
reply for a prompt. :func:`scripted_vision_engine` makes one that takes images as Qwen2-VL does
(its image processor at tiny sizes; the images each request brought are kept in ``images``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import uvicorn

from framework.engine.outputs import RequestOutput
from framework.multimodal.inputs import VisionSpec
from framework.testing.vision import TINY_PREPROCESSOR
from framework.tokenizer import Tokenizer

TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: TEMPLATE with content parts: an image part is Qwen2-VL's vision start, image token, vision end
VISION_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VISION_SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]


def byte_level_tokenizer(chat_template: str = TEMPLATE, specials: tuple[str, ...] = ()) -> Tokenizer:
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>", *specials])
    return Tokenizer(backend, chat_template=chat_template, eos_token="<eos>")


class ScriptedEngineClient:
    """Just enough of AsyncEngineClient: ``generate`` streams the scripted reply a few tokens a step."""

    def __init__(self, reply: Callable[[str], str]) -> None:
        self.tokenizer = byte_level_tokenizer()
        self.reply = reply
        self.ready = SimpleNamespace(max_model_len=4096, vocab_size=self.tokenizer.vocab_size)
        self.dead_reason = None
        self.prompts: list[str] = []
        self.prompt_lengths: list[int] = []
        self.prompt_ids: list[list[int]] = []
        #: each request's preprocessed images (``ImageInput``s; None for a prompt without any)
        self.images: list[list | None] = []
        #: ids of the requests generating now (a request the server left running would stay here)
        self.active: set[str] = set()
        #: the prefix-cache hit each request reports, from its prompt length (none by default)
        self.cached_tokens: Callable[[int], int] = lambda num_prompt_tokens: 0

    is_ready = True
    is_healthy = True
    is_restarting = False
    is_unresponsive = False
    num_restarts = 0

    async def generate(self, request_id, prompt_token_ids, params, pooling=None, images=None):
        prompt = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        self.prompts.append(prompt)
        self.prompt_lengths.append(len(prompt_token_ids))
        self.prompt_ids.append(list(prompt_token_ids))
        self.images.append(images)
        ids = self.tokenizer.encode(self.reply(prompt), add_special_tokens=False)[: params.max_tokens]
        self.active.add(request_id)
        try:
            if pooling is not None:
                await asyncio.sleep(0)
                yield RequestOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    finish_reason="stop",
                    num_prompt_tokens=len(prompt_token_ids),
                    embedding=[1.0, 0.0],
                )
                return
            for start in range(0, len(ids), 3):
                await asyncio.sleep(0)
                last = start + 3 >= len(ids)
                yield RequestOutput(
                    request_id=request_id,
                    new_token_ids=ids[start : start + 3],
                    finish_reason="stop" if last else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_cached_tokens=self.cached_tokens(len(prompt_token_ids)),
                )
        finally:
            self.active.discard(request_id)

    def abort(self, *request_ids):
        pass

    async def shutdown(self):
        pass


def scripted_vision_engine(reply: Callable[[str], str]) -> ScriptedEngineClient:
    """A scripted engine client of a vision model: ``ready.vision`` names Qwen2-VL's image processor
    with :data:`~framework.testing.vision.TINY_PREPROCESSOR` (4 to 64 image tokens an image), so the
    server decodes, preprocesses and places images exactly as for a real vision model."""
    engine = ScriptedEngineClient(reply)
    engine.tokenizer = byte_level_tokenizer(VISION_TEMPLATE, tuple(VISION_SPECIALS))
    spec = VisionSpec(
        processor="fw_llama.qwen2_vl_processor:Qwen2VLImageProcessor",
        processor_config=dict(TINY_PREPROCESSOR),
        image_token_id=engine.tokenizer.token_to_id("<|image_pad|>"),
    )
    engine.ready = SimpleNamespace(max_model_len=4096, vocab_size=engine.tokenizer.vocab_size, vision=spec)
    return engine


class ThreadedServer:
    """An ASGI app (the real Litestar app by default) under uvicorn on a loopback port, in a background thread;
    ``lifespan="off"`` for an app without startup/shutdown handlers."""

    def __init__(self, app, port: int, lifespan: str = "on") -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan)
        )
        self.base_url = f"http://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
