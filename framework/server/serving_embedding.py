"""``POST /v1/embeddings``: normalized pooled hidden states of the served model.

Each input runs once through the engine as a pooling request (no tokens are generated); the
vector is the L2-normalized mean (or, with ``"pooling": "last"``, last-token) final hidden state.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from litestar import Request

from framework.server.chat_prompt import reject_unsupported
from framework.server.errors import APIError, decode_body
from framework.server.limits import read_body
from framework.server.protocol import (
    UNSUPPORTED_EMBEDDING_FIELDS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from framework.server.serving_completion import prompt_token_lists
from framework.server.state import ServerState, engine_error, new_id, until_disconnect


async def create_embedding(state: ServerState, request: Request) -> EmbeddingResponse:
    body = decode_body(await read_body(request, state.config.request_body_timeout_s), EmbeddingRequest)
    state.check_model(body.model)
    reject_unsupported(body, UNSUPPORTED_EMBEDDING_FIELDS)
    client = state.client
    try:
        inputs, _ = prompt_token_lists(
            client.tokenizer,
            body.input,
            client.ready.vocab_size,
            state.config.max_embedding_inputs,
            "--max-embedding-inputs",
        )
    except APIError as error:
        message = error.message.replace("'prompt'", "'input'").replace("prompt token ids", "input token ids")
        raise APIError(400, message, param="input", code=error.code) from None
    for ids in inputs:
        if len(ids) > state.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {state.max_model_len} tokens; an input has {len(ids)} tokens.",
                param="input",
                code="context_length_exceeded",
            )
    release = state.admit(len(inputs))
    release.add_tokens(sum(len(ids) for ids in inputs))
    request_id = new_id("embd")
    try:
        vectors = await until_disconnect(
            request,
            asyncio.gather(*(_embed(state, f"{request_id}-{i}", ids, body.pooling) for i, ids in enumerate(inputs))),
        )
    finally:
        release()
    data = [EmbeddingData(index=i, embedding=_encode(vector, body.encoding_format)) for i, vector in enumerate(vectors)]
    num_tokens = sum(len(ids) for ids in inputs)
    return EmbeddingResponse(
        data=data, model=state.model_name, usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    )


async def _embed(state: ServerState, request_id: str, ids: list[int], pooling: str) -> list[float]:
    from framework.sampling_params import SamplingParams

    try:
        async for output in state.client.generate(request_id, ids, SamplingParams(max_tokens=1), pooling=pooling):
            if output.embedding is not None:
                return output.embedding
    except Exception as error:
        raise engine_error(error) from None
    raise APIError(500, "the engine finished an embedding request without a vector", code="internal_error")


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the list; ``base64``: little-endian float32 bytes, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
