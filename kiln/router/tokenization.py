"""A request's prompt token ids, as its worker would compute them, for the prefix index lookup.

Each worker set tokenizes in its profile's `tokenize.mode`:

* `render`: POST the body's prompt fields to the set's `render_url`, or else to the `/render` of
  one of its live workers serving the model (taken in turn; on failure the next is tried).
* `local`: in process, with `{tokenize.local.mount_dir}/{model}/tokenizer.json` and the chat
  template of the `tokenizer_config.json` (or `chat_template.jinja`) beside it. `model` is the
  worker's `model_name`, so an adapter's requests use its base model's tokenizer.
* `compare`: both; the render result is returned (the worker's own truth) and a difference is
  counted per (worker set, model) and logged, rate-limited, with the first differing position.

Local tokenization follows Kiln's server: a chat body is rendered with the template (which places
BOS and special tokens itself) and encoded without special tokens; a text prompt gets BOS only if
the config's `add_bos_token` says so. Token id prompts pass through.

Failures are `TokenizationError`s whose `kind` the gRPC layer maps: `not_found` (no worker set
serves the model), `unavailable` (no live worker could render), `invalid` (the body is wrong).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import httpx
import jinja2
from tokenizers import Tokenizer

from kiln.router.config import RouterConfig, RouterConfigError, Worker, WorkerSet
from kiln.templates import chat_template_environment, default_chat_template, read_tokenizer_dir, token_text

if TYPE_CHECKING:
    from kiln.router.scrape import Scraper, WorkerHealth

log = logging.getLogger("kiln.router.tokenization")

RENDER_TIMEOUT_S = 10.0
MISMATCH_LOG_EVERY_S = 30.0  # at most one mismatch line per (worker set, model) this often
RENDER_FIELDS = ("model", "messages", "tools", "add_generation_prompt", "chat_template_kwargs")


class TokenizationError(Exception):
    """A prompt could not be tokenized; `kind` is not_found, unavailable or invalid."""

    kind: Literal["not_found", "unavailable", "invalid"] = "invalid"


class ModelNotFound(TokenizationError):
    kind = "not_found"


class Unavailable(TokenizationError):
    """No live worker could render, or the local tokenizer cannot be loaded."""

    kind = "unavailable"


class InvalidBody(TokenizationError):
    kind = "invalid"


class TokenizeConfigError(RouterConfigError):
    """Local tokenization cannot work as configured (fatal when a worker set registers)."""


# ---- local tokenizers -----------------------------------------------------------------------------


class LocalTokenizer:
    """A model's `tokenizer.json`, with the chat template and special tokens of its tokenizer config."""

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any], source: Path) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.tokens = {k: token_text(config.get(k)) or "" for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.bos_id = tokenizer.token_to_id(self.tokens["bos_token"]) if self.tokens["bos_token"] else None
        self.eos_id = tokenizer.token_to_id(self.tokens["eos_token"]) if self.tokens["eos_token"] else None
        self.add_bos = bool(config.get("add_bos_token", False))
        self.add_eos = bool(config.get("add_eos_token", False))
        template = default_chat_template(config)
        env = chat_template_environment(lambda message: InvalidBody(f"chat template: {message}"))
        self.template = env.from_string(template) if template else None

    @classmethod
    def load(cls, model_dir: Path) -> LocalTokenizer:
        tokenizer, config = read_tokenizer_dir(model_dir, TokenizeConfigError)
        try:
            return cls(tokenizer, config, model_dir / "tokenizer.json")
        except jinja2.TemplateError as e:
            raise TokenizeConfigError(f"{model_dir}: the chat template does not compile: {e}") from None

    def encode_text(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if self.add_eos and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return ids

    def prompt_token_ids(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a checked body (`_prompt_fields`)."""
        if "messages" not in body:
            prompt = body["prompt"]
            return list(prompt) if isinstance(prompt, list) else self.encode_text(prompt)
        if self.template is None:
            raise InvalidBody(f"{self.source.parent.name}: no chat template; only completion prompts tokenize locally")
        try:
            text = self.template.render(
                messages=[_message_dict(m) for m in body["messages"]],
                add_generation_prompt=body.get("add_generation_prompt", True),
                tools=body.get("tools"),
                **self.tokens,
                **(body.get("chat_template_kwargs") or {}),
            )
        except TokenizationError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as e:
            raise InvalidBody(f"chat template failed: {e}") from None
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _message_dict(message: Any) -> Any:
    """A message as chat templates expect it: text parts joined, tool call arguments as objects."""
    if not isinstance(message, dict):
        raise InvalidBody("messages must be objects")
    d = {k: v for k, v in message.items() if v is not None}
    content = message.get("content")
    if isinstance(content, list):
        d["content"] = "".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    elif content is None:
        d["content"] = ""
    if isinstance(calls := message.get("tool_calls"), list):
        d["tool_calls"] = [_tool_call(c) for c in calls]
    return d


def _tool_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
    except ValueError:
        return call


def _prompt_fields(body: Any) -> dict[str, Any]:
    """The fields /render reads, checked; a batch of one prompt is unwrapped. Raises InvalidBody."""
    if not isinstance(body, dict):
        raise InvalidBody("the request body must be a JSON object")
    if body.get("messages") is not None:
        if not isinstance(body["messages"], list):
            raise InvalidBody("messages must be a list")
        return {k: body[k] for k in RENDER_FIELDS if k != "model" and body.get(k) is not None}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise InvalidBody(f"a batch of {len(prompt)} prompts; send one prompt per request")
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise InvalidBody("either messages or prompt (a string or token ids) is required")
    return {"prompt": prompt}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two id lists differ (the shorter one's length if it is a prefix); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ---- the component ------------------------------------------------------------------------------


def render_limits(config: RouterConfig) -> httpx.Limits:
    """The render client's pool: `pool_max_idle_per_host` idle connections for each host known at start.

    httpx bounds idle connections over the whole pool, not per host, so the bound is the per-host
    figure times the distinct hosts of the static worker sets (render_url and workers' http_url).
    Busy connections are not bounded. Unset, idle connections are not bounded either.
    """
    per_host = config.tokenize.pool_max_idle_per_host
    if per_host is None:
        return httpx.Limits(max_connections=None, max_keepalive_connections=None)
    hosts = set()
    for ws in config.workerset:
        urls = [ws.render_url, *(w.http_url for w in ws.workers)]
        hosts.update(urlsplit(u).netloc for u in urls if u)
    return httpx.Limits(max_connections=None, max_keepalive_connections=per_host * max(1, len(hosts)))


@dataclass(eq=False)
class _Set:
    worker_set: WorkerSet
    mode: str
    workers: dict[int, Worker] = field(default_factory=dict)
    turn: int = 0  # rotates the worker rendered on first


class Tokenization:
    """Prompt token ids for every worker set, in each one's profile's mode.

    `scraper` (optional) tells which workers are alive and which adapters they serve; without it
    every worker is taken as alive and serving only its `model_name`.
    """

    def __init__(
        self,
        config: RouterConfig,
        scraper: Scraper | None = None,
        *,
        render_timeout_s: float = RENDER_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.scraper = scraper
        self.mount_dir = config.tokenize.local.mount_dir
        self.limits = render_limits(config)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(render_timeout_s), limits=self.limits)
        self._sets: dict[str, _Set] = {}
        self._local: dict[str, LocalTokenizer] = {}
        self._loading: dict[str, asyncio.Future[LocalTokenizer]] = {}
        self.mismatches: dict[tuple[str, str], int] = {}  # (worker set, model) -> renders that local disagreed with
        self.local_failures: dict[tuple[str, str], int] = {}  # compare mode: local failed where render did not
        self._logged_at: dict[tuple[str, str], float] = {}

    async def start(self) -> None:
        """Register the configuration's worker sets (loading tokenizers, with local.warmup)."""
        for ws in self.config.workerset:
            await self.register_worker_set(ws)

    async def aclose(self) -> None:
        await self.client.aclose()

    # ---- registration -------------------------------------------------------------------------

    async def register_worker_set(self, worker_set: WorkerSet) -> None:
        """Add (or replace) a worker set with its workers; raises TokenizeConfigError when local
        tokenization cannot work: no `tokenize.local.mount_dir`, or, with warmup, a tokenizer that does not load."""
        mode = self.config.profile_named(worker_set.profile).tokenize.mode
        if mode != "render" and self.mount_dir is None:
            raise TokenizeConfigError(
                f"worker set {worker_set.name!r} tokenizes in {mode} mode (profile {worker_set.profile!r}), "
                "which needs tokenize.local.mount_dir: the router does not download tokenizers, so mount "
                "{mount_dir}/{model}/tokenizer.json for each model"
            )
        self._sets[worker_set.name] = _Set(worker_set, mode)
        for worker in worker_set.workers:
            await self.add_worker(worker_set.name, worker)

    async def add_worker(self, worker_set: str, worker: Worker) -> None:
        """A worker registers in a registered set; with local.warmup its model's tokenizer is loaded now."""
        entry = self._sets[worker_set]
        entry.workers[worker.worker_id_num] = worker
        if entry.mode != "render" and self.config.tokenize.local.warmup and worker.model_name:
            await self.warm(worker.model_name)

    def unregister_worker_set(self, worker_set: str) -> None:
        self._sets.pop(worker_set, None)

    def remove_worker(self, worker_set: str, worker_id_num: int) -> None:
        if (entry := self._sets.get(worker_set)) is not None:
            entry.workers.pop(worker_id_num, None)

    def mode(self, worker_set: str) -> str:
        return self._sets[worker_set].mode

    async def warm(self, model: str) -> LocalTokenizer:
        """The model's local tokenizer, loaded once (in a thread) and cached; raises TokenizeConfigError."""
        if (tok := self._local.get(model)) is not None:
            return tok
        if (pending := self._loading.get(model)) is not None:
            return await asyncio.shield(pending)
        if self.mount_dir is None:
            raise TokenizeConfigError("local tokenization needs tokenize.local.mount_dir")
        if Path(model).is_absolute() or ".." in Path(model).parts:
            raise TokenizeConfigError(f"model name {model!r} leads outside tokenize.local.mount_dir")
        model_dir = self.mount_dir / model
        future = asyncio.get_running_loop().create_future()
        self._loading[model] = future
        try:
            tok = await asyncio.to_thread(LocalTokenizer.load, model_dir)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as e:
            future.set_exception(e)
            future.exception()  # retrieved here, so that an unawaited future logs nothing
            raise
        finally:
            del self._loading[model]
        self._local[model] = tok
        future.set_result(tok)
        log.info("loaded tokenizer of %s from %s", model, tok.source)
        return tok

    # ---- tokenizing -----------------------------------------------------------------------------

    async def prompt_token_ids(self, worker_set: str | None, model: str, body: dict[str, Any]) -> list[int]:
        """The prompt ids of an OpenAI chat or completion body for `model` on `worker_set`
        (None: the first registered set with a worker serving the model)."""
        fields = {"model": model, **_prompt_fields(body)}
        entry, serving = self._serving(worker_set, model)
        if entry.mode == "render":
            return await self._render(entry, serving, model, fields)
        base = serving[0].model_name  # an adapter tokenizes as its base model
        if entry.mode == "local":
            return await self._tokenize_locally(base, fields)
        local = asyncio.create_task(self._tokenize_locally(base, fields))
        local.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "exception was never retrieved"
        try:
            rendered = await self._render(entry, serving, model, fields)
        except BaseException:
            local.cancel()
            raise
        try:
            ids = await local
        except TokenizationError as e:
            self._count(self.local_failures, entry.worker_set.name, model, f"local tokenization failed: {e}")
            return rendered
        if (at := first_difference(ids, rendered)) is not None:
            local_ids, render_ids = ids[at : at + 4], rendered[at : at + 4]
            self._count(
                self.mismatches,
                entry.worker_set.name,
                model,
                f"local tokenization differs from /render at position {at}: "
                f"local {local_ids} of {len(ids)} ids, render {render_ids} of {len(rendered)}",
            )
        return rendered

    def _serving(self, worker_set: str | None, model: str) -> tuple[_Set, list[Worker]]:
        """The set and its workers serving the model, live or not (without a set named: the first set
        with a live one, else the first with any); raises ModelNotFound or Unavailable."""
        if worker_set is not None and worker_set not in self._sets:
            raise ModelNotFound(f"no worker set named {worker_set!r}")
        entries = [self._sets[worker_set]] if worker_set is not None else list(self._sets.values())
        empty, found = True, None
        for entry in entries:
            empty = empty and not entry.workers
            serving = [w for w in entry.workers.values() if self._serves(w, model)]
            if serving and any(self._alive(w) for w in serving):
                return entry, serving
            found = found or (serving and (entry, serving))
        if found:
            return found
        if empty and worker_set is not None:
            raise Unavailable(f"worker set {worker_set!r} has no workers")
        where = f"worker set {worker_set!r}" if worker_set is not None else "any worker set"
        raise ModelNotFound(f"model {model!r} is not served by {where}")

    def _serves(self, worker: Worker, model: str) -> bool:
        if worker.model_name == model:
            return True
        state = self._health(worker)
        return state is not None and model in state.models

    def _health(self, worker: Worker) -> WorkerHealth | None:
        if self.scraper is None:
            return None
        try:
            return self.scraper.state(worker.worker_id_num)
        except KeyError:
            return None

    async def _tokenize_locally(self, base_model: str, fields: dict[str, Any]) -> list[int]:
        try:
            tok = await self.warm(base_model)
        except TokenizeConfigError as e:
            raise Unavailable(str(e)) from None
        return await asyncio.to_thread(tok.prompt_token_ids, fields)

    async def _render(self, entry: _Set, serving: list[Worker], model: str, fields: dict[str, Any]) -> list[int]:
        if entry.worker_set.render_url is not None:
            targets = [(entry.worker_set.render_url, "render_url")]
        else:
            live = [w for w in serving if w.http_url is not None and self._alive(w)]
            if not live:
                raise Unavailable(f"no live worker of worker set {entry.worker_set.name!r} to render {model!r}")
            start = entry.turn % len(live)
            entry.turn += 1
            live = live[start:] + live[:start]
            targets = [(w.http_url.rstrip("/") + "/render", w.worker_id_str) for w in live]
        errors = []
        for url, who in targets:
            try:
                return await self._render_at(url, fields)
            except _RenderFailed as e:
                errors.append(f"{who}: {e}")
                log.debug("render on %s failed: %s", who, e)
        raise Unavailable(f"could not render {model!r}: " + "; ".join(errors))

    def _alive(self, worker: Worker) -> bool:
        state = self._health(worker)
        return state is None or state.alive

    async def _render_at(self, url: str, fields: dict[str, Any]) -> list[int]:
        try:
            response = await self.client.post(url, json=fields)
        except httpx.HTTPError as e:
            raise _RenderFailed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
        if response.status_code in (400, 404, 413, 422):  # the request's fault, not the worker's
            error = ModelNotFound if response.status_code == 404 else InvalidBody
            raise error(f"/render answered {response.status_code}: {_error_message(response)}")
        if response.status_code != 200:
            raise _RenderFailed(f"HTTP {response.status_code}: {_error_message(response)}")
        try:
            ids = response.json()["prompt_token_ids"]
        except (ValueError, KeyError, TypeError):
            raise _RenderFailed("the answer has no prompt_token_ids") from None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise _RenderFailed("prompt_token_ids is not a list of integers")
        return ids

    def _count(self, counter: dict[tuple[str, str], int], worker_set: str, model: str, message: str) -> None:
        key = (worker_set, model)
        counter[key] = counter.get(key, 0) + 1
        now = time.monotonic()
        if now - self._logged_at.get(key, -MISMATCH_LOG_EVERY_S) >= MISMATCH_LOG_EVERY_S:
            self._logged_at[key] = now
            log.warning(
                "worker set %s, model %s: %s (%d mismatches, %d local failures so far)",
                worker_set,
                model,
                message,
                self.mismatches.get(key, 0),
                self.local_failures.get(key, 0),
            )


class _RenderFailed(Exception):
    """This renderer failed (unreachable, 5xx, a bad answer): try the next."""


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"][:500]
    return json.dumps(body)[:200]
