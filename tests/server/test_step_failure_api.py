"""What a client sees when the engine gives its request up because a step failed: 503 (out of memory)
or 500 in OpenAI's error envelope, or on a stream an error event then ``[DONE]``; the server keeps serving."""

from __future__ import annotations

import json

import pytest
from litestar.testing import TestClient

from framework.errors import RequestFailedError
from framework.server.app import create_app
from framework.server.state import ServerConfig
from tests.server.scripted_engine import ScriptedEngineClient


class FailingOnceClient(ScriptedEngineClient):
    """Streams the scripted reply, except that the first request fails after its first output."""

    def __init__(self, error: RequestFailedError) -> None:
        super().__init__(lambda prompt: "Paris is the capital.")
        self.error: RequestFailedError | None = error

    async def generate(self, request_id, prompt_token_ids, params, pooling=None):
        async for output in super().generate(request_id, prompt_token_ids, params, pooling):
            if self.error is not None and output.finish_reason is None:
                yield output
                error, self.error = self.error, None
                raise error
            yield output


OOM = RequestFailedError("the device ran out of memory while running this request; retry it later", out_of_memory=True)
INTERNAL = RequestFailedError(
    "the engine failed while running this request (RuntimeError); the error is in the server log"
)
CHAT = {"messages": [{"role": "user", "content": "capital of France?"}], "max_tokens": 64}


def _http(error: RequestFailedError) -> TestClient:
    app = create_app(FailingOnceClient(error), ServerConfig(served_model_names=["m"]), start_engine=False)
    return TestClient(app, base_url="http://127.0.0.1:2000")  # a loopback Host, as the Host check wants


@pytest.mark.parametrize(
    ("error", "status", "code"), [(OOM, 503, "out_of_memory"), (INTERNAL, 500, "engine_step_failed")]
)
def test_a_failed_step_answers_its_status_in_the_error_envelope_and_the_next_request_succeeds(error, status, code):
    with _http(error) as http:
        response = http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == status
        assert response.json()["error"]["code"] == code and response.json()["error"]["message"] == str(error)
        assert (response.headers.get("Retry-After") == "1") == (status == 503)
        again = http.post("/v1/chat/completions", json=CHAT)
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == "Paris is the capital."
        assert http.get("/health").status_code == 200


def test_a_failed_step_on_a_stream_sends_an_error_event_then_done():
    with _http(OOM) as http:
        response = http.post("/v1/completions", json={"prompt": "capital of France?", "max_tokens": 64, "stream": True})
        events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "out_of_memory"
        assert json.loads(events[0])["choices"][0]["text"] == "Par"  # what came before the failure was sent
