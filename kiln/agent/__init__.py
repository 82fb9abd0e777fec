"""Agent runs: a Responses request whose tools Kiln runs itself (MCP servers' tools, sandboxed
Python), looped turn by turn in the serving engine until the model answers without calling one.

The server runs them for `POST /v1/responses`; `run` (or `arun` in an event loop) runs one in
this process on an engine:

    result = kiln.agent.run("What is 123 * 456?", engine=engine, tools=[calculator],
                            tool_choice="auto", max_turns=4)
    print(result.output_text, result.status)

`AgentResult.episode()` is the run as one token sequence with the model's own tokens marked,
what multi-turn GRPO trains on (kiln.train.agent_grpo).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import uuid
from typing import Any

import msgspec
import numpy as np

from kiln.agent.loop import MAX_TURNS, AgentRun, Turn
from kiln.agent.tools import AgentTools
from kiln.errors import InvalidRequest
from kiln.graders.templates import make_sample
from kiln.server import responses_api as ra
from kiln.server.openai_api import ChatPath
from kiln.server.schemas import ResponsesRequest


@dataclasses.dataclass
class AgentResult:
    """What a run produced: its output items (as the Responses API returns them), its status and
    the reason it is incomplete, usage, and its turns (prompt and sampled tokens of each)."""

    output: list[dict[str, Any]]
    status: str  # completed | incomplete
    incomplete: str | None
    usage: dict[str, Any] | None
    turns: list[Turn]

    @property
    def output_text(self) -> str:
        return "".join(p["text"] for it in self.output if it["type"] == "message" for p in it["content"]
                       if p.get("type") == "output_text")

    @property
    def finish_reason(self) -> str:
        """`length` (a limit ended the run), `tool_calls` (a call its client runs did) or `stop`."""
        if self.status == "incomplete":
            return "length"
        return "tool_calls" if self.output and self.output[-1]["type"] == "function_call" else "stop"

    def transcript(self) -> list[dict[str, Any]]:
        """The output as chat messages: assistant turns with their tool_calls (arguments as JSON
        text), the tools' results as tool messages, the answer."""
        return [{k: v for k, v in msgspec.to_builtins(m).items() if v is not None}
                for m in ra.chat_messages(None, self.output)]

    def grader_sample(self, model: str | None = None) -> dict[str, Any]:
        """The graders' `sample` namespace for this run: a completion's (`output_text`,
        `output_json`, `choices`) for its answer, every tool call it made in `output_tools`
        (chat's shape), its output items in `output_items` and its `status`."""
        calls = [call for m in self.transcript() for call in m.get("tool_calls") or []]
        sample = {**make_sample(self.output_text), "model": model, "output_tools": calls,
                  "output_items": self.output, "status": self.status}
        choice = sample["choices"][0]
        choice["finish_reason"] = self.finish_reason
        if calls:
            choice["message"]["tool_calls"] = calls
        return sample

    def episode(self) -> tuple[list[int], list[int], np.ndarray, np.ndarray]:
        """(prompt ids, completion ids, loss mask, sampler logprobs): the whole run as one sequence
        after its first prompt. The mask is 1 on the tokens the model sampled and 0 on what the
        template and the tools put between its turns; logprobs are the engine's for sampled tokens
        (0 elsewhere, or everywhere when the run did not ask for them)."""
        if not self.turns:
            raise ValueError("the run has no turns")
        if not all(t.continued for t in self.turns[1:]):
            raise ValueError("this chat template does not render the model's turns back verbatim, so the run "
                             "is not one token sequence")
        prompt = self.turns[0].prompt_ids
        completion: list[int] = []
        mask: list[float] = []
        logprobs: list[float] = []
        for turn in self.turns:
            between = turn.prompt_ids[len(prompt) + len(completion):]
            completion += between + turn.token_ids
            mask += [0.0] * len(between) + [1.0] * len(turn.token_ids)
            logprobs += [0.0] * len(between) + (turn.logprobs or [0.0] * len(turn.token_ids))
        return prompt, completion, np.asarray(mask, np.float32), np.asarray(logprobs, np.float32)


def _chat_path(engine, settings) -> ChatPath:
    server = settings.server if settings is not None else None
    return ChatPath(engine.model.tokenizer, engine.grammars, server.reasoning_parser if server else "auto",
                    server.tool_call_parser if server else "auto")


def request(input: str | list, tools: list[dict] | None = None, **fields) -> ResponsesRequest:
    """A run's Responses request, checked: InvalidRequest names a field it cannot take."""
    try:
        req = msgspec.convert({"input": input, "tools": tools, "store": False, **fields}, ResponsesRequest)
    except msgspec.ValidationError as exc:
        path = str(exc).rpartition(" - at `$.")[2].rstrip("`")
        raise InvalidRequest(str(exc), param=path if path != str(exc) else None) from None
    ra.check_request(req)
    ra.chat_tool_choice(req.tool_choice)
    return req


def check(fields: dict[str, Any], mcp_commands: list[str] | None = None, at: str | None = None) -> None:
    """Checks a run's Responses fields (its tools among them) as a run takes them, MCP servers
    reached and their tools listed (blocking: for callers without an event loop). InvalidRequest
    names the field at fault, under `at` (such as "kiln.agent") when given."""
    async def reach(tools) -> None:
        agent_tools = AgentTools(tools, allowed_commands=mcp_commands)
        await agent_tools.open()
        await agent_tools.close()

    try:
        _blocking(reach(request("x", **fields).tools))
    except InvalidRequest as exc:
        if at is None:
            raise
        raise exc.with_param(f"{at}.{exc.param}" if exc.param else at) from None


def _blocking(work):
    """Runs a coroutine to its end on a thread of its own, for callers with or without an event
    loop (notebooks have one)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work).result()


async def arun(input: str | list, *, engine, tools: list[dict] | None = None, adapter=None, settings=None,
               sample_logprobs: bool = False, mcp_commands: list[str] | None = None, **fields) -> AgentResult:
    """One agent run on `engine` (an AsyncEngine), from this event loop. `input` and `fields` are the
    Responses API's (instructions, tool_choice, max_turns, max_tool_calls, max_output_tokens,
    temperature, top_p, seed, ...); `adapter`: AdapterWeights placed in the engine, or None for
    the base model; mcp_commands: the stdio MCP commands its tools may start (None: any). Bad
    fields raise kiln.errors.InvalidRequest, naming the field."""
    req = request(input, tools, **fields)
    agent_tools = AgentTools(req.tools, allowed_commands=mcp_commands)
    await agent_tools.open()
    run = AgentRun(_chat_path(engine, settings), engine, req, agent_tools, ra.input_items(req.input),
                   f"agent-{uuid.uuid4().hex[:12]}", adapter, sample_logprobs)
    try:
        await run.begin()
        await run.run()
    finally:
        await run.close()
    return AgentResult(run.items, "incomplete" if run.incomplete else "completed", run.incomplete, run.usage(),
                       run.turns)


def run(input: str | list, **kwargs) -> AgentResult:
    """`arun` for callers without an event loop, notebooks included (it runs on a thread of its own)."""
    return run_many([input], **kwargs)[0]


def run_many(inputs: list, per_run: list[dict] | None = None, **kwargs) -> list[AgentResult]:
    """Runs agents on these inputs concurrently (their turns share the engine's steps), in order;
    `per_run`: fields for each run beside the shared `kwargs` (a seed each, say)."""
    async def all_of_them():
        return await asyncio.gather(*(arun(i, **kwargs, **(extra or {}))
                                      for i, extra in zip(inputs, per_run or [None] * len(inputs), strict=True)))

    return _blocking(all_of_them())


__all__ = ["MAX_TURNS", "AgentResult", "arun", "check", "request", "run", "run_many"]
