"""Decode the KV-event payloads workers publish (vLLM's ZMQ format), trusting nothing.

A payload is a msgpack batch, either positional, ``[ts, events, data_parallel_rank]``, or a map,
``{"ts": ..., "events": [...], "data_parallel_rank": ...}``. Each event is likewise either an array
led by its tag, ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``, or a
map carrying the tag under ``"type"`` (msgspec's layout for a tagged struct that is not array_like;
fields at their default may be left out). Trailing array elements and unknown map keys are ignored.

Block hashes may be integers or bytes (newer vLLM); both are hashable and kept as they are.

Decoding never raises past :func:`decode_payload`: a batch that cannot be read is one
:class:`Malformed`, and so is each unreadable event inside a readable batch, the others kept.
This module imports nothing from the serving side of Kiln.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"

BlockHash = Hashable  # int or bytes on the wire


@dataclasses.dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU


@dataclasses.dataclass(frozen=True, slots=True)
class Cleared:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Unknown:
    """A well-formed event of a type the router does not know (a newer engine's); ignored."""

    tag: str


@dataclasses.dataclass(frozen=True, slots=True)
class Malformed:
    reason: str


Event = Stored | Removed | Cleared | Unknown | Malformed


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    ts: float | None
    events: list[Event]
    data_parallel_rank: int | None = None


class _Bad(Exception):
    pass


_decoder = msgspec.msgpack.Decoder()

# Field order of the positional layout, after the tag.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")


def decode_payload(payload: bytes) -> Batch | Malformed:
    """One payload frame, in either encoding."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        return Malformed(f"not msgpack: {e}")
    try:
        ts, events, rank = _batch_fields(raw)
    except _Bad as e:
        return Malformed(str(e))
    return Batch(ts, [decode_event(e) for e in events], rank)


def _batch_fields(raw: Any) -> tuple[float | None, list, int | None]:
    if isinstance(raw, list):
        if len(raw) < 2:
            raise _Bad(f"batch array has {len(raw)} element(s), expected [ts, events, ...]")
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "events" not in raw:
            raise _Bad("batch map has no 'events'")
        ts, events, rank = raw.get("ts"), raw["events"], raw.get("data_parallel_rank")
    else:
        raise _Bad(f"batch is a {type(raw).__name__}, expected an array or a map")
    if not isinstance(events, list):
        raise _Bad("batch events is not an array")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int | float)):
        raise _Bad("batch ts is not a number")
    if rank is not None and not _is_int(rank):
        raise _Bad("batch data_parallel_rank is not an integer")
    return (None if ts is None else float(ts)), events, rank


def decode_event(raw: Any) -> Event:
    """One event, already msgpack-decoded to lists/dicts."""
    try:
        if isinstance(raw, list):
            if not raw or not isinstance(raw[0], str):
                raise _Bad("event array does not start with its type")
            tag, fields = raw[0], raw[1:]
            named = None
        elif isinstance(raw, dict):
            tag, fields, named = raw.get("type"), (), raw
            if not isinstance(tag, str):
                raise _Bad("event map has no string 'type'")
        else:
            raise _Bad(f"event is a {type(raw).__name__}, expected an array or a map")
        if tag == "BlockStored":
            f = _fields(tag, fields, named, _STORED_FIELDS, required=4)
            return _stored(f)
        if tag == "BlockRemoved":
            f = _fields(tag, fields, named, _REMOVED_FIELDS, required=1)
            return Removed(_hashes(f["block_hashes"]), _medium(f))
        if tag == "AllBlocksCleared":
            return Cleared()
        return Unknown(tag)
    except _Bad as e:
        return Malformed(str(e))


def _fields(tag: str, positional: list, named: dict | None, names: tuple[str, ...], required: int) -> dict:
    if named is None:
        if len(positional) < required:
            raise _Bad(f"{tag} has {len(positional)} field(s), expected at least {required}")
        return dict(zip(names, positional, strict=False))
    missing = [n for n in names[:required] if n not in named and n != "parent_block_hash"]
    if missing:
        raise _Bad(f"{tag} lacks {', '.join(missing)}")
    return {n: named[n] for n in names if n in named}


def _stored(f: dict) -> Stored:
    hashes = _hashes(f["block_hashes"])
    parent = f.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise _Bad("BlockStored parent_block_hash is neither an integer nor bytes")
    tokens, block_size = f["token_ids"], f["block_size"]
    if not _is_int(block_size) or block_size <= 0:
        raise _Bad(f"BlockStored block_size = {block_size!r}")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise _Bad("BlockStored token_ids is not an array of integers")
    if len(tokens) != len(hashes) * block_size:
        raise _Bad(f"BlockStored has {len(tokens)} tokens for {len(hashes)} block(s) of {block_size}")
    lora_id, lora_name = f.get("lora_id"), f.get("lora_name")
    if lora_id is not None and not _is_int(lora_id):
        raise _Bad("BlockStored lora_id is not an integer")
    if lora_name is not None and not isinstance(lora_name, str):
        raise _Bad("BlockStored lora_name is not a string")
    return Stored(hashes, parent, tokens, block_size, lora_id, _medium(f), lora_name)


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list) or not all(_is_hash(h) for h in value):
        raise _Bad("block_hashes is not an array of integers or bytes")
    return tuple(value)


def _medium(f: dict) -> str | None:
    medium = f.get("medium", MEDIUM_GPU)
    if medium is not None and not isinstance(medium, str):
        raise _Bad("medium is not a string")
    return medium


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hash(value: Any) -> bool:
    return _is_int(value) or isinstance(value, bytes)
