"""Host-side assembly of StepInputs from per-row work (numpy, padded to given sizes)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kiln.models.decoder import StepInputs, table_width


@dataclasses.dataclass
class RowWork:
    """New tokens of one row this step: they sit at positions start .. start+len-1."""

    tokens: list[int]
    start: int
    block_table: list[int]
    adapter_slot: int = 0


def tiles_needed(rows: list[RowWork] | list[int], tile_size: int) -> int:
    """Attention tiles of `tile_size` queries the rows take (rows or their new-token counts)."""
    return sum(math.ceil((n if isinstance(n, int) else len(n.tokens)) / tile_size) for n in rows)


def build_step_inputs(
    rows: list[RowWork],
    block_size: int,
    *,
    num_tokens: int | None = None,
    num_tiles: int | None = None,
    tile_size: int | None = None,
    table_columns: int | None = None,
) -> StepInputs:
    """Packs rows into fixed-shape arrays: their tokens one after another, each row's tokens in
    tiles of `tile_size`. Sizes default to the tight fit (one tile per row); pass a step
    bucket's sizes to pad."""
    total = sum(len(r.tokens) for r in rows)
    T = num_tokens or total
    QT = tile_size or max(len(r.tokens) for r in rows)
    NT = num_tiles or tiles_needed(rows, QT)
    W = table_columns or table_width(max(len(r.block_table) for r in rows), block_size)
    if total > T or tiles_needed(rows, QT) > NT or any(len(r.block_table) > W for r in rows):
        raise ValueError("rows do not fit the requested step shape")
    pad_slot = 0  # block 0 is never allocated: padding tokens' K/V is written there and never read
    tokens = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slots = np.full(T, pad_slot, np.int32)
    adapters = np.zeros(T, np.int32)
    tile_tokens = np.full((NT, QT), T, np.int32)
    tile_blocks = np.zeros((NT, W), np.int32)
    t = tile = 0
    for s, row in enumerate(rows):
        n = len(row.tokens)
        pos = np.arange(row.start, row.start + n)
        table = np.asarray(row.block_table, np.int32)
        if (pos // block_size).max(initial=-1) >= len(table):
            raise ValueError(f"row {s}: block table too short for position {pos.max()}")
        tokens[t : t + n] = row.tokens
        positions[t : t + n] = pos
        slots[t : t + n] = table[pos // block_size] * block_size + pos % block_size
        adapters[t : t + n] = row.adapter_slot
        for c in range(0, n, QT):
            k = min(QT, n - c)
            tile_tokens[tile, :k] = np.arange(t + c, t + c + k)
            tile_blocks[tile, : len(table)] = table
            tile += 1
        t += n
    return StepInputs(tokens, positions, slots, adapters, tile_tokens, tile_blocks)
