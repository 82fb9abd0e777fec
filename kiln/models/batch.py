"""Host-side assembly of StepInputs from per-row work (numpy, padded to given bucket sizes)."""

from __future__ import annotations

import dataclasses

import numpy as np

from kiln.models.decoder import StepInputs


@dataclasses.dataclass
class RowWork:
    """New tokens of one row this step: they sit at positions start .. start+len-1."""

    tokens: list[int]
    start: int
    block_table: list[int]
    adapter_slot: int = 0


def build_step_inputs(
    rows: list[RowWork],
    block_size: int,
    num_blocks: int,
    num_tokens: int | None = None,
    num_rows: int | None = None,
    max_query: int | None = None,
    max_blocks: int | None = None,
) -> StepInputs:
    """Packs rows into fixed-shape arrays; sizes default to the tight fit (pass buckets to pad)."""
    total = sum(len(r.tokens) for r in rows)
    T = num_tokens or total
    S = num_rows or len(rows)
    Q = max_query or max(len(r.tokens) for r in rows)
    M = max_blocks or max(len(r.block_table) for r in rows)
    if total > T or len(rows) > S or any(len(r.tokens) > Q or len(r.block_table) > M for r in rows):
        raise ValueError("rows do not fit the requested step shape")
    pad_slot = 0  # block 0 is never allocated: padding tokens' K/V is written there and never read
    tokens = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slots = np.full(T, pad_slot, np.int32)
    token_rows = np.zeros(T, np.int32)
    query_index = np.full((S, Q), T, np.int32)
    block_tables = np.zeros((S, M), np.int32)
    adapter_slots = np.zeros(S, np.int32)
    t = 0
    for s, row in enumerate(rows):
        n = len(row.tokens)
        pos = np.arange(row.start, row.start + n)
        table = np.asarray(row.block_table, np.int32)
        if (pos // block_size).max(initial=-1) >= len(table):
            raise ValueError(f"row {s}: block table too short for position {pos.max()}")
        tokens[t : t + n] = row.tokens
        positions[t : t + n] = pos
        slots[t : t + n] = table[pos // block_size] * block_size + pos % block_size
        token_rows[t : t + n] = s
        query_index[s, :n] = np.arange(t, t + n)
        block_tables[s, : len(table)] = table
        adapter_slots[s] = row.adapter_slot
        t += n
    return StepInputs(tokens, positions, slots, token_rows, query_index, block_tables, adapter_slots)
