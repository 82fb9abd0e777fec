"""A training step as a sequence of short accelerator slices, so that a serving step never waits
behind more than one of them (`[train] max_slice_ms`).

A step that fits in one slice runs fused, as one executable. A longer one runs as:
1. forward slices over groups of layers; each keeps its group's input and the products of its
   frozen projections (x @ W, the step's dominant FLOPs);
2. head slices over chunks of the trained positions: final norm, LM head and the run's loss, and
   the loss's gradient with respect to the last layer's output;
3. backward slices over the same groups in reverse; each re-runs its group's cheap parts (norms,
   attention, LoRA) around the saved products, which it replays without multiplying again
   (`_replay`), and back-propagates into the group's LoRA gradients and its input. With remat
   (a job short of memory) nothing but the groups' inputs is kept, and they multiply again.

The optimizer update is one more slice, taken by the run: the adapter changes all at once.
Gradients equal the fused step's within float tolerance (the same functions, summed in another
order). Layer groups, rather than smaller micro-batches, because one sequence of a real model
is already longer than a slice on a CPU; they also keep the batch, so the loss is unchanged.

The slice sizes come from measured costs (seconds per token and layer of forward and backward
slices, per trained position of head slices); until a run has measured them it takes the
smallest slices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.config import ModelConfig
from kiln.models.decoder import layer_dtype, matmul, rms_norm
from kiln.train.forward import embed, layer_context, train_layer

log = logging.getLogger("kiln.train")

SMOOTHING = 0.3  # weight of a new measurement in a cost's moving average
FIRST_CHUNK = 16  # trained positions per head slice before the head's cost is known
# HeadLoss(params, hidden [k, hidden] final-normed at k trained positions, the batch's fields
# cut to those positions, norm) -> (loss, aux): sums over the positions, so chunks add up
HeadLoss = Callable[..., tuple[jax.Array, dict]]
NOT_PER_POSITION = ("tokens", "valid")  # batch fields over rows; every other field is per trained position


class StepAbandoned(Exception):
    """The driver asked the run to stop between two slices: nothing of the step was applied."""


class Turns:
    """How a run holds the accelerator: every write it makes (a slice of a step, the optimizer
    update, a logprob pass) takes its turn with serving under the engine's ownership (see
    `Ownership.training_slice`), and `stop()`, asked before each one, abandons the step in
    progress (StepAbandoned). Without an ownership (a run alone in its process) writes hold
    nothing, and steps run fused."""

    def __init__(self, ownership=None, share: float = 0.5, stop: Callable[[], bool] = lambda: False):
        self.ownership, self.share, self._stop = ownership, share, stop
        self.stopped = False

    def stop(self) -> bool:
        """Whether the driver asked to stop (asked once: a stop stays a stop)."""
        self.stopped = self.stopped or bool(self._stop())
        return self.stopped

    @property
    def shared(self) -> bool:
        return self.ownership is not None

    def write(self, what: str):
        if self.stop():
            raise StepAbandoned(what)
        return self.ownership.training_slice(what, self.share) if self.shared else contextlib.nullcontext()

    @classmethod
    def of(cls, ownership, **kwargs) -> Turns:
        """`ownership` as Turns: Turns, an engine's Ownership, or None."""
        return ownership if isinstance(ownership, Turns) else cls(ownership, **kwargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _replay(x, w, saved, dtype):
    """x @ w as `saved` (computed by the forward slice), with x @ w's gradient for x (the product
    in `dtype`, as the forward slice multiplied)."""
    return saved


def _replay_fwd(x, w, saved, dtype):
    return saved, (x, w)


def _replay_bwd(dtype, residuals, dy):
    x, w = residuals
    dx = jax.vjp(lambda x: matmul(x, w, dtype), x)[1](dy)[0]
    return dx, jax.tree.map(jnp.zeros_like, w), jnp.zeros_like(dy)


_replay.defvjp(_replay_fwd, _replay_bwd)


@dataclasses.dataclass(frozen=True)
class SlicePlan:
    group: int  # layers per forward/backward slice
    chunk: int  # trained positions per head slice

    def describe(self) -> str:
        return f"{self.group} layer(s) per slice, {self.chunk} trained positions per head slice"


class SliceCosts:
    """Moving averages of seconds per unit of work: token x layer for "forward" and "backward"
    slices, trained position for "head" slices, and token x layer for a whole "fused" step."""

    def __init__(self):
        self.rate: dict[str, float] = {}

    def record(self, kind: str, units: int, seconds: float) -> None:
        new = seconds / max(units, 1)
        old = self.rate.get(kind)
        self.rate[kind] = new if old is None else old + SMOOTHING * (new - old)

    def plan(self, tokens: int, positions: int, layers: int, max_slice_s: float) -> SlicePlan | None:
        """None: the whole step fits in one slice. Otherwise the largest layer group (a divisor of
        `layers`) and head chunk (a power of two) expected to fit."""
        fwd, bwd, head = (self.rate.get(k) for k in ("forward", "backward", "head"))
        if fwd is None or bwd is None or head is None:
            return SlicePlan(1, min(FIRST_CHUNK, positions))
        fused = self.rate.get("fused", fwd + bwd) * tokens * layers + head * positions
        if fused <= max_slice_s:
            return None
        per_layer = max(fwd, bwd) * tokens
        group = max([d for d in range(1, layers + 1) if layers % d == 0 and d * per_layer <= max_slice_s],
                    default=1)
        chunk = 1
        while chunk * 2 <= positions and chunk * 2 * head <= max_slice_s:
            chunk *= 2
        return SlicePlan(group, chunk)

    def smallest_ms(self, tokens: int) -> float | None:
        """The shortest slice this batch can take (one layer, forward or backward), once measured."""
        rates = [self.rate[k] for k in ("forward", "backward") if k in self.rate]
        return max(rates) * tokens * 1e3 if len(rates) == 2 else None


def _cut(batch, start: int, size: int):
    """The batch with its per-position fields cut to positions [start, start + size)."""
    return batch._replace(**{f: getattr(batch, f)[start:start + size] for f in batch._fields
                             if f not in NOT_PER_POSITION})


def _padded(batch, multiple: int):
    """The batch with its per-position fields zero-padded to a multiple of `multiple` (position 0,
    weight 0: a padding position adds nothing to the loss or its gradient)."""
    K = len(batch.loss_index)
    extra = -K % multiple
    if not extra:
        return batch
    return batch._replace(**{f: np.pad(np.asarray(getattr(batch, f)), (0, extra)) for f in batch._fields
                             if f not in NOT_PER_POSITION})


class SlicedStep:
    """Gradients of `head_loss` over the decoder with respect to the LoRA params, computed fused or
    in slices (see the module docstring). One per run: it holds the jitted slice functions and
    the measured costs."""

    def __init__(self, cfg: ModelConfig, scale: float, head_loss: HeadLoss, max_slice_ms: float,
                 remat: bool = False):
        self.cfg, self.scale, self.head_loss = cfg, scale, head_loss
        self.remat = remat  # keep only each group's input; backward slices multiply again (a job short of memory)
        self.max_slice_s = max_slice_ms / 1e3
        self.costs = SliceCosts()
        self.slices = 0  # slices run (fused steps excluded)
        self._warned = False
        self._executables: dict[tuple, Any] = {}  # compiled ahead of the slices, outside ownership

    def plan(self, batch) -> SlicePlan | None:
        B, S = batch.tokens.shape
        plan = self.costs.plan(B * S, len(batch.loss_index), self.cfg.num_layers, self.max_slice_s)
        smallest = self.costs.smallest_ms(B * S)
        if plan is not None and smallest is not None and smallest > self.max_slice_s * 1e3 and not self._warned:
            self._warned = True
            log.warning("[train] max_slice_ms = %g is below the shortest slice this run can take: one layer of "
                        "a %dx%d batch, about %.0f ms; its slices take that long", self.max_slice_s * 1e3, B, S,
                        smallest)
        return plan

    def layer_too_long(self, batch) -> bool:
        """Whether one layer of this batch, forward or backward, is measured to take longer than a slice."""
        smallest = self.costs.smallest_ms(batch.tokens.size)
        return smallest is not None and smallest > self.max_slice_s * 1e3

    def record_fused(self, batch, seconds: float) -> None:
        B, S = batch.tokens.shape
        self.costs.record("fused", B * S * self.cfg.num_layers, seconds)

    # the slice functions (jitted in __init__)

    @staticmethod
    def _layers(tree, start, group: int):
        """Layers [start, start + group) of a stacked tree (LoRA params always are); a list of layers
        is the group's already (see `grads`)."""
        if isinstance(tree, (list, tuple)):
            return list(tree)
        return jax.tree.map(lambda w: jax.lax.dynamic_slice_in_dim(w, start, group), tree)

    def _run_group(self, layers, lora_g, h, ctx, body):
        """body(h, (layer, lora layer, index in the group)) -> (h, ys) over the group's layers."""
        if isinstance(layers, list):
            outs = []
            for i, layer in enumerate(layers):
                h, ys = body(h, (layer, jax.tree.map(lambda w, i=i: w[i], lora_g), i))
                outs.append(ys)
            return h, jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
        return jax.lax.scan(body, h, (layers, lora_g, jnp.arange(len(jax.tree.leaves(lora_g)[0]))))

    def _forward_group(self, params, layers, lora, h, tokens, valid, start, *, group: int, first: bool):
        """The group's output and its frozen products {name: [group, T, out]}."""
        ctx = layer_context(valid, self.cfg, self.scale)
        h = embed(params, tokens, self.cfg) if first else h

        def body(h, xs):
            saved = {}

            def base(x, w, name):
                out = matmul(x, w, layer_dtype(xs[0]))
                if not self.remat:
                    saved[name] = out
                return out

            return train_layer(h, xs[0], xs[1], ctx, self.cfg, base), saved

        return self._run_group(self._layers(layers, start, group), self._layers(lora, start, group), h, ctx, body)

    def _backward_group(self, params, layers, lora, h, tokens, valid, saved, dh, grads, start, *, group: int,
                        first: bool):
        """The gradient for the group's input, and `grads` with the group's LoRA gradients set."""
        ctx = layer_context(valid, self.cfg, self.scale)
        layers = self._layers(layers, start, group)

        def body(h, xs):
            layer, lora_layer, i = xs
            replay = None if self.remat else lambda x, w, name: _replay(x, w, saved[name][i], layer_dtype(layer))  # noqa: E731
            return train_layer(h, layer, lora_layer, ctx, self.cfg, replay), None

        def f(h, lora_g):
            return self._run_group(layers, lora_g, embed(params, tokens, self.cfg) if first else h, ctx, body)[0]

        dh_in, dlora = jax.vjp(f, h, self._layers(lora, start, group))[1](dh)
        return dh_in, jax.tree.map(lambda g, d: jax.lax.dynamic_update_slice_in_dim(g, d, start, 0), grads, dlora)

    def _head_chunk(self, params, h, chunk, norm, dh):
        """The loss terms of a chunk of trained positions, and `dh` plus their gradient for h."""
        index = chunk.loss_index

        def f(x):
            return self.head_loss(params, rms_norm(x, params["final_norm"], self.cfg), chunk, norm)

        (loss, aux), dx = jax.value_and_grad(f, has_aux=True)(h[index])
        return loss, aux, dh.at[index].add(dx)

    def _executable(self, kind: str, fn, args: tuple, group: int, first: bool, shape: tuple):
        """The compiled slice function `kind` for these shapes (one for every group: the start is
        an argument), compiled now if new: before the slices, so that no slice waits for a compiler."""
        key = (kind, group, first, shape)
        if key not in self._executables:
            donate = {"forward": (), "backward": (8,)}[kind]
            jitted = jax.jit(fn, static_argnames=("group", "first"), donate_argnums=donate)
            self._executables[key] = jitted.lower(*args, jnp.int32(0), group=group, first=first).compile()
        return self._executables[key]

    def prepare(self, params, lora, batch, plan: SlicePlan):
        """Compiles what `grads` runs for this batch and plan, if new (touching no device state: a
        run does it outside ownership, so that no slice waits for a compiler). Returns the
        executables and the batch's per-position chunks."""
        G = plan.group
        B, S = batch.tokens.shape
        tokens, valid = jax.device_put((batch.tokens, batch.valid))
        padded = _padded(batch, plan.chunk)
        chunks = [jax.device_put(_cut(padded, at, plan.chunk))
                  for at in range(0, len(padded.loss_index), plan.chunk)]
        top = {k: v for k, v in params.items() if k != "layers"}
        first_layers = params["layers"] if isinstance(params["layers"], dict) else params["layers"][:G]
        shape = (B, S)
        h_shape = jax.ShapeDtypeStruct((B * S, self.cfg.hidden_size), jnp.float32)
        exe = {}
        for first in (True, False)[:min(self.cfg.num_layers // G, 2)]:
            h_in = None if first else h_shape
            exe["forward", first] = self._executable("forward", self._forward_group,
                                                     (top, first_layers, lora, h_in, tokens, valid), G, first, shape)
            if ("backward", G, first, shape) not in self._executables:
                saved_shape = jax.eval_shape(functools.partial(self._forward_group, group=G, first=first),
                                             top, first_layers, lora, h_in, tokens, valid, 0)[1]
                grads_shape = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), lora)
                self._executable("backward", self._backward_group, (
                    top, first_layers, lora, h_in, tokens, valid, saved_shape, h_shape, grads_shape), G, first, shape)
            exe["backward", first] = self._executables["backward", G, first, shape]
        key = ("head", shape, plan.chunk)
        if key not in self._executables:
            self._executables[key] = jax.jit(self._head_chunk, donate_argnums=(4,)).lower(
                top, h_shape, chunks[0], jnp.float32(1.0), h_shape).compile()
        exe["head"] = self._executables[key]
        return exe, chunks

    def grads(self, params, lora, batch, norm, plan: SlicePlan, slice_: Callable[[str], Any]):
        """The LoRA gradients, loss and aux sums of `batch`, computed in slices; `slice_(what)` holds
        one slice (a context manager that may raise StepAbandoned before it starts). Compiling
        (`prepare`) happens before the first slice."""
        exe, chunks = self.prepare(params, lora, batch, plan)
        L, G = self.cfg.num_layers, plan.group
        B, S = batch.tokens.shape
        tokens, valid = jax.device_put((batch.tokens, batch.valid))
        starts = list(range(0, L, G))
        top = {k: v for k, v in params.items() if k != "layers"}
        stacked = isinstance(params["layers"], dict)
        layers = {start: params["layers"] if stacked else params["layers"][start:start + G] for start in starts}
        head = exe["head"]
        inputs, saved, h = [], [], None
        for start in starts:
            with self._timed(slice_, "forward", B * S * G, f"forward layers {start}-{start + G}"):
                inputs.append(h)
                h, products = exe["forward", start == 0](top, layers[start], lora, h, tokens, valid, jnp.int32(start))
                saved.append(products)
                jax.block_until_ready(h)
        loss, aux, dh = 0.0, None, None
        for at, chunk in zip(range(0, len(chunks) * plan.chunk, plan.chunk), chunks, strict=True):
            with self._timed(slice_, "head", plan.chunk, f"head positions {at}-{at + plan.chunk}"):
                dh = jnp.zeros_like(h) if dh is None else dh
                part, part_aux, dh = head(top, h, chunk, jnp.float32(norm), dh)
                jax.block_until_ready(dh)
            loss = loss + part
            aux = part_aux if aux is None else jax.tree.map(jnp.add, aux, part_aux)
        grads = None
        for start, h_in, products in reversed(list(zip(starts, inputs, saved, strict=True))):
            with self._timed(slice_, "backward", B * S * G, f"backward layers {start}-{start + G}"):
                grads = jax.tree.map(jnp.zeros_like, lora) if grads is None else grads
                dh, grads = exe["backward", start == 0](top, layers[start], lora, h_in, tokens, valid, products, dh,
                                                        grads, jnp.int32(start))
                jax.block_until_ready(grads)
        return grads, loss, aux

    @contextlib.contextmanager
    def _timed(self, slice_, kind: str, units: int, what: str) -> Iterator[None]:
        with slice_(what):
            started = time.perf_counter()
            yield
            self.costs.record(kind, units, time.perf_counter() - started)
        self.slices += 1
