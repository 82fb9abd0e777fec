"""Chat templates rendered as transformers renders them: a sandboxed Jinja environment with the filters
and globals templates expect. Shared by the model's tokenizer (kiln/models/tokenizer.py) and the
router's local tokenization (kiln/router/tokenization.py); it imports jinja2 only, so the router can
use it without JAX."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # as transformers' tojson: no HTML escaping, unicode kept
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def chat_template_environment(error: Callable[[str], Exception]) -> ImmutableSandboxedEnvironment:
    """The environment to compile chat templates in; a template's `raise_exception(message)` raises
    `error(message)`."""

    def raise_exception(message: str) -> None:
        raise error(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
