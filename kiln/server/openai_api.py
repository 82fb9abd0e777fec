"""OpenAI semantics: request bodies -> prompts + SamplingParams, and how a choice is formatted.

Chat and completions differ only here: in how prompts are made and how a choice (whole,
or as a streamed delta) is written. Everything else is shared (see generation.py).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, ClassVar

from kiln.engine.grammar import GrammarCompiler
from kiln.engine.params import MAX_TOP_LOGPROBS, SamplingParams, ThinkingBudget
from kiln.engine.request import Delta, TokenLogprob
from kiln.errors import InvalidRequest
from kiln.models.tokenizer import KilnTokenizer
from kiln.server import structured
from kiln.server.chat_output import THINK_END, THINK_START, OutputReader, StreamedChoice, choose_parser, thinks
from kiln.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields, message_dicts


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    except ValueError as exc:
        raise InvalidRequest("logit_bias keys must be token ids", param="logit_bias") from exc
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty or 1.0,
        logit_bias=bias or None,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        n=req.n,
    )


def render_chat(tok: KilnTokenizer, req, messages) -> list[int]:
    """Prompt ids of a chat body (the template places BOS and special tokens itself). Content parts
    other than text (images, audio, files) are refused, naming the part: the models read text only,
    and a part dropped in silence would answer a question the client did not ask."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.type not in ("text", "refusal"):
                raise InvalidRequest(f"only text content parts are supported, not {part.type!r}: the model reads "
                                     "text only", param=f"messages[{i}].content[{j}].type")
    text = tok.apply_chat_template(message_dicts(messages), add_generation_prompt=req.add_generation_prompt,
                                   tools=req.tools, **(req.chat_template_kwargs or {}))
    return tok.encode(text, add_special_tokens=False)


@dataclasses.dataclass(frozen=True)
class ChatPath:
    """What turns a chat body into a prompt, sampling parameters and an output reader: the model's
    tokenizer, the grammar compiler, and the reasoning and tool-call parser settings. Chat
    completions, the Responses API and agent runs (in the server or in Python) all go through it."""

    tokenizer: KilnTokenizer
    grammars: GrammarCompiler
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"

    async def prepare(self, data: ChatCompletionRequest) -> tuple[list[int], SamplingParams, OutputReader]:
        """The body's prompt ids, its sampling parameters (grammar compiled) and how its output is read."""
        if not data.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        tok = self.tokenizer
        tools = structured.tool_parameters(data.tools)
        mode, function = structured.tool_choice(data, tools)
        constraint = structured.output_constraint(data)
        constraint = structured.tool_call_constraint(mode, function, tools, data.parallel_tool_calls) or constraint
        prompt = render_chat(tok, data, data.messages)
        logprobs = chat_logprob_count(data)
        params = sampling_params(data, chat_max_tokens(data), logprobs)
        template = tok.chat_template
        reader = OutputReader(
            reasoning=thinks(self.reasoning_parser, template) and constraint is None,
            opens_in_reasoning=tok.decode(prompt[-16:], skip_special_tokens=False).rstrip().endswith(THINK_START),
            tool_mode=mode, tool_format=choose_parser(self.tool_call_parser, template), function=function)
        if data.thinking_token_budget is not None and reader.reasoning:
            end = tuple(tok.encode(THINK_END, add_special_tokens=False))
            params.thinking = ThinkingBudget(data.thinking_token_budget, end, THINK_START, THINK_END,
                                             reader.opens_in_reasoning)
        if mode == "auto" and reader.tool_format == "mistral":
            params.skip_special_tokens = False  # [TOOL_CALLS] is a special token
        if constraint is not None:
            params.grammar = await self.grammars.compile_async(constraint)
        return prompt, params, reader


def completion_prompts(tok: KilnTokenizer, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")

    def ids(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if ids(prompt):
        return [list(prompt)]
    if all(isinstance(p, str) and p for p in prompt):
        return [tok.encode(p) for p in prompt]
    if all(ids(p) for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequest("prompt must be a string, a list of strings, or token ids", param="prompt")


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def chat_logprob_count(req: ChatCompletionRequest) -> int | None:
    if not req.logprobs:
        if req.top_logprobs:
            raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")
        return None
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:  # (named as chat names it)
        raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    return req.top_logprobs or 0


def completion_checks(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("best_of is not supported (it must equal n)", param="best_of")
    if req.echo and req.stream:
        raise InvalidRequest("echo is not supported with stream", param="echo")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _token_text(tok: KilnTokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


class ChoiceAccumulator:
    """One choice of a non-streamed response, gathered from its deltas."""

    def __init__(self):
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.final: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.final = delta


class ChatFormat:
    object: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"
    id_prefix: ClassVar[str] = "chatcmpl"
    prompt_param: ClassVar[str] = "messages"  # what an error about the prompt names

    def __init__(self, tok: KilnTokenizer, logprobs: bool, reader: OutputReader | None = None):
        self.tok, self.with_logprobs = tok, logprobs
        self.reader = reader or OutputReader()
        self.streams: dict[int, StreamedChoice] = {}

    def _logprobs(self, items: list[TokenLogprob]) -> dict:
        def entry(tid, lp):
            text = _token_text(self.tok, tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in items]}

    def choice(self, index: int, acc: ChoiceAccumulator) -> dict[str, Any]:
        message = self.reader.message(acc.text)
        return {"index": index, "message": message,
                "logprobs": self._logprobs(acc.logprobs) if self.with_logprobs else None,
                "finish_reason": _finish_reason(acc.final.finish_reason, "tool_calls" in message),
                "stop_reason": acc.final.stop_reason}

    def opening(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def chunk(self, index: int, delta: Delta) -> dict[str, Any] | None:
        stream = self.streams.setdefault(index, StreamedChoice(self.reader))
        choice = {"index": index, "delta": stream.feed(delta.text, delta.finished),
                  "logprobs": self._logprobs(delta.logprobs) if delta.logprobs else None,
                  "finish_reason": _finish_reason(delta.finish_reason, stream.called)}
        return choice if choice["delta"] or choice["finish_reason"] or choice["logprobs"] else None


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class CompletionFormat:
    object: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"
    id_prefix: ClassVar[str] = "cmpl"
    prompt_param: ClassVar[str] = "prompt"

    def __init__(self, tok: KilnTokenizer, logprobs: bool, echo_prompts: list[list[int]] | None = None, n: int = 1):
        self.tok, self.with_logprobs = tok, logprobs
        self.echo_prompts, self.n = echo_prompts, n  # with echo, each choice starts with its prompt

    def _logprobs(self, items: list[TokenLogprob]) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for t in items:
            text = _token_text(self.tok, t.token_id)
            tokens.append(text)
            token_lps.append(t.logprob)
            tops.append({_token_text(self.tok, i): lp for i, lp in t.top} if t.top else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def choice(self, index: int, acc: ChoiceAccumulator) -> dict[str, Any]:
        text, items = acc.text, acc.logprobs
        if self.echo_prompts is not None:
            prompt = self.echo_prompts[index // self.n]
            text = self.tok.decode(prompt) + text
            # the prompt's first token has no logprob
            prompt_lps = acc.prompt_logprobs or [None] * len(prompt)
            items = [lp or TokenLogprob(t, None, []) for t, lp in zip(prompt, prompt_lps, strict=True)] + items
        return {"index": index, "text": text, "logprobs": self._logprobs(items) if self.with_logprobs else None,
                "finish_reason": acc.final.finish_reason, "stop_reason": acc.final.stop_reason}

    def opening(self, index: int) -> dict[str, Any] | None:
        return None

    def chunk(self, index: int, delta: Delta) -> dict[str, Any] | None:
        if not delta.text and not delta.finished:
            return None
        return {"index": index, "text": delta.text,
                "logprobs": self._logprobs(delta.logprobs) if delta.logprobs else None,
                "finish_reason": delta.finish_reason}
