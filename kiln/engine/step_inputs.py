"""A planned batch laid out as the compiled step's arguments, on the host: the step inputs (token
ids, positions, block tables, tiles), each row's last token index and prompt targets, the token
feed's sources, and the sampler's per-row arrays with their grammar masks.

Everything here is host-side numpy (the idle sampler extras are kept on the device once per row
count, so a step whose rows use none of them copies nothing).
"""

from __future__ import annotations

import jax
import numpy as np

from kiln.engine.buckets import StepBucket
from kiln.engine.grammar import MaskFiller
from kiln.engine.request import Request
from kiln.engine.sampling import RowSampling, adjust_capacity
from kiln.engine.step_types import Rows
from kiln.engine.steps import TokenFeed
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.config import ModelConfig
from kiln.models.decoder import StepInputs


class StepLayout:
    """The layout of one engine's steps: its model's vocabulary, block size and table width, its
    EOS ids, and how many rows a token feed holds."""

    def __init__(self, cfg: ModelConfig, block_size: int, table_columns: int, history_len: int,
                 eos_ids: tuple[int, ...], feed_rows: int):
        self.cfg = cfg
        self.block_size = block_size
        self.table_columns = table_columns
        self.history_len = history_len  # penalties see a row's whole prompt and output
        self.eos_ids = eos_ids
        self.adjust_width = adjust_capacity(len(eos_ids))
        self.feed_rows = feed_rows
        self.masks = MaskFiller()
        self._idle: dict[int, dict[str, jax.Array]] = {}  # per row count: the unused extras, on the device

    def padding_inputs(self, bucket: StepBucket) -> tuple[StepInputs, np.ndarray, np.ndarray, TokenFeed]:
        """Inputs of an all-padding batch of this bucket (what a compile sees): step inputs, last
        index, prompt targets, an empty token feed."""
        T, NT, QT = bucket.tokens, bucket.tiles, bucket.tile_size
        zeros = lambda: np.zeros(T, np.int32)  # noqa: E731
        inputs = StepInputs(zeros(), zeros(), zeros(), zeros(), np.full((NT, QT), T, np.int32),
                            np.zeros((NT, self.table_columns), np.int32))
        feed = TokenFeed(np.zeros(self.feed_rows, np.int32), np.full(T, -1, np.int32))
        return inputs, np.zeros(bucket.rows, np.int32), np.full(T, -1, np.int32), feed

    def drop_device_arrays(self) -> None:
        """Forgets the arrays kept on the device (a quarantined route's device is gone)."""
        self._idle.clear()

    def _idle_extras(self, rows: int) -> dict[str, jax.Array]:
        """The sampler's extras for rows that use none of them, kept on the device: steps without
        penalties, logit bias, banned ids or grammars pass these and copy nothing."""
        idle = self._idle.get(rows)
        if idle is None:
            V = self.cfg.vocab_size
            idle = {"adjust_ids": np.full((rows, self.adjust_width), V, np.int32),
                    "adjust_values": np.zeros((rows, self.adjust_width), np.float32),
                    "history": np.full((rows, self.history_len), V, np.int32),
                    "allowed": np.full((rows, (V + 31) // 32), -1, np.int32)}
            # device_put copies; jnp.asarray would build (and keep) a small executable per shape
            idle = self._idle[rows] = {k: jax.device_put(v) for k, v in idle.items()}
        return idle

    def sampling_arrays(self, rows: Rows, R: int) -> RowSampling:
        """The rows' sampling arrays, padded to R rows (masks come later: `masks_for`)."""
        f32 = lambda v: np.full(R, v, np.float32)  # noqa: E731
        temperature, top_p, min_p = f32(0.0), f32(1.0), f32(0.0)
        presence, frequency, repetition = f32(0.0), f32(0.0), f32(1.0)
        top_k, step, prompt_len = np.zeros(R, np.int32), np.zeros(R, np.int32), np.zeros(R, np.int32)
        seed = np.zeros((R, 2), np.uint32)
        top_logprobs, constrained = np.zeros(R, bool), np.zeros(R, bool)
        extras = dict(self._idle_extras(R))
        adjust = [(sorted((r.params.logit_bias or {}).items()), self._banned(r)) for r, _ in rows]
        if any(bias or banned for bias, banned in adjust):
            V = self.cfg.vocab_size
            ids, values = np.full((R, self.adjust_width), V, np.int32), np.zeros((R, self.adjust_width), np.float32)
            for i, (bias, banned) in enumerate(adjust):
                k = len(bias)
                if k:
                    ids[i, :k], values[i, :k] = [int(t) for t, _ in bias], [v for _, v in bias]
                ids[i, k : k + len(banned)], values[i, k : k + len(banned)] = banned, -np.inf
            extras["adjust_ids"], extras["adjust_values"] = ids, values
        if any(r.params.needs_penalties for r, _ in rows):
            history = np.full((R, self.history_len), self.cfg.vocab_size, np.int32)
            for i, (r, _) in enumerate(rows):
                if r.params.needs_penalties:
                    ids = r.all_ids[: self.history_len]
                    history[i, : len(ids)] = ids
            extras["history"] = history
        for i, (r, _) in enumerate(rows):
            p = r.params
            temperature[i], top_p[i], min_p[i] = p.temperature, p.top_p, p.min_p
            top_k[i] = p.top_k if 0 < p.top_k < self.cfg.vocab_size else 0  # k >= the vocabulary keeps all
            presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            seed[i] = (r.seed & 0xFFFFFFFF, (r.seed >> 32) & 0xFFFFFFFF)
            step[i] = r.num_output_ahead
            prompt_len[i] = len(r.prompt_ids)
            top_logprobs[i] = bool(p.logprobs)
            constrained[i] = r.matcher is not None or bool(r.forced)
        return RowSampling(temperature, top_k, top_p, min_p, presence, frequency, repetition, seed, step, top_logprobs,
                           extras["adjust_ids"], extras["adjust_values"], extras["history"], prompt_len, constrained,
                           extras["allowed"])

    def masks_for(self, rows: Rows, R: int) -> np.ndarray:
        """The rows' allowed-token bitmasks: their grammars', or only their next forced token."""
        constrained = [(r.matcher, i) for i, (r, _) in enumerate(rows) if r.matcher is not None]
        allowed = self.masks.fill(constrained, R, self.cfg.vocab_size)
        for i, (r, _) in enumerate(rows):
            if r.forced:
                allowed[i] = 0
                allowed[i, r.forced[0] // 32] = np.uint32(1 << (r.forced[0] % 32)).view(np.int32)
        return allowed

    def _banned(self, r: Request) -> list[int]:
        """Stop tokens are masked until min_tokens have been generated (not in constrained rows:
        their grammar decides when they may end)."""
        if r.num_output_ahead >= r.params.min_tokens or r.matcher is not None or r.forced:
            return []
        return sorted(set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(self.eos_ids)))

    def step_inputs(self, rows: Rows, bucket: StepBucket) -> tuple[StepInputs, np.ndarray, np.ndarray, np.ndarray]:
        """The rows laid out in the bucket: step inputs, each row's last token index, prompt targets,
        and the feed's source row of each token (-1: its id is in the inputs). A row's new tokens
        start after what it has computed or has in flight; its last one, when a dispatched step is
        still sampling it, comes from that step's feed."""
        work, source = [], np.full(bucket.tokens, -1, np.int32)
        last_index = np.zeros(bucket.rows, np.int32)
        targets = np.full(bucket.tokens, -1, np.int32)
        t = 0
        for i, (r, n) in enumerate(rows):
            start = r.num_scheduled
            tokens = r.all_ids[start : start + n]
            if len(tokens) < n:  # only ever the last token, pending in the step in flight
                source[t + n - 1] = r.feed_row
                tokens.append(0)
            work.append(RowWork(tokens, start, r.block_ids, r.adapter_slot))
            last_index[i] = t + n - 1
            if r.params.prompt_logprobs is not None:
                for j in range(n):
                    if start + j + 1 < len(r.prompt_ids):
                        targets[t + j] = r.prompt_ids[start + j + 1]
            t += n
        inputs = build_step_inputs(work, self.block_size, num_tokens=bucket.tokens, num_tiles=bucket.tiles,
                                   tile_size=bucket.tile_size, table_columns=self.table_columns)
        return inputs, last_index, targets, source
