"""The bounded set of compiled steps: which executables exist, and which one runs a batch.

A step's compiled shape depends on one padded size per kind of step, nothing else:

* decode (every row brings one new token): R rows, R in `decode_row_buckets`;
* prefill (prompt chunks, optionally with decode rows): T flattened tokens, T in
  `prefill_token_buckets`, in attention tiles of up to PREFILL_TILE consecutive tokens of one
  row, with room for 2T / PREFILL_TILE tiles (rows that end mid-tile waste the rest of it);

each with and without LoRA work, plus one sampler per row count the forward steps produce.
Context length, sampling parameters, penalties, logit bias, grammar masks, logprob counts and
which adapters a batch uses are data (see `decoder.StepInputs`, `sampling.RowSampling`), so the
whole set is known from the settings alone and is built before the server reports ready.
"""

from __future__ import annotations

import dataclasses
import math

PREFILL_TILE = 32


@dataclasses.dataclass(frozen=True, order=True)
class StepBucket:
    """One compiled forward step: T tokens in NT tiles of QT queries, logits for R rows."""

    kind: str  # "decode" | "prefill"
    tokens: int
    tiles: int
    tile_size: int
    rows: int
    lora: bool = False

    @property
    def max_rows(self) -> int:
        """Rows a batch in this bucket may have: each needs a sampled row and at least one tile."""
        return min(self.rows, self.tiles)

    def tiles_for(self, counts: list[int]) -> int:
        return sum(math.ceil(n / self.tile_size) for n in counts)

    def fits(self, counts: list[int]) -> bool:
        """Whether rows with these new-token counts fit."""
        if self.kind == "decode" and any(n != 1 for n in counts):
            return False
        return len(counts) <= self.max_rows and sum(counts) <= self.tokens and self.tiles_for(counts) <= self.tiles

    def describe(self) -> str:
        size = f"rows={self.rows}" if self.kind == "decode" else (
            f"tokens={self.tokens} tiles={self.tiles}x{self.tile_size} rows={self.rows}")
        return f"{self.kind} {size}" + (" lora" if self.lora else "")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _at_least(n: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= n), buckets[-1])


class BucketSet:
    """The step buckets of one engine configuration, smallest first, and the sampler row counts."""

    def __init__(self, row_buckets: tuple[int, ...], token_buckets: tuple[int, ...], max_num_seqs: int,
                 max_num_batched_tokens: int):
        # sizes past the limits never run; the limits themselves are the largest buckets
        self.row_buckets = tuple(sorted({b for b in row_buckets if b < max_num_seqs} | {max_num_seqs}))
        self.token_buckets = tuple(sorted({b for b in token_buckets if b < max_num_batched_tokens}
                                          | {max_num_batched_tokens}))
        decode = [StepBucket("decode", r, r, 1, r) for r in self.row_buckets]
        prefill = []
        for t in self.token_buckets:
            size = min(PREFILL_TILE, t)
            tiles = max(2, 2 * t // size)
            prefill.append(StepBucket("prefill", t, tiles, size, _at_least(min(tiles, max_num_seqs), self.row_buckets)))
        self.base = decode + prefill
        self.forwards = self.base + [dataclasses.replace(b, lora=True) for b in self.base]
        self.sampler_rows = tuple(sorted({b.rows for b in self.base}))

    def __len__(self) -> int:
        return len(self.forwards) + len(self.sampler_rows)

    def candidates(self, counts: list[int], decode: bool, lora: bool) -> list[StepBucket]:
        """The buckets a batch may run in, cheapest first: decode steps for one new token per row
        (`decode`), else prefill steps."""
        kind = "decode" if decode else "prefill"
        return [b for b in self.forwards if b.kind == kind and b.lora == lora and b.fits(counts)]
