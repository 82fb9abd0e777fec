"""The tools an agent run executes itself, beside the function tools its client runs.

- `{"type": "mcp", "server_label", "server_url" | "command", "allowed_tools", "require_approval": "never"}`:
  the tools of an MCP server, reached with the official `mcp` SDK over streamable HTTP
  (`server_url`) or stdio (`command`, a Kiln extension: a command line, as a string or a list).
  Each server is connected once per run, on a task of its own (the SDK's connections must be
  closed by the task that opened them), and listed before the run starts: a server that cannot be
  reached is the request's 400.
- `{"type": "kiln_python", "name", "description", "parameters", "source"}` (a Kiln extension):
  `source` defines the function `name`, called with the model's arguments in the grader sandbox
  (a separate process with time and memory limits and no network).

Either may set `timeout_s` (a Kiln extension; default 30 s) for each of its calls.

A call never raises: a tool that fails, times out or gets arguments that are not a JSON object
answers with an error, which the model reads as the tool's output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shlex
from typing import Any

from kiln.errors import InvalidRequest
from kiln.graders.python_sandbox import SandboxPool, default_pool, source_problem

CALL_TIMEOUT_S = 30.0  # one tool call, unless the tool says otherwise (Kiln's `timeout_s`, at most MAX_TIMEOUT_S)
MAX_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0  # reaching and listing an MCP server


@dataclasses.dataclass
class ToolResult:
    output: str  # what the model reads
    error: str | None = None  # why the call failed (output then says so too)


def _failed(message: str) -> ToolResult:
    return ToolResult(f"error: {message}", message)


def _timeout(spec: dict[str, Any], param: str) -> float:
    value = spec.get("timeout_s", CALL_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_TIMEOUT_S:
        raise InvalidRequest(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]",
                             param=f"{param}.timeout_s")
    return float(value)


def _arguments(arguments: str) -> dict[str, Any] | str:
    """The model's arguments as keyword arguments, or why they are not."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return "the arguments are not valid JSON"
    return value if isinstance(value, dict) else "the arguments must be a JSON object"


class PythonTool:
    """A `kiln_python` tool: its function, run in the sandbox."""

    def __init__(self, spec: dict[str, Any], param: str, pool: SandboxPool | None):
        for key in ("name", "source"):
            if not isinstance(spec.get(key), str) or not spec[key]:
                raise InvalidRequest(f"a kiln_python tool needs a {key}", param=f"{param}.{key}")
        if spec.get("parameters") is not None and not isinstance(spec["parameters"], dict):
            raise InvalidRequest("parameters must be a JSON Schema object", param=f"{param}.parameters")
        if (problem := source_problem(spec["source"], spec["name"])) is not None:
            raise InvalidRequest(f"source {problem}", param=f"{param}.source")
        self.name, self.source, self.pool = spec["name"], spec["source"], pool
        self.timeout_s = _timeout(spec, param)
        self.function = {"type": "function", "name": self.name, "description": spec.get("description") or "",
                         "parameters": spec.get("parameters") or {"type": "object", "properties": {}}}

    async def call(self, arguments: str) -> ToolResult:
        kwargs = _arguments(arguments)
        if isinstance(kwargs, str):
            return _failed(kwargs)
        outcome = await asyncio.to_thread((self.pool or default_pool()).call_function, self.source, self.name, kwargs,
                                          self.timeout_s)
        if outcome.error is not None:
            return _failed(f"{outcome.error}: {(outcome.details or '').strip()[-2000:]}")
        return ToolResult(outcome.value)


class McpServer:
    """One MCP server of a run: its connection lives on its own task, which takes calls from a queue."""

    def __init__(self, spec: dict[str, Any], param: str, allowed_commands: list[str] | None):
        self.param = param
        label = spec.get("server_label")
        if not isinstance(label, str) or not label:
            raise InvalidRequest("an mcp tool needs a server_label", param=f"{param}.server_label")
        url, command = spec.get("server_url"), spec.get("command")
        if (url is None) == (command is None):
            raise InvalidRequest("an mcp tool needs one of server_url and command", param=f"{param}.server_url")
        if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
            raise InvalidRequest("server_url must be an http(s) URL", param=f"{param}.server_url")
        if command is not None:
            argv = shlex.split(command) if isinstance(command, str) else command
            if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
                raise InvalidRequest("command must be a command line or a list of strings", param=f"{param}.command")
            if allowed_commands is not None and argv not in [shlex.split(c) for c in allowed_commands]:
                raise InvalidRequest("this server starts only the MCP commands its [server] mcp_commands setting lists",
                                     param=f"{param}.command")
            command = argv
        if spec.get("require_approval", "never") != "never":
            raise InvalidRequest("only require_approval \"never\" is supported", param=f"{param}.require_approval")
        allowed = spec.get("allowed_tools")
        if isinstance(allowed, dict):
            allowed = allowed.get("tool_names")
        if allowed is not None and not (isinstance(allowed, list) and all(isinstance(a, str) for a in allowed)):
            raise InvalidRequest("allowed_tools must be a list of tool names", param=f"{param}.allowed_tools")
        self.label, self.url, self.command, self.allowed = label, url, command, allowed
        self.timeout_s = _timeout(spec, param)
        self.tools: list[Any] = []  # the SDK's Tool objects this run may call
        self._calls: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    @property
    def where(self) -> str:
        return f"{self.param}.server_url" if self.url else f"{self.param}.command"

    def _target(self) -> Any:
        from mcp import StdioServerParameters

        if self.url:
            return self.url
        return StdioServerParameters(command=self.command[0], args=self.command[1:])

    async def open(self) -> None:
        """Connects and lists the server's tools; a 400 naming the server if that fails."""
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._calls = asyncio.Queue()
        self._task = asyncio.create_task(self._serve(ready))
        try:
            listed = await asyncio.wait_for(ready, CONNECT_TIMEOUT_S)
        except Exception as exc:  # the SDK's and the transport's failures alike: the server cannot be used
            await self.close()
            reason = str(exc) or type(exc).__name__
            raise InvalidRequest(f"cannot reach MCP server {self.label!r}: {reason}", param=self.where) from None
        self.tools = [t for t in listed if self.allowed is None or t.name in self.allowed]

    async def _serve(self, ready: asyncio.Future) -> None:
        from mcp import Client

        pending: asyncio.Future | None = None
        try:
            async with Client(self._target(), read_timeout_seconds=self.timeout_s) as client:
                ready.set_result((await client.list_tools()).tools)
                while (job := await self._calls.get()) is not None:
                    name, arguments, pending = job
                    try:
                        result = await client.call_tool(name, arguments)
                    except Exception as exc:  # a protocol error answers this call; the connection goes on
                        result = exc
                    if not pending.done():
                        pending.set_result(result)
                    pending = None
        except Exception as exc:  # the connection's end, whatever the transport says: reported to who waits
            for future in (ready, pending):
                if future is not None and not future.done():
                    future.set_exception(exc)

    async def call(self, name: str, arguments: str) -> ToolResult:
        kwargs = _arguments(arguments)
        if isinstance(kwargs, str):
            return _failed(kwargs)
        if self._task is None or self._task.done():  # closed after a timeout, or lost: connect again
            try:
                await self.open()
            except InvalidRequest as exc:
                return _failed(exc.message)
        result_future = asyncio.get_running_loop().create_future()
        await self._calls.put((name, kwargs, result_future))
        try:
            result = await asyncio.wait_for(result_future, self.timeout_s)
        except TimeoutError:
            await self.close()  # the call still runs on the server's side: this connection is done
            return _failed(f"{name} did not answer within {self.timeout_s:g} s")
        except Exception as exc:  # the connection ended during the call
            return _failed(f"the MCP server {self.label!r} failed: {exc or type(exc).__name__}")
        if isinstance(result, Exception):
            return _failed(str(result) or type(result).__name__)
        text = "\n".join(getattr(part, "text", None) or json.dumps(part.model_dump(mode="json"))
                         for part in result.content)
        if not text and result.structured_content is not None:
            text = json.dumps(result.structured_content)
        return _failed(text or "the tool failed") if result.is_error else ToolResult(text)

    def list_item(self, item_id: str) -> dict[str, Any]:
        tools = [{"name": t.name, "description": t.description, "input_schema": t.input_schema,
                  "annotations": t.annotations.model_dump(mode="json") if t.annotations else None} for t in self.tools]
        return {"type": "mcp_list_tools", "id": item_id, "server_label": self.label, "tools": tools}

    async def close(self) -> None:
        if self._task is None:
            return
        task, self._task = self._task, None
        if not task.done():
            self._calls.put_nowait(None)
            try:
                await asyncio.wait_for(task, 5)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()


class AgentTools:
    """A request's tools: function tools (its client runs them) and the tools Kiln runs."""

    def __init__(self, tools: list[dict[str, Any]] | None, pool: SandboxPool | None = None,
                 allowed_commands: list[str] | None = None):
        """allowed_commands: the stdio MCP command lines a request may start (None: any, for callers
        in this process; the server passes its `mcp_commands` setting)."""
        self.functions: list[dict[str, Any]] = []
        self.python: dict[str, PythonTool] = {}
        self.servers: list[McpServer] = []
        for i, spec in enumerate(tools or []):
            kind = spec.get("type") if isinstance(spec, dict) else None
            if kind == "function":
                if not isinstance(spec.get("name"), str) or not spec["name"]:
                    raise InvalidRequest("a function tool needs a name", param=f"tools[{i}].name")
                if spec.get("parameters") is not None and not isinstance(spec["parameters"], dict):
                    raise InvalidRequest("function parameters must be a JSON Schema object",
                                         param=f"tools[{i}].parameters")
                self.functions.append(spec)
            elif kind == "kiln_python":
                tool = PythonTool(spec, f"tools[{i}]", pool)
                self.python[tool.name] = tool
            elif kind == "mcp":
                self.servers.append(McpServer(spec, f"tools[{i}]", allowed_commands))
            else:
                raise InvalidRequest(f"tool type {kind!r} is not supported (function, mcp, kiln_python)",
                                     param=f"tools[{i}].type")
        self._mcp: dict[str, McpServer] = {}

    @property
    def runs_any(self) -> bool:
        """Whether Kiln runs some of these tools (the request is an agent run)."""
        return bool(self.python or self.servers)

    async def open(self) -> None:
        """Connects to every MCP server and learns its tools; names must not collide."""
        try:
            for server in self.servers:
                await server.open()
        except BaseException:
            await self.close()
            raise
        names = [f["name"] for f in self.functions] + list(self.python)
        for server in self.servers:
            for tool in server.tools:
                if tool.name in names or tool.name in self._mcp:
                    await self.close()
                    raise InvalidRequest(f"two tools are named {tool.name!r}", param=server.where)
                self._mcp[tool.name] = server

    def model_tools(self) -> list[dict[str, Any]]:
        """Every tool the model may call, as Responses function tools."""
        mcp = [{"type": "function", "name": t.name, "description": t.description or "",
                "parameters": t.input_schema or {"type": "object"}}
               for server in self.servers for t in server.tools]
        return [*self.functions, *(t.function for t in self.python.values()), *mcp]

    def server_label(self, name: str) -> str | None:
        """The MCP server a tool name belongs to (its calls are `mcp_call` items), or None."""
        server = self._mcp.get(name)
        return server.label if server else None

    def runs(self, name: str) -> bool:
        return name in self.python or name in self._mcp

    async def call(self, name: str, arguments: str) -> ToolResult:
        if name in self.python:
            return await self.python[name].call(arguments)
        return await self._mcp[name].call(name, arguments)

    async def close(self) -> None:
        for server in self.servers:
            await server.close()
