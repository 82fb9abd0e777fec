"""A small MCP server for the agent-run tests (the official SDK's MCPServer):
`python mcp_server.py stdio`, or `python mcp_server.py http PORT` (streamable HTTP at /mcp)."""

import sys
import time
from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("calc")


@server.tool()
def add(a: Literal[2, 3], b: Literal[5, 7]) -> int:
    """Adds two integers."""
    return a + b


@server.tool()
def fail(reason: Literal["disk", "net"]) -> str:
    """Always fails."""
    raise ToolError(f"it broke: {reason}")


@server.tool()
def slow(seconds: Literal[20]) -> str:
    """Answers after a while."""
    time.sleep(seconds)
    return "done"


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run()
    else:
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
