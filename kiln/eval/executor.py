"""Runs a suite: samples every item as a concurrent engine request (so they share batches),
grades each item as soon as its sample arrives, and hands each outcome to the caller, who
commits it before the next arrives.

One thread (the caller's) drives the run: it keeps up to `window` items in flight, reads
finished samples and grades from a queue, and reports outcomes in completion order. The
engine thread only appends deltas and queues a finished sample; grading runs on a few
threads (Python graders then use every sandbox worker, judge calls batch in the engine).
Items listed in `done` are skipped: that is how a run resumes without redoing its work.

A `responses` suite samples each item as an agent run (kiln.agent) on an event loop of the
run's own: its turns are engine requests like any other, its tools run on that loop, and the
graders see the final answer and the whole transcript (`sample.output_items`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kiln.engine.request import Delta
from kiln.errors import KilnError
from kiln.eval.outcome import criterion_result, make_outcome, sample_object, usage
from kiln.eval.suite import Suite, as_sample
from kiln.graders import Judge, make_sample

log = logging.getLogger("kiln.eval")

GRADING_THREADS = 8
AGENT_CLOSE_S = 30.0  # how long a stopped run waits for its agent runs to close their tools


class _Graders:
    """Grading threads, at most `size` grading at once. They are daemons: a run that stops (a
    cancel, a shutdown) leaves nothing the process must wait for, not even a judge call that
    will never be answered once the engine is gone."""

    def __init__(self, size: int):
        self._slots = threading.BoundedSemaphore(size)
        self.closed = False

    def submit(self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        def work() -> None:
            with self._slots:
                if self.closed:
                    return
                try:
                    result, error = fn(), None
                except Exception as exc:  # handed to `done` with the result: the worker thread lives on
                    result, error = None, exc
            if not self.closed:
                done(result, error)

        threading.Thread(target=work, name="kiln-eval-grade", daemon=True).start()

    def close(self) -> None:
        self.closed = True


class EngineGone(RuntimeError):
    """The engine stopped while a run was sampling."""


class Executor:
    def __init__(self, suite: Suite, *, engine=None, adapter=None, model: str | None = None,
                 judge: Judge | None = None, window: int | None = None, mcp_commands: list[str] | None = None):
        """engine: the AsyncEngine that samples (not needed when the suite's samples are given);
        adapter: the AdapterWeights a served adapter samples with (None: the base model);
        model: the name recorded in each sample; judge: for model graders; mcp_commands: the
        stdio MCP commands a responses suite's tools may start (None: any)."""
        if engine is None and not suite.samples_given:
            raise ValueError("a suite that samples needs an engine")
        self.suite, self.engine, self.adapter, self.judge = suite, engine, adapter, judge
        self.model = model if model is not None else (engine.model.model_id if engine is not None else None)
        self.window = window or (engine.config.max_num_seqs if engine is not None else GRADING_THREADS) or 1
        self._events: queue.Queue = queue.Queue()
        self._requests: dict[int, str] = {}  # item index -> engine request id, while sampling
        self._runs: dict[int, concurrent.futures.Future] = {}  # item index -> its agent run, while sampling
        self._loop: asyncio.AbstractEventLoop | None = None  # where agent runs run
        self.mcp_commands = mcp_commands

    def run(self, on_outcome: Callable[[dict], None], done: Iterable[int] = (),
            stop: threading.Event | None = None) -> bool:
        """Runs every item not in `done`, calling on_outcome(outcome) for each, in this thread.
        Returns True when all are done, False if `stop` was set first (requests in flight are
        aborted, outcomes not yet reported are dropped). Raises EngineGone if the engine stops."""
        skip = set(done)
        pending = deque(i for i in range(len(self.suite.items)) if i not in skip)
        in_flight = 0
        self._events = queue.Queue()  # a fresh one: nothing a stopped run left behind reaches this one
        grading = _Graders(GRADING_THREADS)
        try:
            while pending or in_flight:
                while pending and in_flight < self.window:
                    self._start(pending.popleft(), grading)
                    in_flight += 1
                event = self._next(stop)
                if event is None:
                    return False
                kind, index, payload = event
                if kind == "sampled":
                    self._requests.pop(index, None)
                    self._runs.pop(index, None)
                    self._grade_later(grading, index, payload)
                else:  # graded
                    on_outcome(payload)
                    in_flight -= 1
            return True
        finally:
            for request_id in self._requests.values():
                self.engine.abort(request_id)
            self._requests.clear()
            self._runs.clear()
            self._close_agent_loop()
            grading.close()

    # ---- internals -------------------------------------------------------------------------

    def _next(self, stop: threading.Event | None):
        while True:
            if stop is not None and stop.is_set():
                return None
            try:
                return self._events.get(timeout=0.1)
            except queue.Empty:
                if (self._requests or self._runs) and not self.engine.alive():
                    raise EngineGone("the engine stopped during the run") from None

    def _start(self, index: int, grading: _Graders) -> None:
        """Submits item `index` for sampling (or, when its sample is given, for grading)."""
        suite = self.suite
        if suite.samples_given:
            given = suite.samples[index]
            try:
                namespace = as_sample(given, f"item {index}") if given is not None else {}
            except KilnError as exc:
                self._events.put(("sampled", index, self._failed_sample([], exc)))
                return
            text, model = namespace.get("output_text"), namespace.get("model")
            sample = sample_object(messages=[], text=text if isinstance(text, str) else None, finish_reason=None,
                                   model=model if isinstance(model, str) else None, usage_=None, error=None,
                                   sampling=None)
            self._grade_later(grading, index, (namespace, sample))
            return
        messages: list[dict] = []
        try:
            messages = suite.messages(index)
            if suite.sampling.api == "responses":
                self._runs[index] = asyncio.run_coroutine_threadsafe(self._agent_sample(index, messages),
                                                                     self._agent_loop())
                return
            tokenizer = self.engine.model.tokenizer
            prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                      add_special_tokens=False)
            request_id = f"eval-{index}-{uuid.uuid4().hex[:12]}"
            self._requests[index] = request_id
            self.engine.add_request(request_id, prompt, suite.sampling.params(), self._sink(index, messages),
                                    self.adapter)
        except KilnError as exc:  # a template this item cannot fill, a prompt longer than the context
            self._requests.pop(index, None)
            self._events.put(("sampled", index, self._failed_sample(messages, exc)))

    def _agent_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="kiln-eval-agent", daemon=True).start()
        return self._loop

    def _close_agent_loop(self) -> None:
        """Cancels the agent runs still going and lets them end there (each aborts its turn in
        flight and closes its tools, MCP servers included), then stops their loop."""
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def cancel_all() -> None:
            runs = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in runs:
                task.cancel()
            await asyncio.gather(*runs, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(AGENT_CLOSE_S)
        except concurrent.futures.TimeoutError:  # a tool that will not close: its run is left to the daemon thread
            log.warning("agent runs did not end within %.0f s of their eval run's end", AGENT_CLOSE_S)
        loop.call_soon_threadsafe(loop.stop)

    async def _agent_sample(self, index: int, messages: list[dict]) -> None:
        """Item `index` sampled as an agent run; its sample (or its failure) goes to the queue."""
        from kiln import agent  # the agent loop imports the server's request shapes

        try:
            result = await agent.arun(messages, engine=self.engine, adapter=self.adapter,
                                      mcp_commands=self.mcp_commands, **self.suite.sampling.response_fields())
        except KilnError as exc:  # a prompt longer than the context, an MCP server gone since the run began
            self._events.put(("sampled", index, self._failed_sample(messages, exc)))
            return
        except Exception as exc:  # a bug: this item errors, the run goes on
            log.exception("the agent run of item %d failed", index)
            self._events.put(("sampled", index, self._failed_sample(
                messages, KilnError(f"the agent run failed: {exc!r}", code="internal_error"))))
            return
        self._events.put(("sampled", index, agent_sample(result, messages, self.model, self.suite.sampling)))

    def _failed_sample(self, messages: list[dict], exc: KilnError):
        error = {"code": exc.code or type(exc).__name__, "message": exc.message}
        sample = sample_object(messages=messages, text=None, finish_reason=None, model=self.model, usage_=None,
                               error=error, sampling=self.suite.sampling.to_json())
        return None, sample

    def _sink(self, index: int, messages: list[dict]) -> Callable[[Delta], None]:
        texts: list[str] = []

        def sink(delta: Delta) -> None:  # engine thread: keep it short
            texts.append(delta.text)
            if not delta.finished:
                return
            text = "".join(texts)
            error = None
            if delta.error is not None:
                error = {"code": delta.error.code or "request_failed", "message": delta.error.message}
            used = delta.usage or {}
            sample = sample_object(
                messages=messages, text=None if error else text, finish_reason=delta.finish_reason, model=self.model,
                usage_=usage(used.get("prompt_tokens", 0), used.get("completion_tokens", 0),
                             used.get("cached_tokens", 0)),
                error=error, sampling=self.suite.sampling.to_json())
            namespace = None
            if error is None:
                namespace = {**make_sample(text), "model": self.model}
                namespace["choices"][0]["finish_reason"] = delta.finish_reason
            self._events.put(("sampled", index, (namespace, sample)))

        return sink

    def _grade_later(self, grading: _Graders, index: int, sampled: tuple[dict | None, dict]) -> None:
        def graded(outcome: dict | None, error: BaseException | None) -> None:
            if error is not None:  # a bug, not a grader's error flag: the item errors
                log.error("grading item %d failed", index, exc_info=error)
                failure = {"code": "internal_error", "message": f"grading failed: {error!r}"}
                outcome = make_outcome(index, self.suite.items[index], {**sampled[1], "error": failure}, [])
            self._events.put(("graded", index, outcome))

        grading.submit(lambda: self._grade(index, *sampled), graded)

    def _grade(self, index: int, namespace: dict | None, sample: dict) -> dict[str, Any]:
        item = self.suite.items[index]
        results = []
        if namespace is not None:  # no sample, nothing to grade: the item is errored
            for grader in self.suite.criteria:
                results.append(criterion_result(grader, grader.grade(namespace, item, self.judge)))
        return make_outcome(index, item, sample, results)


def agent_sample(result, messages: list[dict], model: str | None, sampling) -> tuple[dict, dict]:
    """An agent run's (grader namespace, output item sample): the sample's `output` is the
    transcript, its usage every turn's."""
    used = result.usage or {}
    sample = sample_object(messages=messages, text=None, finish_reason=result.finish_reason, model=model,
                           usage_=usage(used.get("input_tokens", 0), used.get("output_tokens", 0),
                                        (used.get("input_tokens_details") or {}).get("cached_tokens", 0)),
                           error=None, sampling=sampling.to_json())
    sample["output"] = result.transcript()
    return result.grader_sample(model), sample
