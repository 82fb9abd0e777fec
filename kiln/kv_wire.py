"""KV-cache events in vLLM's wire format (``vllm/distributed/kv_events.py``): the one definition that
the engine's publisher (kiln/engine/kv_events.py) encodes and the router's ingest
(kiln/router/kv_wire.py) decodes. It imports msgspec only, so the router can use it without JAX.

Transport (ZMQ): one multipart message per batch, ``(topic, seq, payload)``; ``seq`` is an 8-byte
big-endian signed int counting batches from 0; ``payload`` is a msgpack :class:`KVEventBatch`.

Events use the positional (``array_like``) layout by default, e.g.
``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name]``, inside
``[ts, events, data_parallel_rank]``. The map form (:func:`as_map_form`) carries the same structs as
msgpack maps, as msgspec encodes a tagged struct that is not array_like:
``{"type": "BlockStored", "block_hashes": [...], ...}`` (fields at their default left out) inside
``{"ts": ..., "events": [...], "data_parallel_rank": ...}``.

Block hashes are integers (Kiln, older vLLM) or bytes (newer vLLM).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"

BlockHash = int | bytes


# Struct options as in vLLM; array_like structs always encode every field (omit_defaults has
# no effect on them), so the layout is fixed.
class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event union; the tag (first array element) is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared)


# ``[ts, events, data_parallel_rank]``; a None rank is still encoded (as nil).
class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def variant(
    cls: type[msgspec.Struct],
    *,
    array_like: bool = False,
    types: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> type[msgspec.Struct]:
    """``cls`` encoded as a msgpack map (or, with ``array_like``, an array): the same fields in the same
    order, tagged alike, with some fields' types or defaults replaced. A variant with replaced defaults
    is keyword-only (a default may then precede a required field); such variants are for decoding."""
    types, defaults = types or {}, defaults or {}
    fields = []
    for f in msgspec.structs.fields(cls):
        kind, default = types.get(f.name, f.type), defaults.get(f.name, f.default)
        fields.append((f.name, kind) if default is msgspec.NODEFAULT else (f.name, kind, default))
    return msgspec.defstruct(
        cls.__name__,
        fields,
        array_like=array_like,
        omit_defaults=True,
        gc=False,
        tag=True if issubclass(cls, KVCacheEvent) else None,
        kw_only=bool(defaults),
    )


_MAP_EVENTS = {cls: variant(cls) for cls in EVENTS}
_MapEvent = _MAP_EVENTS[BlockStored] | _MAP_EVENTS[BlockRemoved] | _MAP_EVENTS[AllBlocksCleared]
_MapBatch = variant(KVEventBatch, types={"events": list[_MapEvent]})


def as_map_form(batch: KVEventBatch) -> msgspec.Struct:
    """``batch`` as its map-encoded twin (what a publisher with ``encoding="map"`` sends)."""
    events = [_MAP_EVENTS[type(e)](*msgspec.structs.astuple(e)) for e in batch.events]
    return _MapBatch(batch.ts, events, batch.data_parallel_rank)


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload frame strictly (positional layout; extra trailing fields are ignored).
    The router's ingest decodes leniently instead: kiln/router/kv_wire.py."""
    return _decoder.decode(payload)
