"""The functional Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Everything here is a pure function of pytrees. Layer params are either stacked on a leading
layer axis, run under `lax.scan` (compile time flat in depth), or one dict per layer, run
unrolled (see `loader.default_layer_loop`). `decoder_layer` is the one layer both serving
(here, over the paged pool) and training (`kiln.train.forward`, dense) run.

One step takes a flat batch of T tokens that belong to rows (sequences). Each row brings
new tokens (one for decode, a chunk for prefill) whose K/V are scattered into the paged
pool; attention runs over tiles of a row's consecutive new tokens, reading the row's blocks
through its block table and masking keys by position, so prefill chunks and decode rows
share one code path and a step's shape never depends on how long its contexts are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models import quant, rope
from kiln.models.config import ModelConfig
from kiln.models.lora import layer_weights, lora_delta, slot_weights
from kiln.models.paged_attention import cpu_kernel_takes, cpu_paged_attention, ragged_paged_attention

Params = dict


class KVCache(NamedTuple):
    """Paged K/V pool: [layers, kv_heads, num_blocks, block_size, head_dim] each.

    Heads lead blocks so that one KV head's gathered blocks are contiguous rows of a batched
    matmul: attention reads them with no transpose. A 16-bit float pool is held as its uint16
    bits: XLA:CPU widens the whole operand of a 16-bit float scatter to float32 and back (every
    layer, every step), while an integer scatter updates in place. Its float type is a 16-bit
    model's own, or bfloat16 under a float32 model (`kv_float_dtype`)."""

    k: jax.Array
    v: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]


class StepInputs(NamedTuple):
    """Fixed-shape inputs of one step: T flat tokens and NT attention tiles.

    tokens, positions, slots, adapters: [T]. slots is the flat pool slot (block * block_size +
    offset) each token's K/V goes to; padding tokens use slot 0, in block 0, which the block pool
    never hands out (every index stays in bounds: IREE's scatters do not drop out-of-range
    updates). adapters: the LoRA slot of each token's row (0 = none).
    tile_tokens: [NT, QT] flat token index of each tile's queries (T for padding): a tile holds
    up to QT consecutive new tokens of one row (QT = 1 for decode steps).
    tile_blocks: [NT, W] the block table of the tile's row, zero-padded to W (`table_width`).
    Context length is data, not shape: attention reads a tile's blocks up to the step's largest
    position.
    """

    tokens: jax.Array
    positions: jax.Array
    slots: jax.Array
    adapters: jax.Array
    tile_tokens: jax.Array
    tile_blocks: jax.Array


# Attention reads keys in chunks: the first (FIRST_KEYS) always, then CHUNK_KEYS at a time up to
# the step's largest position, so a step's cost follows its longest context with no context axis
# in its shape. A short first chunk keeps the short-context decode steps free of loop overhead.
# (32 then 64 measured best of 16 to 128 for a 32-row decode step of the default model on XLA:CPU
# at 80 and 600 tokens of context.)
FIRST_KEYS = 32
CHUNK_KEYS = 64


def _chunk_blocks(keys: int, block_size: int) -> int:
    return max(1, keys // block_size)


def table_width(max_blocks: int, block_size: int) -> int:
    """Columns of `tile_blocks` for rows of up to `max_blocks` blocks: the chunks attention
    reads never run past the table's end (zero columns are block 0, masked by position)."""
    first, chunk = _chunk_blocks(FIRST_KEYS, block_size), _chunk_blocks(CHUNK_KEYS, block_size)
    return first + -(-max(0, max_blocks - first) // chunk) * chunk


def init_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32) -> KVCache:
    shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    storage = jnp.uint16 if jnp.dtype(dtype).itemsize == 2 else dtype  # zero bits are 0.0
    return KVCache(jnp.zeros(shape, storage), jnp.zeros(shape, storage))


def kv_float_dtype(kv: KVCache, params: Params):
    """The float type of the pool's values: its own, or for uint16 bits the model's 16-bit type
    (bfloat16 under a float32 model: `[engine] kv_cache_dtype`)."""
    if kv.k.dtype != jnp.uint16:
        return kv.k.dtype
    model = float_dtype(params)
    return model if jnp.dtype(model).itemsize == 2 else jnp.bfloat16


def float_dtype(params: Params):
    """The model's float type (its norms'), whatever format its matrices are held in."""
    return params["final_norm"].dtype


def layer_dtype(layer: dict):
    """The model's float type, from one layer's weights (its attention norm's)."""
    return layer["attn_norm"].dtype


def rms_norm(x: jax.Array, weight: jax.Array, cfg: ModelConfig) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    if cfg.norm_offset:  # Gemma: (1 + w), in float32, then cast
        return (x32 * (cfg.norm_offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def embed_tokens(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The float32 residual stream of these token ids (the residual stream is float32 whatever the
    weights; Gemma scales it by sqrt(hidden_size), rounded to the weights' dtype as transformers does)."""
    embed = params["embed"]
    h = quant.table_rows(embed, tokens) if quant.is_table(embed) else embed[tokens].astype(jnp.float32)
    if cfg.embed_scale is not None:
        h = h * float(np.asarray(cfg.embed_scale, float_dtype(params)))
    return h


def layer_rope(tables, layer: dict):
    """A layer's (cos, sin): `tables` is one pair, or (global, local) pairs for models whose
    layers each carry a "sliding" flag (see `rope.layer_tables`)."""
    if "sliding" not in layer:
        return tables
    (cos, sin), (local_cos, local_sin) = tables
    return jnp.where(layer["sliding"], local_cos, cos), jnp.where(layer["sliding"], local_sin, sin)


def _as_operand(x: jax.Array, w: jax.Array) -> jax.Array:
    """x cast to w's dtype; a single row against a 16-bit weight gets a zero second row, because
    XLA:CPU multiplies one 16-bit row several times slower than two."""
    if x.shape[0] == 1 and w.dtype.itemsize == 2:
        x = jnp.pad(x, ((0, 1), (0, 0)))
    return x.astype(w.dtype)


def matmul(x: jax.Array, w: jax.Array | quant.Int8Weight | quant.Int4Weight, dtype=jnp.float32,
           cpu_kernels: bool = False) -> jax.Array:
    """x @ w in w's dtype with float32 accumulation and result: activations stay float32 and a
    bfloat16 weight is read as is (XLA:CPU multiplies bfloat16 operands into float32 fast, while
    mixed or all-bfloat16 products take slow paths). A quantized weight dequantizes in the step and
    multiplies in `dtype`: the model's float type in training, serving's `quant.product_dtype`
    (`cpu_kernels`: see `quant.matmul`)."""
    if quant.is_quantized(w):
        return quant.matmul(x, w, dtype, cpu_kernels)
    return jnp.matmul(_as_operand(x, w), w, preferred_element_type=jnp.float32)[: x.shape[0]]


def projected(x, layer: dict, base: Callable, delta: Callable, names: tuple[str, ...], widths: dict) -> list:
    """x by the layer's projections `names`, each plus its LoRA delta: base(x, name) is the frozen
    product x @ layer[name], delta(x, name) the delta or None. A group the layer holds as one weight
    (`quant.FUSED`) multiplies once, its product split into the members' `widths`."""
    fused = next((f for f, members in quant.FUSED.items() if members == names and f in layer), None)
    if fused is None:
        outs = [base(x, name) for name in names]
    else:
        outs = jnp.split(base(x, fused), np.cumsum([widths[name] for name in names[:-1]]).tolist(), axis=-1)
    return [out if (d := delta(x, name)) is None else out + d for out, name in zip(outs, names, strict=True)]


def _rows(pool: jax.Array) -> jax.Array:
    """The pool as rows of one (layer, head, block, offset) slot each: [L*KH*N*B, D] (a bitcast)."""
    return pool.reshape(-1, pool.shape[-1])


def _write_kv(pool: jax.Array, layer_idx, slots: jax.Array, new: jax.Array, dtype) -> jax.Array:
    """pool[layer, head, block, offset] = new [T, KH, D], in place (as bits for a uint16 pool of
    `dtype` values). Indexes flat rows, so a traced layer index slices nothing."""
    L, KH, N, B, D = pool.shape
    new = new.astype(dtype)
    if pool.dtype == jnp.uint16:
        new = jax.lax.bitcast_convert_type(new, jnp.uint16)
    heads = jnp.arange(KH, dtype=jnp.int32)
    rows = (layer_idx * KH + heads[None, :]) * (N * B) + slots[:, None]  # [T, KH]
    return _rows(pool).at[rows.reshape(-1)].set(new.reshape(-1, D)).reshape(pool.shape)


def _gather_blocks(pool: jax.Array, layer_idx, tables: jax.Array, dtype) -> jax.Array:
    """The blocks `tables` [NT, C] of one layer, per KV head: [KH, NT, C * block_size, D]."""
    L, KH, N, B, D = pool.shape
    blocks = pool.reshape(L * KH * N, B * D)
    heads = jnp.arange(KH, dtype=jnp.int32)
    index = (layer_idx * KH + heads[:, None, None]) * N + tables[None]  # [KH, NT, C]
    out = jnp.take(blocks, index, axis=0, mode="clip").reshape(KH, tables.shape[0], tables.shape[1] * B, D)
    return jax.lax.bitcast_convert_type(out, dtype) if pool.dtype == jnp.uint16 else out


def _as_float(pool: jax.Array, dtype) -> jax.Array:
    """A uint16 pool's bits as its float type (a bitcast, no copy); a float pool as it is."""
    return jax.lax.bitcast_convert_type(pool, dtype) if pool.dtype == jnp.uint16 else pool


def _attention(q, k_pool, v_pool, layer_idx, inputs: StepInputs, cfg: ModelConfig, kv_dtype,
               dynamic_context: bool = True, sliding=None, sinks=None, kernel: str = "xla"):
    """Portable XLA paged attention over tiles. q: [T, H, D]; pools: [L, KH, N, B, D]. Returns [T, H, D].

    Each tile's queries attend to its row's blocks, read chunk by chunk with an online softmax up to
    the step's largest position (a loop whose trip count is data): one gather of the chunk's blocks
    per chunk, batched matmuls over (KV head, tile), keys masked by position. Without
    `dynamic_context` every chunk of the table is read (a program with no data-dependent loop).
    `sliding`: the layer's flag where layers differ (the window applies where it is set). `sinks`
    [H]: each head's logit that joins the softmax's normalizer without a value (gpt-oss). `kernel`
    "pallas": the same online softmax in kiln.models.paged_attention's kernel, each tile reading only
    its own row's blocks (within its window, on a windowed layer); "cpu": the same in Kiln's CPU kernel
    for tiles of a few query rows (a decode step's), XLA's path for longer ones."""
    T = q.shape[0]
    NT, QT = inputs.tile_tokens.shape
    KH, D = cfg.num_kv_heads, cfg.head_dim
    G = cfg.num_heads // KH
    B = k_pool.shape[3]
    valid = inputs.tile_tokens < T
    gather = jnp.where(valid, inputs.tile_tokens, 0)
    # queries of a (KV head, tile) pair as matrix rows (g, q); the G heads of a group share K/V (GQA)
    q_tiles = q[gather].reshape(NT, QT, KH, G, D).transpose(2, 0, 3, 1, 4).reshape(KH, NT, G * QT, D)
    q_tiles = q_tiles.astype(jnp.float32) * cfg.attention_scale
    q_pos = jnp.where(valid, inputs.positions[gather], -1)  # [NT, QT]
    q_pos = jnp.broadcast_to(q_pos[None, :, None, :], (KH, NT, G, QT)).reshape(KH, NT, G * QT, 1)
    window = cfg.sliding_window

    tables = inputs.tile_blocks
    if tables.shape[1] < table_width(tables.shape[1], B):  # chunks never read past the table
        tables = jnp.pad(tables, ((0, 0), (0, table_width(tables.shape[1], B) - tables.shape[1])))

    def chunk(start, n_blocks, carry):
        m, norm, acc = carry
        blocks = jax.lax.dynamic_slice_in_dim(tables, start, n_blocks, axis=1)
        k = _gather_blocks(k_pool, layer_idx, blocks, kv_dtype).astype(jnp.float32)
        v = _gather_blocks(v_pool, layer_idx, blocks, kv_dtype).astype(jnp.float32)
        scores = softcap(jnp.einsum("ktqd,ktcd->ktqc", q_tiles, k), cfg.attn_logit_softcapping)
        key_pos = start * B + jnp.arange(n_blocks * B, dtype=jnp.int32)
        visible = key_pos <= q_pos
        if window and sliding is None:
            visible &= key_pos > q_pos - window
        elif window:
            visible &= (key_pos > q_pos - window) | ~sliding
        scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.exp(scores - m_new[..., None])
        correction = jnp.exp(m - m_new)
        return m_new, norm * correction + p.sum(-1), acc * correction[..., None] + jnp.einsum("ktqc,ktcd->ktqd", p, v)

    first, size = _chunk_blocks(FIRST_KEYS, B), _chunk_blocks(CHUNK_KEYS, B)
    init = (jnp.full((KH, NT, G * QT), -1e30, jnp.float32), jnp.zeros((KH, NT, G * QT), jnp.float32),
            jnp.zeros((KH, NT, G * QT, D), jnp.float32))
    kernel = "xla" if kernel == "cpu" and not cpu_kernel_takes(G * QT, B) else kernel  # (longer tiles: XLA's)
    if kernel != "xla":
        layer_window = 0 if not window else window if sliding is None else jnp.where(sliding, window, 0)
        kernel_args = (q_tiles, q_pos.reshape(KH, NT, G * QT)[0], tables, _as_float(k_pool, kv_dtype),
                       _as_float(v_pool, kv_dtype), layer_idx, layer_window)
    if kernel == "cpu":
        carry = cpu_paged_attention(*kernel_args, softcap=cfg.attn_logit_softcapping)
    elif kernel == "pallas":
        def attend(interpret: bool):
            return functools.partial(ragged_paged_attention, softcap=cfg.attn_logit_softcapping, interpret=interpret)

        # compiled for the GPU the step is lowered for, interpreted on any other platform
        carry = jax.lax.platform_dependent(*kernel_args, cuda=attend(False), rocm=attend(False), default=attend(True))
    else:
        carry = chunk(0, first, init)
        if not dynamic_context:  # every chunk of the table, each masked by position
            for start in range(first, tables.shape[1], size):
                carry = chunk(start, size, carry)
        elif tables.shape[1] > first:  # longer rows possible: the rest in chunks, as many as the step needs
            last = jnp.max(q_pos)  # the step's largest query position
            more = jnp.maximum(last + 1 - first * B + size * B - 1, 0) // (size * B)
            carry = jax.lax.fori_loop(0, more, lambda j, c: chunk(first + j * size, size, c), carry)
    m, norm, acc = carry
    if sinks is not None:  # the sink as one more key with a zero value, folded in last
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(KH, 1, G, 1), (KH, NT, G, QT)).reshape(m.shape)
        m_new = jnp.maximum(m, sink)
        correction = jnp.exp(m - m_new)
        norm, acc = norm * correction + jnp.exp(sink - m_new), acc * correction[..., None]
    out = acc / jnp.maximum(norm, 1e-30)[..., None]  # padding queries saw nothing: zeros
    out = out.reshape(KH, NT, G, QT, D).transpose(1, 3, 0, 2, 4).reshape(NT * QT, KH * G, D)
    # padding queries land in an extra row T, cut off after: every scatter index stays in bounds
    scatter = jnp.where(valid, inputs.tile_tokens, T).reshape(-1)
    return jnp.zeros((T + 1, KH * G, D), q.dtype).at[scatter].set(out.astype(q.dtype))[:T]


def decoder_layer(h: jax.Array, layer: dict, base: Callable, delta: Callable, tables, attend: Callable,
                  cfg: ModelConfig, experts: Callable | None = None):
    """One pre-norm transformer layer over the float32 residual stream h [T, hidden].

    base(x, name) multiplies by the layer's projection `name` (or a fused group's, see `projected`),
    delta(x, name) is its LoRA delta (None without one); `tables` its RoPE tables
    (see `layer_rope`); attend(q, k, v, sliding), given roped q [T, H, D] and k, v [T, KH, D] and
    the layer's sliding flag (None where layers do not differ), returns (attention output
    [T, H, D], aux). Serving attends through the paged KV pool (aux: the updated pool), training
    attends densely. `experts(x, layer, cfg)` runs a mixture's MLP (default `experts_mlp`; training
    wraps it to observe the router). Returns (h, aux)."""
    T = h.shape[0]
    H, KH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def proj(x, *names):
        return projected(x, layer, base, delta, names, cfg.projection_widths)

    with jax.named_scope("qkv"):
        x = rms_norm(h, layer["attn_norm"], cfg)
        q, k, v = proj(x, "q_proj", "k_proj", "v_proj")
        if cfg.attention_bias:
            q, k, v = q + layer["q_bias"], k + layer["k_bias"], v + layer["v_bias"]
        q, k, v = q.reshape(T, H, D), k.reshape(T, KH, D), v.reshape(T, KH, D)
        if cfg.qk_norm:
            q = rms_norm(q, layer["q_norm"], cfg)
            k = rms_norm(k, layer["k_norm"], cfg)
        cos, sin = layer_rope(tables, layer)
        q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
    attn, aux = attend(q, k, v, layer.get("sliding"))
    with jax.named_scope("o_proj"):
        (out,) = proj(attn.astype(h.dtype).reshape(T, H * D), "o_proj")
        if cfg.o_bias:
            out = out + layer["o_bias"]
        h = h + (rms_norm(out, layer["post_attn_norm"], cfg) if cfg.sandwich_norms else out)
    with jax.named_scope("mlp"):
        x = rms_norm(h, layer["mlp_norm"], cfg)
        if cfg.num_experts:
            out = (experts or experts_mlp)(x, layer, cfg)
        else:
            gate, up = proj(x, "gate_proj", "up_proj")
            (out,) = proj(_activation(gate, cfg) * up, "down_proj")
        h = h + (rms_norm(out, layer["post_mlp_norm"], cfg) if cfg.sandwich_norms else out)
    return h, aux


def _activation(gate: jax.Array, cfg: ModelConfig) -> jax.Array:
    return jax.nn.gelu(gate, approximate=True) if cfg.hidden_act == "gelu_tanh" else jax.nn.silu(gate)


def router_logits(x: jax.Array, layer: dict, cfg: ModelConfig) -> jax.Array:
    """The router's logits [T, experts] for x [T, hidden]."""
    out = matmul(x, layer["router"])
    return out + layer["router_bias"] if cfg.router_bias else out


def router_top_k(x: jax.Array, layer: dict, cfg: ModelConfig):
    """The router's softmax over all experts [T, E] for x [T, hidden], and each token's top k of it
    (probabilities [T, k], experts [T, k])."""
    probs = jax.nn.softmax(router_logits(x, layer, cfg), axis=-1)
    return probs, *jax.lax.top_k(probs, cfg.experts_per_token)


def route(x: jax.Array, layer: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k experts by the router's softmax over x [T, hidden] and their weights
    (renormalized to sum to 1 where the config says; that is a softmax over the top k logits):
    (weights [T, k], experts [T, k]). Every token gets its k experts: no capacity, nothing dropped."""
    _, weights, chosen = router_top_k(x, layer, cfg)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, chosen


def experts_mlp(x: jax.Array, layer: dict, cfg: ModelConfig, loops: bool = False, lora: dict | None = None,
                token_weight: jax.Array | None = None) -> jax.Array:
    """A mixture of experts over x [T, hidden]: each token's top-k experts by the router's softmax
    (renormalized where the config says), run as grouped matmuls over the T*k (token, expert)
    pairs sorted by expert (each expert multiplies only its own tokens), and summed back per token
    with their routing weights; plus a shared expert where the model has one.

    The grouped matmul is `lax.ragged_dot`, which XLA:CPU runs as every expert over every pair. With
    `loops` (serving on the CPU; not differentiable) fewer pairs than experts multiply by their own
    experts' weights, gathered, and more run as `looped_grouped_matmul`.

    `lora`: the layer's adapter slots (see `lora.py`), of which the experts' modules apply here,
    each pair weighed by its token's `token_weight` [T, G]: the G slots fold into the rank, so an
    expert's LoRA is two more grouped matmuls (x @ A [E, in, G*r], masked to the token's slot, @ B)."""
    T, K, E = x.shape[0], cfg.experts_per_token, cfg.num_experts
    weights, chosen = route(x, layer, cfg)
    order = jnp.argsort(chosen.reshape(-1), stable=True)  # the pairs grouped by expert
    token = order // K
    sizes = jnp.bincount(chosen.reshape(-1), length=E).astype(jnp.int32)
    per_pair = loops and T * K < E
    expert = chosen.reshape(-1)[order] if cfg.expert_bias or per_pair else None  # each pair's expert

    def grouped(a, w):
        if per_pair:
            return jnp.einsum("pi,pio->po", a.astype(w.dtype), w[expert], preferred_element_type=jnp.float32)
        if loops:
            return looped_grouped_matmul(a.astype(w.dtype), w, sizes)
        return jax.lax.ragged_dot(a.astype(w.dtype), w, sizes, preferred_element_type=jnp.float32)

    def adapted(a, module):
        """The pairs' LoRA delta of an experts' module, or None where no slot adapts it."""
        if lora is None or module not in lora:
            return None
        w = lora[module]  # a [G, E, in, r], b [G, E, r, out]
        G, _, fan_in, r = w["a"].shape
        a_folded = jnp.moveaxis(w["a"], 0, 2).reshape(E, fan_in, G * r)
        b_folded = jnp.moveaxis(w["b"], 0, 1).reshape(E, G * r, w["b"].shape[-1])
        xa = grouped(a, a_folded) * jnp.repeat(token_weight[token].astype(jnp.float32), r, axis=1)
        return grouped(xa, b_folded)

    def biased(out, name):
        return out + layer[name + "_bias"][expert] if cfg.expert_bias else out

    xs = x[token]
    delta = adapted(xs, "experts_gate_up")  # gate's width, then up's
    width = layer["experts_gate"].shape[-1]

    def projected(name, part):
        out = grouped(xs, layer[name])
        return biased(out if delta is None else out + delta[:, part], name)

    gate = projected("experts_gate", slice(None, width))
    if cfg.hidden_act == "gpt_oss":  # clamped, and (up + 1) times the gate's swish with a slope
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(projected("experts_up", slice(width, None)), -cfg.swiglu_limit, cfg.swiglu_limit)
        hidden = (up + 1) * gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha)
    else:
        hidden = _activation(gate, cfg) * projected("experts_up", slice(width, None))
    down = grouped(hidden, layer["experts_down"])
    delta = adapted(hidden, "experts_down")
    if delta is not None:
        down = down + delta
    y = biased(down, "experts_down") * weights.reshape(-1)[order][:, None]
    out = jnp.zeros((T, x.shape[1]), jnp.float32).at[token].add(y)
    if cfg.shared_expert_intermediate_size:  # every token's shared expert, gated by a sigmoid of its own
        shared = matmul(_activation(matmul(x, layer["shared_gate"]), cfg) * matmul(x, layer["shared_up"]),
                        layer["shared_down"])
        out = out + jax.nn.sigmoid(matmul(x, layer["shared_expert_gate"])) * shared
    return out


def looped_grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, tile: int = 8) -> jax.Array:
    """x [P, in] (rows grouped by expert, `sizes` [E] rows each) @ w [E, in, out] -> float32 [P, out]:
    a loop over the experts and, inside, over tiles of `tile` rows of each one's group, as many as
    its rows need (3-8x faster than ragged_dot on XLA:CPU, from 2 to 4,096 rows; loops, so not
    differentiable)."""
    P = x.shape[0]
    padded = jnp.pad(x, ((0, tile), (0, 0)))
    starts = jnp.cumsum(sizes) - sizes

    def expert(e, out):
        we = jax.lax.dynamic_index_in_dim(w, e, keepdims=False)

        def one_tile(j, out):
            at = starts[e] + j * tile
            y = jnp.matmul(jax.lax.dynamic_slice_in_dim(padded, at, tile), we, preferred_element_type=jnp.float32)
            mine = (j * tile + jnp.arange(tile) < sizes[e])[:, None]  # the tile's rows past the group: kept
            return jax.lax.dynamic_update_slice_in_dim(
                out, jnp.where(mine, y, jax.lax.dynamic_slice_in_dim(out, at, tile)), at, 0)

        return jax.lax.fori_loop(0, (sizes[e] + tile - 1) // tile, one_tile, out)

    return jax.lax.fori_loop(0, w.shape[0], expert, jnp.zeros((P + tile, w.shape[-1]), jnp.float32))[:P]


def forward_hidden(
    params: Params,
    kv: KVCache,
    inputs: StepInputs,
    cfg: ModelConfig,
    lora: dict | None = None,
    unroll: int | bool = 1,
    dynamic_context: bool = True,
    attention: str = "xla",
    cpu_kernels: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Runs the decoder; returns final-normed hidden states [T, hidden] and the updated cache.

    `lora`: a slot state ({"scale": [n], "layers": ...}, see `lora.py`); every token applies its
    row's slot (inputs.adapters), all n slots in one matmul each. `dynamic_context`, `attention` (its
    kernel): see `_attention`. `cpu_kernels`: quantized products run in Kiln's CPU kernels
    (registered: kiln.kernels.cpu)."""
    inputs = StepInputs(*(jnp.asarray(x) for x in inputs))
    kv_dtype = kv_float_dtype(kv, params)
    h = embed_tokens(params, inputs.tokens, cfg)
    tables = rope.layer_tables(cfg, inputs.positions)
    token_weight = None if lora is None else slot_weights(lora, inputs.adapters, h.dtype)
    # a mixture's experts: loops over them on the CPU, where ragged_dot runs every expert on every pair
    loops = jax.default_backend() == "cpu"

    def layer_fn(carry, xs):
        h, k_all, v_all, idx = carry
        layer, lora_layer = xs
        layer = {**layer, **{name: quant.LayerOf(w, idx) for name, w in held.items()}}

        def paged_attention(q, k, v, sliding):
            with jax.named_scope("kv_write"):
                k_pool = _write_kv(k_all, idx, inputs.slots, k, kv_dtype)
                v_pool = _write_kv(v_all, idx, inputs.slots, v, kv_dtype)
            with jax.named_scope("attention"):
                return _attention(q, k_pool, v_pool, idx, inputs, cfg, kv_dtype, dynamic_context,
                                  sliding, layer.get("sinks"), attention), (k_pool, v_pool)

        def base(x, name):
            return matmul(x, layer[name], quant.product_dtype(x.shape[0], layer_dtype(layer)), cpu_kernels)

        def delta(x, name):  # the adapter slots' (see `lora.lora_delta`)
            return None if lora_layer is None or name not in lora_layer else lora_delta(x, lora_layer[name],
                                                                                         token_weight)

        experts = functools.partial(experts_mlp, loops=loops, lora=lora_layer, token_weight=token_weight)
        h, (k_all, v_all) = decoder_layer(h, layer, base, delta, tables, paged_attention, cfg, experts)
        return (h, k_all, v_all, idx + 1), None

    layers = params["layers"]
    # stacked int4 weights a kernel multiplies stay out of the scan's slicing: it reads each layer in place
    held = {} if isinstance(layers, (list, tuple)) or not cpu_kernels else {
        name: w for name, w in layers.items() if isinstance(w, quant.Int4Weight) and w.packed.ndim == 3}
    if held:
        layers = {name: w for name, w in layers.items() if name not in held}
    if isinstance(layers, (list, tuple)):  # one array per layer: unrolled, no per-layer weight slicing
        carry = (h, kv.k, kv.v, 0)
        for i, layer in enumerate(layers):
            lora_layer = None if lora is None else layer_weights(lora["layers"], i)
            carry, _ = layer_fn(carry, (layer, lora_layer))
        h, k_all, v_all, _ = carry
    else:
        lora_layers = None if lora is None else lora["layers"]
        (h, k_all, v_all, _), _ = jax.lax.scan(layer_fn, (h, kv.k, kv.v, jnp.int32(0)), (layers, lora_layers),
                                               unroll=unroll)
    return rms_norm(h, params["final_norm"], cfg), KVCache(k_all, v_all)


def logits(params: Params, hidden: jax.Array, cfg: ModelConfig, training: bool = False,
           cpu_kernels: bool = False) -> jax.Array:
    """Vocabulary logits in float32 for hidden states [T, hidden] (soft-capped where configured). A
    quantized head multiplies in serving's `quant.product_dtype`, or in `training` the model's type
    (`cpu_kernels`: see `quant.table_logits`)."""
    head = params.get("lm_head")
    table = params["embed"] if head is None else head
    if quant.is_table(table):  # rows padded to whole chunks of its loop
        dtype = float_dtype(params) if training else quant.product_dtype(hidden.shape[0], float_dtype(params))
        return softcap(quant.table_logits(hidden, table, dtype, cpu_kernels)[:, : cfg.vocab_size],
                       cfg.final_logit_softcapping)
    if head is not None:
        return softcap(matmul(hidden, head), cfg.final_logit_softcapping)
    embed = params["embed"]
    out = jnp.einsum("th,vh->tv", _as_operand(hidden, embed), embed, preferred_element_type=jnp.float32)
    return softcap(out[: hidden.shape[0]], cfg.final_logit_softcapping)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap): Gemma 2's soft bound on attention scores and logits (x itself without a cap)."""
    return x if not cap else cap * jnp.tanh(x / cap)


def forward(params, kv, inputs, cfg, lora=None, unroll=1):
    """Logits for every token [T, vocab] and the updated cache (tests, prompt logprobs)."""
    hidden, kv = forward_hidden(params, kv, inputs, cfg, lora, unroll)
    return logits(params, hidden, cfg), kv
