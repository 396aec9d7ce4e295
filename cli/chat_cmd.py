"""``fw chat``: an interactive, streaming chat with a running ``fw serve`` (like ``ollama run``).

It is a thin client of the server's chat completions API, so the conversation goes through the
same template, parsers and limits as any client's; start the server first (``fw serve``), then
``fw chat`` (``--url`` for another address). Lines starting with ``/`` are commands: ``/clear``
forgets the conversation, ``/exit`` (or Ctrl-D) leaves.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Annotated

import typer

HELP = "commands: /clear forgets the conversation, /exit leaves (or Ctrl-D)"


def chat(
    url: Annotated[str, typer.Option("--url", help="The fw serve to talk to.")] = "http://127.0.0.1:2000",
    model: Annotated[str | None, typer.Option("--model", help="Model name (default: the server's first).")] = None,
    system: Annotated[str | None, typer.Option("--system", help="A system prompt for the conversation.")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Most tokens of one reply.")] = None,
    temperature: Annotated[
        float | None, typer.Option("--temperature", help="Sampling temperature (default: the model's).")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", help="Bearer key of the server (default: FW_API_KEY).")
    ] = None,
) -> None:
    """Chat with a running fw serve, streaming each reply."""
    import httpx

    from cli.options import fail

    key = api_key or os.environ.get("FW_API_KEY", "").strip()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(600.0, connect=5.0))
    try:
        models = client.get("/v1/models")
    except httpx.HTTPError as error:
        raise fail(f"no fw server answers at {url} ({error}); start one with `fw serve`, or give --url") from None
    if models.status_code != 200:
        raise fail(f"{url}/v1/models answered {models.status_code}: {models.text[:300]}")
    model = model or models.json()["data"][0]["id"]
    typer.echo(f"fw chat with {model} at {url}; {HELP}")
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            typer.echo()
            return
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit", "/bye"):
            return
        if line.strip() == "/clear":
            messages = messages[:1] if system else []
            typer.echo("(conversation cleared)")
            continue
        if line.startswith("/"):
            typer.echo(f"unknown command {line.split()[0]!r}; {HELP}")
            continue
        messages.append({"role": "user", "content": line})
        body = {"model": model, "messages": messages, "stream": True}
        body |= {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature)) if v is not None}
        try:
            reply = "".join(_stream_reply(client, body))
        except (httpx.HTTPError, RuntimeError) as error:
            messages.pop()
            typer.secho(f"\nerror: {error}", fg=typer.colors.RED, err=True)
            continue
        typer.echo()
        messages.append({"role": "assistant", "content": reply})


def _stream_reply(client, body: dict) -> Iterator[str]:
    """Print the reply as it streams (reasoning dimmed) and yield its content pieces."""
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(response.json().get("error", {}).get("message", response.text))
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for choice in event.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("reasoning_content"):
                    typer.secho(delta["reasoning_content"], dim=True, nl=False)
                if delta.get("content"):
                    typer.echo(delta["content"], nl=False)
                    yield delta["content"]
