"""MCP tools for the API server, through the official ``mcp`` SDK (in the API process, not the engine).

Servers are configured in the ``mcpServers`` format that MCP clients share::

    {"mcpServers": {
        "files":   {"command": "python", "args": ["server.py"], "env": {"ROOT": "/tmp"}},
        "weather": {"url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "Bearer ..."}}}}

``command`` starts a stdio server; ``url`` connects to a streamable-HTTP one. At start-up each
server is connected and its tools listed; a tool is offered to the model as
``<server>__<tool>``. A server that fails to start is logged and listed with its error
(``GET /v1/mcp/servers``); the others work.

Running tools for a client (``mcp_execute``) is the operator's choice: ``fw serve --mcp-execute``
allows it on every server, ``"execute": true`` in a server's entry on that one, and
``"allowed_tools": ["add", ...]`` in an entry limits it to those tools. Tools the server may not
run are still offered; their calls go back to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.errors import ConfigError

log = logging.getLogger("fw.mcp")

SEPARATOR = "__"
START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 120.0


def load_mcp_config(path: str | None, command: str | None = None, args: str | None = None) -> dict[str, Any] | None:
    """The ``mcpServers`` mapping from ``--mcp-config`` and/or ``--mcp-command`` / ``--mcp-args``."""
    servers: dict[str, Any] = {}
    if path is not None:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as error:
            raise ConfigError(f"--mcp-config {path!r}: {error.strerror}") from None
        except ValueError as error:
            raise ConfigError(f"--mcp-config {path!r} is not valid JSON: {error}") from None
        if not isinstance(data, dict) or not isinstance(data.get("mcpServers"), dict):
            raise ConfigError(
                f'--mcp-config {path!r} must hold {{"mcpServers": {{name: {{"command": ..., '
                '"args": [...]}} or {"url": ...}}}}'
            )
        servers.update(data["mcpServers"])
    if command is not None:
        servers["mcp"] = {"command": command, "args": shlex.split(args or "")}
    elif args is not None:
        raise ConfigError("--mcp-args needs --mcp-command")
    for name, entry in servers.items():
        if not name or SEPARATOR in name or not name.replace("-", "_").replace("_", "a").isalnum():
            raise ConfigError(f"MCP server name {name!r}: use letters, digits, '-' or single '_'")
        if not isinstance(entry, dict) or ("command" in entry) == ("url" in entry):
            raise ConfigError(f'MCP server {name!r} needs exactly one of "command" (stdio) or "url" (streamable HTTP)')
        if "command" in entry and not isinstance(entry.get("args", []), list):
            raise ConfigError(f'MCP server {name!r}: "args" must be a list of strings')
        if not isinstance(entry.get("execute", False), bool):
            raise ConfigError(f'MCP server {name!r}: "execute" must be true or false')
        allowed = entry.get("allowed_tools")
        if allowed is not None and not (isinstance(allowed, list) and all(isinstance(t, str) for t in allowed)):
            raise ConfigError(f'MCP server {name!r}: "allowed_tools" must be a list of the server\'s tool names')
    return servers or None


@dataclass(slots=True)
class MCPServerState:
    """One configured server: its session once connected, its tools, or why it failed."""

    name: str
    entry: dict[str, Any]
    session: Any = None
    tools: list[Any] = field(default_factory=list)
    error: str | None = None
    task: asyncio.Task | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def transport(self) -> str:
        return "stdio" if "command" in self.entry else "streamable-http"


class MCPManager:
    """Connects the configured MCP servers, offers their tools, and runs calls.

    Each server lives in its own task, which enters the SDK's transport and session contexts and
    leaves them when stopped (anyio requires both in one task); calls use the session from any task.
    """

    def __init__(self, servers: dict[str, Any], execute_all: bool = False) -> None:
        self.servers = {name: MCPServerState(name, entry) for name, entry in servers.items()}
        self.execute_all = execute_all
        self._tools: dict[str, tuple[MCPServerState, str]] = {}
        self._openai_tools: list[dict[str, Any]] | None = None  # built once per listing (see openai_tools)

    async def start(self) -> None:
        """Connect every server (a failure is recorded and logged, not raised) and list their tools."""
        ready = {name: asyncio.Event() for name in self.servers}
        for server in self.servers.values():
            server.task = asyncio.create_task(self._serve(server, ready[server.name]))
        for server in self.servers.values():
            try:
                await asyncio.wait_for(ready[server.name].wait(), START_TIMEOUT_S)
            except asyncio.TimeoutError:
                server.error = f"no answer within {START_TIMEOUT_S:.0f} s"
                server.task.cancel()
            if server.error is not None:
                log.error("MCP server %r failed to start: %s", server.name, server.error)
                continue
            for tool in server.tools:
                self._tools[f"{server.name}{SEPARATOR}{tool.name}"] = (server, tool.name)
            self._openai_tools = None  # the tool set changed
            log.info("MCP server %r: %d tools", server.name, len(server.tools))

    async def _serve(self, server: MCPServerState, ready: asyncio.Event) -> None:
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                entry = server.entry
                if "command" in entry:
                    from mcp import StdioServerParameters
                    from mcp.client.stdio import stdio_client

                    params = StdioServerParameters(
                        command=entry["command"],
                        args=[str(a) for a in entry.get("args", [])],
                        env=entry.get("env"),
                        cwd=entry.get("cwd"),
                    )
                    read, write = await stack.enter_async_context(stdio_client(params))
                else:
                    read, write = await stack.enter_async_context(_http_client(entry["url"], entry.get("headers")))
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                server.tools = list((await session.list_tools()).tools)
                server.session = session
                ready.set()
                await server.stop.wait()
        except Exception as error:  # a failing server must not stop the others
            server.error = server.error or _describe(error)
        finally:
            server.session = None
            ready.set()

    async def close(self) -> None:
        for server in self.servers.values():
            server.stop.set()
        for server in self.servers.values():
            if server.task is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(server.task, 10)

    # --- what the chat handler uses ------------------------------------------------------
    def openai_tools(self) -> list[dict[str, Any]]:
        """Every listed tool as an OpenAI function tool, named ``<server>__<tool>``.

        Built once per listing (the servers' tools are listed when they connect, in :meth:`start`)
        and shared by every request: callers must not modify it."""
        if self._openai_tools is None:
            listed = {(server.name, tool.name): tool for server in self.servers.values() for tool in server.tools}
            self._openai_tools = [
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": tool.description or "",
                        "parameters": tool.input_schema or {"type": "object", "properties": {}},
                    },
                }
                for name, (server, tool_name) in self._tools.items()
                for tool in [listed[(server.name, tool_name)]]
            ]
        return self._openai_tools

    def has_tool(self, name: str) -> bool:
        return name in self._tools

    def is_execution_enabled(self) -> bool:
        """Whether the operator lets clients have any server's tools run (``--mcp-execute`` / ``"execute"``)."""
        return self.execute_all or any(s.entry.get("execute", False) for s in self.servers.values())

    def can_execute(self, name: str) -> bool:
        """Whether the server may run tool ``name`` for a client: its server is executable and the
        tool is in the server's ``allowed_tools`` (when it has that list)."""
        if name not in self._tools:
            return False
        server, tool_name = self._tools[name]
        allowed = server.entry.get("allowed_tools")
        return (self.execute_all or server.entry.get("execute", False)) and (allowed is None or tool_name in allowed)

    async def call_tool(
        self, name: str, arguments: str, timeout_s: float = CALL_TIMEOUT_S, max_result_bytes: int | None = None
    ) -> tuple[str, bool]:
        """Run tool ``name`` with the JSON ``arguments`` for at most ``timeout_s``; returns ``(result
        text, is_error)`` (cut to ``max_result_bytes`` of UTF-8, see :func:`truncate_result`), never raises."""
        server, tool_name = self._tools[name]
        if server.session is None:
            return f"the MCP server {server.name!r} is not running", True
        try:
            args = json.loads(arguments) if arguments.strip() else {}
            if not isinstance(args, dict):
                return f"the arguments of {name} must be a JSON object, got {arguments!r}", True
        except ValueError as error:
            return f"the arguments of {name} are not valid JSON ({error}): {arguments!r}", True
        try:
            result = await asyncio.wait_for(server.session.call_tool(tool_name, args), min(timeout_s, CALL_TIMEOUT_S))
        except TimeoutError:
            return f"calling {name} took longer than {min(timeout_s, CALL_TIMEOUT_S):g} s and was stopped", True
        except Exception as error:
            return f"calling {name} failed: {_describe(error)}", True
        texts = [getattr(part, "text", None) or json.dumps(_plain(part)) for part in result.content or []]
        if not texts and getattr(result, "structured_content", None) is not None:
            texts = [json.dumps(result.structured_content)]
        text = "\n".join(texts)
        return truncate_result(text, max_result_bytes), bool(getattr(result, "is_error", False))

    def status(self) -> list[dict[str, Any]]:
        """Each server: transport, ``ok`` or ``error`` with the message, its tool names, and whether
        the server runs its tools for clients (``execute``; ``executable_tools`` names those it may run)."""
        result = []
        for s in self.servers.values():
            tools = [f"{s.name}{SEPARATOR}{t.name}" for t in s.tools]
            executable = [name for name in tools if self.can_execute(name)]
            result.append(
                {
                    "name": s.name,
                    "transport": s.transport,
                    "status": "error" if s.error else "ok",
                    "error": s.error,
                    "tools": tools,
                    "execute": self.execute_all or bool(s.entry.get("execute", False)),
                    "executable_tools": executable,
                }
            )
        return result


def truncate_result(text: str, max_bytes: int | None) -> str:
    """``text`` if it fits in ``max_bytes`` of UTF-8; else its first ``max_bytes`` (whole characters)
    and a note of how much was cut, so the model knows the result is incomplete."""
    data = text.encode()
    if max_bytes is None or len(data) <= max_bytes:
        return text
    kept = data[:max_bytes].decode(errors="ignore")
    return f"{kept}\n[truncated: {len(data) - len(kept.encode())} more bytes (--mcp-max-result-bytes {max_bytes})]"


def _http_client(url: str, headers: dict[str, str] | None) -> Any:
    """The SDK's streamable-HTTP transport (with ``headers`` on every request), yielding (read, write)."""
    from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

    @contextlib.asynccontextmanager
    async def connect():
        async with (
            create_mcp_http_client(headers=headers) as http,
            streamable_http_client(url, http_client=http) as streams,
        ):
            yield streams

    return connect()


def _describe(error: BaseException) -> str:
    if isinstance(getattr(error, "exceptions", None), (list, tuple)):  # an exception group from anyio
        return "; ".join(_describe(e) for e in error.exceptions)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _plain(part: Any) -> Any:
    dump = getattr(part, "model_dump", None)
    return dump(mode="json") if dump else str(part)
