"""Decode the KV-event payloads workers publish (vLLM's ZMQ format, kiln/kv_wire.py), trusting nothing.

A payload is a msgpack batch, either positional, ``[ts, events, data_parallel_rank]``, or a map,
``{"ts": ..., "events": [...], "data_parallel_rank": ...}``. Each event is likewise either an array
led by its tag, ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``, or a
map carrying the tag under ``"type"`` (msgspec's layout for a tagged struct that is not array_like;
fields at their default may be left out). Trailing array elements and unknown map keys are ignored.
Both forms are decoded by msgspec as kiln/kv_wire.py's structs (or their map variants), leniently:
a batch's ts may be nil (or missing from a map), and a map's BlockStored may leave out
parent_block_hash.

Block hashes may be integers or bytes (newer vLLM); both are hashable and kept as they are.

Decoding never raises past :func:`decode_payload`: a batch that cannot be read is one
:class:`Malformed`, and so is each unreadable event inside a readable batch, the others kept.
This module imports nothing from the serving side of Kiln.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from kiln import kv_wire as wire
from kiln.kv_wire import BlockHash

# The events as ingest applies them: checked, whichever form they came in, block hashes in a tuple.


class Stored(wire.BlockStored):
    """A BlockStored as ingest applies it: checked, its block hashes a tuple."""

    block_hashes: tuple[BlockHash, ...]


class Removed(wire.BlockRemoved):
    block_hashes: tuple[BlockHash, ...]


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


# msgpack's first byte of a map: fixmap, map 16, map 32.
_MAP_HEADS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))


class _Decoder:
    """One value of the wire in its array or its map form, told apart by its first byte."""

    def __init__(self, array_form: Any, map_form: Any) -> None:
        self._array = msgspec.msgpack.Decoder(array_form)
        self._map = msgspec.msgpack.Decoder(map_form)

    def decode(self, raw: bytes | msgspec.Raw) -> Any:
        head = memoryview(raw)[:1]
        # (what is neither a map nor an array is refused by the array decoder)
        return (self._map if len(head) and head[0] in _MAP_HEADS else self._array).decode(raw)


# The events stay raw, to be decoded one by one (one bad event does not lose the others).
_LENIENT_BATCH = {"ts": float | None, "events": list[msgspec.Raw]}
_batch = _Decoder(
    wire.variant(wire.KVEventBatch, array_like=True, types=_LENIENT_BATCH),
    wire.variant(wire.KVEventBatch, types=_LENIENT_BATCH, defaults={"ts": None}),
)
_event = _Decoder(
    wire.KVEvent,
    wire.variant(wire.BlockStored, defaults={"parent_block_hash": None})
    | wire.variant(wire.BlockRemoved)
    | wire.variant(wire.AllBlocksCleared),
)
# An event's tag alone, to tell an unknown event from a malformed one.
_tag = _Decoder(msgspec.defstruct("Tag", [("type", str)], array_like=True), msgspec.defstruct("Tag", [("type", str)]))
_TAGS = frozenset(cls.__name__ for cls in wire.EVENTS)


def decode_payload(payload: bytes) -> Batch | Malformed:
    """One payload frame, in either encoding."""
    try:
        batch = _batch.decode(payload)
    except msgspec.DecodeError as e:  # not msgpack, or not a batch
        return Malformed(f"unreadable batch: {e}")
    return Batch(batch.ts, [_decode_event(raw) for raw in batch.events], batch.data_parallel_rank)


def _decode_event(raw: msgspec.Raw) -> Event:
    try:
        event = _event.decode(raw)
    except msgspec.DecodeError as e:
        try:
            tag = _tag.decode(raw).type
        except msgspec.DecodeError:
            return Malformed(f"unreadable event: {e}")
        return Malformed(f"{tag}: {e}") if tag in _TAGS else Unknown(tag)
    match type(event).__name__:  # (the array form's struct, or its map variant of the same name)
        case "BlockStored":
            return _stored(event)
        case "BlockRemoved":
            return Removed(tuple(event.block_hashes), event.medium)
        case _:
            return Cleared()


def _stored(e: Any) -> Stored | Malformed:
    hashes, tokens, size = tuple(e.block_hashes), e.token_ids, e.block_size
    if size <= 0:
        return Malformed(f"BlockStored block_size = {size}")
    if len(tokens) != len(hashes) * size:
        return Malformed(f"BlockStored has {len(tokens)} tokens for {len(hashes)} block(s) of {size}")
    return Stored(hashes, e.parent_block_hash, tokens, size, e.lora_id, e.medium, e.lora_name)
