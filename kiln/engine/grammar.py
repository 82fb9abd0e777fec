"""Constrained decoding: grammars compiled by llguidance into token matchers.

A request's grammar (JSON Schema, regex, a choice of strings, or a Lark/GBNF grammar) is
compiled once per distinct source and cached; each constrained row gets its own copy of the
compiled matcher. Before a step, the matcher of every constrained row writes that row's
allowed tokens as a bitmask (host, llguidance's threads); the jitted sampler applies it
before any sampling parameter. After the step, the matcher consumes the sampled token.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import threading
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer

from kiln.errors import InvalidRequest
from kiln.models.tokenizer import KilnTokenizer

log = logging.getLogger("kiln.engine")

KINDS = ("json", "regex", "choice", "grammar")
# JSON is generated compact (no optional whitespace): an untrained or small model could
# otherwise fill its whole budget with whitespace, and nothing is lost.
JSON_OPTIONS = {"whitespace_flexible": False}
# Bounds on one grammar's lexer and parser work (llguidance's defaults, lexer states capped
# lower): a grammar over them fails to compile with a reason instead of running long.
LIMITS = dict(max_lexer_states=50_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000)


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. `source`: a JSON Schema (dict or JSON text), a
    regex, a JSON list of strings, or a Lark/GBNF grammar; `param` names the request field
    it came from, for errors."""

    kind: str
    source: Any
    param: str = "structured_outputs"

    def text(self) -> str:
        if self.kind == "json" and not isinstance(self.source, str):
            return json.dumps(self.source, sort_keys=True, separators=(",", ":"))
        if self.kind == "choice" and not isinstance(self.source, str):
            return json.dumps(list(self.source))
        return self.source

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.text()}".encode()).hexdigest()


class Grammar:
    """A compiled grammar; `matcher()` is a fresh matcher at its start state."""

    def __init__(self, spec: GrammarSpec, prototype: LLMatcher):
        self.spec, self._prototype = spec, prototype

    def matcher(self) -> LLMatcher:
        return self._prototype.deep_copy()


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for a spec (raises ValueError on malformed input)."""
    if spec.kind not in KINDS:
        raise ValueError(f"unknown grammar kind {spec.kind!r}")
    if spec.kind == "json":
        source = json.loads(spec.source) if isinstance(spec.source, str) else spec.source
        if not isinstance(source, dict):
            raise ValueError("a JSON Schema must be an object")
        return LLMatcher.grammar_from_json_schema(source, overrides=JSON_OPTIONS)
    if spec.kind == "choice":
        choices = json.loads(spec.text())
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a non-empty list of strings")
        return llguidance.grammar_from("choice", json.dumps(choices))
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    return llguidance.grammar_from("grammar", spec.source)


class GrammarCompiler:
    """Compiles grammar specs for one tokenizer, caching them by content hash (LRU)."""

    def __init__(self, tokenizer: KilnTokenizer, vocab_size: int, eos_ids: tuple[int, ...], cache_size: int = 256,
                 timeout_s: float = 10.0):
        self._hf, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self.cache_size, self.timeout_s = cache_size, timeout_s
        self._tokenizer: LLTokenizer | None = None
        self._cache: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars built (cache misses)

    @property
    def tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:  # about half a second: built on first use
                eos = list(self.eos_ids) or None
                self._tokenizer = LLTokenizer(self._hf.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar (cached); InvalidRequest naming spec.param with llguidance's reason."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"invalid {spec.param}: {exc}", param=spec.param) from exc
        matcher = LLMatcher(self.tokenizer, text, log_level=0, limits=LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise InvalidRequest(f"invalid {spec.param}: {matcher.get_error().strip()}", param=spec.param)
        grammar = Grammar(spec, matcher)
        with self._lock:
            self._cache[key] = grammar
            self.compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    async def compile_async(self, spec: GrammarSpec) -> Grammar:
        """compile() off the event loop, bounded in time: a grammar that takes longer is a 400
        (its compile finishes in the background and is cached, never blocking the engine)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.compile, spec), self.timeout_s)
        except TimeoutError as exc:
            raise InvalidRequest(f"{spec.param} took longer than {self.timeout_s:g} s to compile; simplify it",
                                 param=spec.param) from exc


class MaskFiller:
    """Writes the allowed-token bitmasks of a step's constrained rows (llguidance threads)."""

    def __init__(self):
        self._executor: LLExecutor | None = None
        self.steps = 0  # steps that built masks

    def fill(self, matchers: list[tuple[LLMatcher, int]], rows: int, vocab_size: int) -> np.ndarray:
        """int32 [rows, ceil(vocab/32)] bitmask; rows without a matcher allow every token."""
        self.steps += 1
        mask = np.full((rows, (vocab_size + 31) // 32), -1, np.int32)
        if matchers:
            if self._executor is None:
                self._executor = LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, matchers, mask)
        return mask


def advance(matcher: LLMatcher, token: int) -> bool:
    """Consumes a sampled token; True when the grammar is complete (nothing may follow)."""
    if not matcher.consume_token(token):
        log.warning("a constrained row sampled a token its grammar rejects: %s", matcher.get_error())
        return True
    return matcher.is_stopped()
