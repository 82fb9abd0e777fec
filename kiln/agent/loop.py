"""An agent run: turns of the chat path on the serving engine, with the tools Kiln runs between them.

Each turn is one engine request. Its prompt continues the previous turn's tokens exactly: the
previous prompt, the tokens the model sampled, then the chat template's text for the tool
results and the next assistant turn, tokenized. So the engine's prefix cache holds the whole
conversation from turn to turn, and an episode is one token sequence in which the model's own
tokens are known: what multi-turn RL trains on (`Episode`). Where the template does not render
the model's text back verbatim, a turn's prompt is the conversation rendered again (`Turn.continued`
is then false).

The run stops when the model answers without a call, calls a function tool its client runs, or a
limit is met: `incomplete` then says which (max_output_tokens, max_tool_calls, max_turns,
context_length).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from kiln.agent.metrics import AgentMetrics
from kiln.agent.tools import AgentTools
from kiln.server import responses_api as ra
from kiln.server.openai_api import ChatPath
from kiln.server.schemas import ResponsesRequest, message_dicts

MAX_TURNS = 16  # a run's model turns unless its request sets max_turns


@dataclasses.dataclass
class Turn:
    """One model generation of a run."""

    prompt_ids: list[int]
    token_ids: list[int]  # what the model sampled
    logprobs: list[float] | None  # the engine's, of each sampled token (when the run asked for them)
    text: str
    finish_reason: str
    usage: dict[str, int]
    metrics: dict[str, Any]
    continued: bool  # the prompt is the previous turn's prompt and tokens, then the template's


class PendingTurn(NamedTuple):
    """A submitted turn: its stream, its output items, its prompt, whether that prompt continues the
    last turn's tokens, whether only the context bounds its length, and the chat messages and tools
    it was rendered from (the next turn's continuation is computed on them)."""

    stream: Any
    output: ra.OutputItems
    prompt: list[int]
    continued: bool
    context_bound: bool
    messages: list[dict]
    tools: list[dict] | None


def continuation(tok, messages: list[dict], tools: list[dict] | None, sampled: list[int],
                 tool_messages: list[dict]) -> str | None:
    """The text that follows a turn's sampled tokens up to the next turn's generation prompt: the
    template's end of the assistant turn, the tool results, the next assistant header. The turn is
    rendered as what its tokens decode to (less an end token it sampled), so the text is the
    template's own; None if the template does not render that text back verbatim after the
    conversation `messages`."""
    def render(msgs, gen):
        return tok.apply_chat_template(msgs, add_generation_prompt=gen, tools=tools)

    sampled_text = tok.decode(sampled, skip_special_tokens=False)
    ended = bool(sampled) and tok.decode(sampled[-1:], skip_special_tokens=True) == ""  # a special end token
    generated = tok.decode(sampled[:-1], skip_special_tokens=False) if ended else sampled_text
    before = render(messages, True)
    turn = [*messages, {"role": "assistant", "content": generated}]
    closed, after = render(turn, False), render(turn + tool_messages, True)
    said = closed[len(before):]
    if not (closed.startswith(before) and said.startswith(generated) and sampled_text.startswith(generated)
            and after.startswith(closed)):
        return None
    # the template's end of the turn, less the end token the model sampled when it is the same
    # one (another end token, say <|endoftext|> for <|im_end|>, stays in the sequence before it)
    end, glue = sampled_text[len(generated):], said[len(generated):]
    return (glue[len(end):] if glue.startswith(end) else glue) + after[len(closed):]


class AgentRun:
    """One Responses request's turns. `begin` submits the first turn (its errors are the request's);
    `events` runs the turns and tools, yielding stream events without sequence numbers; `items`
    are the output items and `turns` the generations."""

    def __init__(self, path: ChatPath, engine, req: ResponsesRequest, tools: AgentTools, conversation: list[dict],
                 rid: str, adapter=None, sample_logprobs: bool = False, metrics: AgentMetrics | None = None):
        self.path, self.engine, self.req, self.tools, self.metrics = path, engine, req, tools, metrics
        self.conversation = list(conversation)
        self.rid, self.adapter, self.sample_logprobs = rid, adapter, sample_logprobs
        self.items: list[dict[str, Any]] = []
        self.turns: list[Turn] = []
        self.incomplete: str | None = None
        self.tool_calls = 0
        self._pending: PendingTurn | None = None
        self._last_context: tuple = ()  # the last turn's chat messages and tools, and where its output starts

    async def begin(self) -> None:
        self.items += [server.list_item(ra.new_item_id("mcpl")) for server in self.tools.servers]
        self._pending = await self._submit()

    async def _submit(self) -> PendingTurn | None:
        """The next turn, submitted; None if the conversation has outgrown the context."""
        used = sum(t.usage["completion_tokens"] for t in self.turns)
        budget = None if self.req.max_output_tokens is None else self.req.max_output_tokens - used
        chat = ra.chat_request(self.req, self.conversation, self.tools.model_tools(), budget)
        prompt, params, reader = await self.path.prepare(chat)
        continued = False
        if self.turns and (exact := self._continued()) is not None:
            prompt, continued = exact, True
        room = self.engine.max_model_len - len(prompt)  # max_output_tokens bounds, the context decides
        if self.turns and room < 1:
            return None
        if params.max_tokens is not None and room >= 1:
            params.max_tokens = min(params.max_tokens, room)
        if self.sample_logprobs and params.logprobs is None:
            params.logprobs = 0
        turn = len(self.turns)
        stream = self.engine.submit(f"{self.rid}-{turn}" if turn else self.rid, prompt, params,
                                    adapter=self.adapter)
        output = ra.OutputItems(reader, self.path.tokenizer, chat.logprobs, len(self.items), self.tools.server_label)
        return PendingTurn(stream, output, prompt, continued, budget is None or room < budget,
                           message_dicts(chat.messages), chat.tools)

    def _continued(self) -> list[int] | None:
        """The next prompt as the last turn's tokens and the template's continuation (None: it cannot be)."""
        last, (messages, tools, start) = self.turns[-1], self._last_context
        tool_messages = [m for m in message_dicts(ra.chat_messages(None, self.conversation[start:])) if
                         m["role"] == "tool"]
        tok = self.path.tokenizer
        text = continuation(tok, messages, tools, last.token_ids, tool_messages)
        if text is None:
            return None
        return last.prompt_ids + last.token_ids + tok.encode(text, add_special_tokens=False)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        for index, listing in enumerate(self.items):  # the MCP servers' tools, listed before the first turn
            yield {"type": "response.output_item.added", "output_index": index, "item": listing}
            yield {"type": "response.output_item.done", "output_index": index, "item": listing}
        while self._pending is not None:
            turn, self._pending = self._pending, None
            stream, output = turn.stream, turn.output
            ids, texts, lps, final = [], [], [], None
            try:
                async for d in stream:
                    if d.error is not None:
                        raise d.error
                    ids += d.token_ids
                    texts.append(d.text)
                    lps += [lp.logprob for lp in d.logprobs or []]
                    final = d if d.finished else final
                    status = "incomplete" if d.finish_reason == "length" else "completed"
                    for e in output.feed(d.text, d.logprobs, d.finished, status):
                        yield e
            finally:
                stream.close()
            self.turns.append(Turn(turn.prompt, ids, lps if self.sample_logprobs else None, "".join(texts),
                                   final.finish_reason, final.usage, final.metrics, turn.continued))
            self._last_context = (turn.messages, turn.tools, len(self.conversation))
            self.items += output.items
            self.conversation += output.items
            if final.finish_reason == "length":
                self.incomplete = "context_length" if turn.context_bound and self.tools.runs_any \
                    else "max_output_tokens"
                return
            calls = output.calls()
            if not calls or not all(self.tools.runs(c["name"]) for c in calls):
                return  # an answer, or calls the client runs
            for i, call in enumerate(calls):
                if self.req.max_tool_calls is not None and self.tool_calls >= self.req.max_tool_calls:
                    self.incomplete = "max_tool_calls"
                    for skipped in calls[i:]:  # never run: their items end here
                        if skipped["type"] == "mcp_call":
                            skipped["status"] = "incomplete"
                            yield {"type": "response.output_item.done", "output_index": self.items.index(skipped),
                                   "item": skipped}
                    return
                self.tool_calls += 1
                async for e in self._run_tool(call):
                    yield e
            if len(self.turns) >= (self.req.max_turns or MAX_TURNS):
                self.incomplete = "max_turns"
                return
            self._pending = await self._submit()
            if self._pending is None:
                self.incomplete = "context_length"

    async def _run_tool(self, call: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        where = {"item_id": call["id"], "output_index": self.items.index(call)}
        if call["type"] == "mcp_call":
            yield {"type": "response.mcp_call.in_progress", **where}
        started = time.perf_counter()
        result = await self.tools.call(call["name"], call["arguments"])
        if self.metrics is not None:
            self.metrics.tool_called("mcp" if call["type"] == "mcp_call" else "kiln_python", bool(result.error),
                                     time.perf_counter() - started)
        if call["type"] == "mcp_call":
            call["output"], call["status"] = (None, "failed") if result.error else (result.output, "completed")
            if result.error:
                call["error"] = {"type": "mcp_tool_execution_error",
                                 "content": [{"type": "text", "text": result.error}]}
            yield {"type": f"response.mcp_call.{call['status']}", **where}
            yield {"type": "response.output_item.done", "output_index": where["output_index"], "item": call}
            return
        item = {"type": "function_call_output", "id": ra.new_item_id("fco"), "call_id": call["call_id"],
                "output": result.output, "status": "completed"}
        self.items.append(item)
        self.conversation.append(item)
        yield {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": item}
        yield {"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": item}

    async def run(self) -> None:
        """All of it, events unread."""
        async for _ in self.events():
            pass

    def usage(self) -> dict[str, Any] | None:
        if not self.turns:
            return None
        reasoning = "".join(p["text"] for it in self.items if it["type"] == "reasoning" for p in it["content"])
        tokens = len(self.path.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return ra.usage([t.usage for t in self.turns], tokens)

    async def close(self) -> None:
        """Aborts the turn in flight (if any) and disconnects the tools."""
        if self._pending is not None:
            self._pending.stream.close()
            self._pending = None
        await self.tools.close()

