"""Training data: OpenAI's fine-tuning JSONL, rendered with the model's chat template, in
length-bucketed batches.

Two record forms are accepted:
  {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]?}   chat; an assistant
      message may carry "weight": 0 to be left out of the loss (OpenAI's convention);
  {"prompt": "...", "completion": "..."}                                 plain text.

Only assistant (or completion) tokens are trained. The assistant spans are found in the
rendered text, by rendering each conversation prefix with and without its assistant turn,
and mapped to tokens through the tokenizer's offsets, so the ids are exactly those of the
whole conversation tokenized at once.

Batches have a fixed row count and a sequence length from a small set of buckets, so a job
compiles a handful of step executables.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kiln.errors import DataError, TemplateError
from kiln.models.tokenizer import KilnTokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
MIN_BUCKET = 32


@dataclasses.dataclass(frozen=True)
class Example:
    ids: np.ndarray  # int32 [n]
    trained: np.ndarray  # float32 [n]: 1 where predicting ids[i] is trained (never i = 0)

    @property
    def trained_tokens(self) -> int:
        return int(self.trained[1:].sum())


class Batch(NamedTuple):
    """A micro-batch of right-padded rows [B, S], and its trained positions: the flat index
    (row * S + position) of each trained input token, the token it must predict, and a mask
    for the padding of that list to its bucket K. Only those K positions reach the LM head."""

    tokens: np.ndarray  # int32 [B, S]
    valid: np.ndarray  # bool [B, S]: a real input token (not padding)
    loss_index: np.ndarray  # int32 [K]
    loss_targets: np.ndarray  # int32 [K]
    loss_mask: np.ndarray  # float32 [K]


def read_jsonl(data: bytes | str | Path, what: str = "training file") -> list[tuple[int, dict]]:
    """(line number, record) for every non-blank line; a bad line raises DataError naming it."""
    if isinstance(data, Path):
        data = data.read_bytes()
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{what} is not UTF-8 text: {exc}") from None
    records = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{what}, line {number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{what}, line {number}: expected a JSON object, got {type(record).__name__}")
        records.append((number, record))
    if not records:
        raise DataError(f"{what} has no examples")
    return records


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    if content is None:
        return ""
    raise DataError(f"{where}: content must be a string or a list of text parts")


def _check_messages(record: dict, where: str, to_train: bool = True) -> list[dict]:
    """The record's messages, checked, with text contents; `to_train`: it must hold an assistant
    message to learn (else: a prompt, which must not end with one)."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}, messages[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{at}: expected an object")
        if m.get("role") not in ROLES:
            raise DataError(f"{at}: role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        if "weight" in m and (m["role"] != "assistant" or m["weight"] not in (0, 1)):
            raise DataError(f"{at}: 'weight' is 0 or 1, on assistant messages only")
        out.append({**m, "content": _text(m.get("content"), at)})
    if to_train and not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant message to train on")
    if not to_train and out[-1]["role"] == "assistant":
        raise DataError(f"{where}: the conversation ends with an assistant turn; the model writes that one")
    return out


def _render(tokenizer: KilnTokenizer, messages: list[dict], tools, generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tools=tools)
    except TemplateError as exc:
        raise DataError(f"{where}: {exc.message}") from None


def _chat_text(record: dict, tokenizer: KilnTokenizer, where: str) -> tuple[str, list[tuple[int, int]]]:
    messages = _check_messages(record, where)
    tools = record.get("tools")
    full = _render(tokenizer, messages, tools, False, where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or m.get("weight", 1) == 0:
            continue
        before = _render(tokenizer, messages[:i], tools, True, where)
        through = _render(tokenizer, messages[: i + 1], tools, False, where)
        if not (through.startswith(before) and full.startswith(through)):
            raise DataError(f"{where}: the chat template does not render this conversation as a sequence of turns "
                            "(each turn must extend the text before it), so its assistant tokens cannot be found")
        spans.append((len(before), len(through)))
    return full, spans


def _completion_text(record: dict, tokenizer: KilnTokenizer, where: str) -> tuple[str, list[tuple[int, int]]]:
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DataError(f"{where}: 'prompt' and 'completion' must be strings")
    eos = tokenizer.eos_token or ""
    text = prompt + completion + ("" if completion.endswith(eos) else eos)  # learn to stop
    return text, [(len(prompt), len(text))]


def encode_record(record: dict, tokenizer: KilnTokenizer, max_seq_len: int, where: str = "example") -> Example:
    if "messages" in record:
        text, spans = _chat_text(record, tokenizer, where)
    elif "prompt" in record or "completion" in record:
        text, spans = _completion_text(record, tokenizer, where)
    else:
        raise DataError(f"{where}: expected {{\"messages\": [...]}} or {{\"prompt\": ..., \"completion\": ...}}")
    encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    ids, starts = list(encoding.ids), [start for start, _ in encoding.offsets]
    trained = [float(any(lo <= s < hi for lo, hi in spans)) for s in starts]
    if tokenizer.add_bos and tokenizer.bos_token_id is not None:
        ids, trained = [tokenizer.bos_token_id, *ids], [0.0, *trained]
    trained[0] = 0.0  # the first token is never predicted
    return Example(np.asarray(ids[:max_seq_len], np.int32), np.asarray(trained[:max_seq_len], np.float32))


def load_examples(data: bytes | str | Path, tokenizer: KilnTokenizer, max_seq_len: int,
                  what: str = "training file") -> list[Example]:
    """Parses, validates and tokenizes a JSONL file; refuses one with no trainable tokens."""
    examples = [encode_record(r, tokenizer, max_seq_len, f"{what}, line {n}") for n, r in read_jsonl(data, what)]
    if sum(e.trained_tokens for e in examples) == 0:
        raise DataError(f"{what} has no trainable tokens (no assistant or completion tokens within "
                        f"{max_seq_len} tokens)", code="no_trainable_tokens")
    return examples


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A reinforcement-learning item: the prompt's token ids and the record the reward sees."""

    ids: list[int]
    item: dict


def encode_prompt(record: dict, tokenizer: KilnTokenizer, max_prompt_len: int, where: str = "item") -> Prompt:
    """`{"messages": [...], ...}` rendered with the chat template and a generation prompt (the
    conversation must not end with an assistant turn), or `{"prompt": "text", ...}` as is. The
    whole record is the grader's `item`."""
    if "messages" in record:
        text = _render(tokenizer, _check_messages(record, where, to_train=False), record.get("tools"), True, where)
    elif isinstance(record.get("prompt"), str):
        text = record["prompt"]
    else:
        raise DataError(f"{where}: expected {{\"messages\": [...]}} or {{\"prompt\": \"...\"}}")
    ids = list(tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)
    if tokenizer.add_bos and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id, *ids]
    if not ids:
        raise DataError(f"{where}: the prompt is empty")
    if len(ids) > max_prompt_len:
        raise DataError(f"{where}: the prompt has {len(ids)} tokens, more than the {max_prompt_len} allowed")
    return Prompt(ids, record)


def load_prompts(data: bytes | str | Path, tokenizer: KilnTokenizer, max_prompt_len: int,
                 what: str = "training file") -> list[Prompt]:
    """Parses, validates and tokenizes a JSONL file of reinforcement-learning items."""
    return [encode_prompt(r, tokenizer, max_prompt_len, f"{what}, line {n}") for n, r in read_jsonl(data, what)]


def is_prompt_file(records: list[tuple[int, dict]]) -> bool:
    """Whether a file holds prompts to sample (no assistant turn or completion to imitate)."""
    def imitates(r: dict) -> bool:
        return "completion" in r or any(isinstance(m, dict) and m.get("role") == "assistant"
                                        for m in (r.get("messages") or []) if isinstance(r.get("messages"), list))
    return not any(imitates(r) for _, r in records)


def length_buckets(max_seq_len: int) -> list[int]:
    """Sequence-length buckets: 32, 48, then four per octave (64, 80, 96, 112, 128, 160, ...),
    and max_seq_len itself. A batch pads by at most a quarter of its length (an eighth from
    128 on), and since rows of similar length are batched together, a job meets few shapes."""
    buckets, n = [32, 48], 64
    while n < max_seq_len:
        buckets += [n + i * n // 4 for i in range(4)]
        n *= 2
    return [b for b in buckets if b < max_seq_len] + [max_seq_len]


def bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds n (the largest when none does)."""
    return next((b for b in buckets if b >= n), buckets[-1])


def make_batch(examples: list[Example], rows: int, buckets: list[int]) -> Batch:
    """Rows of inputs ids[:-1] padded to `rows` and a length bucket; the trained positions
    (targets ids[1:] where trained) padded to a bucket of their own."""
    S = bucket(max(len(e.ids) - 1 for e in examples), buckets)
    tokens, valid = np.zeros((rows, S), np.int32), np.zeros((rows, S), bool)
    index, targets = [], []
    for i, e in enumerate(examples):
        n = len(e.ids) - 1
        tokens[i, :n], valid[i, :n] = e.ids[:-1], True
        positions = np.flatnonzero(e.trained[1:])
        index.append(i * S + positions)
        targets.append(e.ids[1:][positions])
    index, targets = np.concatenate(index).astype(np.int32), np.concatenate(targets).astype(np.int32)
    K = bucket(max(len(index), 1), length_buckets(rows * S))
    pad = K - len(index)
    return Batch(tokens, valid, np.pad(index, (0, pad)), np.pad(targets, (0, pad)),
                 np.pad(np.ones(len(index), np.float32), (0, pad)))


def epoch_batches(examples: list[Example], rows: int, buckets: list[int], seed: int) -> Iterator[Batch]:
    """One epoch in a seeded order. Rows of similar length share a batch (examples are shuffled,
    then sorted by length within windows of 16 batches, and the batches shuffled), so little
    of a batch is padding."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(examples))
    window = rows * 16
    groups = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: len(examples[i].ids))
        groups += [chunk[j:j + rows] for j in range(0, len(chunk), rows)]
    for g in rng.permutation(len(groups)):
        yield make_batch([examples[i] for i in groups[g]], rows, buckets)


def batches_per_epoch(n_examples: int, rows: int) -> int:
    window = rows * 16
    full, rest = divmod(n_examples, window)
    return full * 16 + -(-rest // rows)
