"""A model directory's tokenizer files, and chat templates rendered as transformers renders them (a
sandboxed Jinja environment with the filters and globals templates expect). Shared by the model's
tokenizer (kiln/models/tokenizer.py) and the router's local tokenization (kiln/router/tokenization.py);
it imports jinja2 and tokenizers only, so the router can use it without JAX."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def read_tokenizer_dir(model_dir: Path, error: Callable[[str], Exception]) -> tuple[Tokenizer, dict[str, Any]]:
    """`tokenizer.json` and the tokenizer config (`chat_template.jinja` as its template where it has none);
    what cannot be read raises `error(message)`."""
    path = model_dir / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception
        raise error(f"cannot load tokenizer {path}: {e}") from None
    config: dict[str, Any] = {}
    if (config_path := model_dir / "tokenizer_config.json").is_file():
        try:
            config = json.loads(config_path.read_text())
        except ValueError as e:
            raise error(f"{config_path}: not valid JSON: {e}") from None
    if not config.get("chat_template") and (jinja := model_dir / "chat_template.jinja").is_file():
        config["chat_template"] = jinja.read_text()
    return tokenizer, config


def token_text(value: Any) -> str | None:
    """A special token of the tokenizer config, as text (an AddedToken is serialised as a dict)."""
    return value.get("content") if isinstance(value, dict) else value


def default_chat_template(config: dict[str, Any]) -> str | None:
    """The config's chat template; of named templates, the one named "default"."""
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


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
