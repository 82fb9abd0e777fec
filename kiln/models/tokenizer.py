"""Tokenizer (HF `tokenizers`), sandboxed jinja2 chat templates, and incremental detokenization."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from kiln.errors import ModelLoadError, TemplateError
from kiln.templates import chat_template_environment, default_chat_template, read_tokenizer_dir, token_text


class KilnTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: dict):
        self.tokenizer = tokenizer
        self.config = config
        self.bos_token = token_text(config.get("bos_token"))
        self.eos_token = token_text(config.get("eos_token"))
        self.unk_token = token_text(config.get("unk_token"))
        self.pad_token = token_text(config.get("pad_token"))
        self.add_bos = bool(config.get("add_bos_token", False))
        self.add_eos = bool(config.get("add_eos_token", False))
        self.bos_token_id = self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        template = default_chat_template(config)
        self.chat_template: str | None = template
        self._compiled = chat_template_environment(TemplateError).from_string(template) if template else None
        self.special_ids = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}

    @classmethod
    def from_dir(cls, model_dir: Path) -> KilnTokenizer:
        return cls(*read_tokenizer_dir(model_dir, ModelLoadError))

    def save(self, model_dir: Path) -> None:
        self.tokenizer.save(str(model_dir / "tokenizer.json"))
        (model_dir / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self.add_eos and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        if self._compiled is None:
            raise TemplateError("this model has no chat template")
        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                unk_token=self.unk_token or "",
                pad_token=self.pad_token or "",
                **kwargs,
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Decodes a short window (from `prefix` to the end) so byte-level BPE tokens that only
    form a character together are held back until the character is complete.
    """

    def __init__(self, tokenizer: KilnTokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])[-6:]  # a little context for spacing rules
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        """Appends one token; returns the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        new_text = self._decode(self.ids[self.prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Emits whatever is held back at the end of a sequence (replacement chars included)."""
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        new_text = self._decode(self.ids[self.prefix :])
        delta = new_text[len(prefix_text) :]
        self.prefix = self.read = len(self.ids)
        self.text += delta
        return delta
