"""A real stdio MCP server for the tests, written with the official SDK (``python mcp_server_fixture.py``)."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

server = MCPServer("calc")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


if __name__ == "__main__":
    server.run("stdio")
