"""Ragged paged attention as a Pallas kernel, for GPUs (Triton), and as Kiln's CPU kernel for decode
tiles, with XLA's path as the fallback.

The XLA path (`decoder._attention`) reads every tile's blocks up to the step's longest context,
one gather of a chunk of blocks at a time: its cost follows the longest row, and on GPUs the
gathers do not fuse with the matmuls around them. The kernel runs one program per (KV head, tile):
it reads its own row's blocks, straight from the pool through the block table, only as far as its
own queries' positions reach (ragged), with the online softmax of the XLA path. Its inputs and
outputs have the XLA path's shapes, so the step's compiled shapes, and the bounded step set,
stay the same.

`kernel_for(setting)` chooses: "auto" takes the kernel on a CUDA GPU of compute capability 8.0
or more (Triton's bfloat16 dot needs it), by capability, never by device name, for a model whose
shapes Triton can tile (`triton_tiles`), and on a CPU where Kiln's CPU kernels are built its "cpu"
kernel (`cpu_paged_attention`: the same reads and online softmax in C++, for tiles of a few query
rows, XLA's path for longer ones); "xla" never; "pallas" always, on other backends in Pallas's
interpret mode (slow: for tests).

The kernel is written for Triton and asks for it (`compiler_params`): JAX lowers a GPU `pallas_call`
to Mosaic GPU unless told otherwise, and Mosaic stages every block a BlockSpec names in shared
memory, here a KV head's whole pool (megabytes, where an H100 has 227 KiB), so it cannot lower this
kernel at all. `tests/models/test_paged_attention_kernel.py` lowers it for CUDA on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.sharding import PartitionSpec as P

from kiln.errors import ConfigError
from kiln.kernels import cpu as kernels
from kiln.models.sharding import AXIS

MIN_ROWS = 16  # Triton's dot takes operands of at least 16 rows


def gpu_capable(device) -> bool:
    """A CUDA device whose compute capability runs the kernel (8.0 or more)."""
    try:
        return device.platform == "gpu" and float(getattr(device, "compute_capability", "0")) >= 8.0
    except ValueError:
        return False


def triton_tiles(head_dim: int, block_size: int) -> bool:
    """Whether Triton can lower the kernel for these shapes: every array it touches has power-of-two
    sides (a KV block is [block_size, head_dim]) and its dots take operands of 16 or more."""
    return all(n >= MIN_ROWS and n & (n - 1) == 0 for n in (head_dim, block_size))


def kernel_for(setting: str, device=None, head_dim: int | None = None, block_size: int | None = None,
               cpu_kernels: bool = False) -> str:
    """The attention the steps run: "pallas", "cpu" or "xla" (see the module's docstring). Given the
    model's `head_dim` and the pool's `block_size`, "auto" keeps XLA's path where Triton cannot tile them,
    and "pallas" on a GPU that cannot is a ConfigError (Pallas's interpret mode, elsewhere, takes any).
    "auto" on a CPU with Kiln's CPU kernels registered (`cpu_kernels`) is "cpu"; "cpu" without them is
    a ConfigError."""
    device = device or jax.devices()[0]
    fits = head_dim is None or triton_tiles(head_dim, block_size)
    if setting == "pallas" and not fits and device.platform == "gpu":
        raise ConfigError(f"engine.attention = pallas: the kernel's GPU lowering (Triton) needs a head size and a "
                          f"KV block size that are powers of two of at least {MIN_ROWS}; this model's head_dim is "
                          f"{head_dim} and engine.block_size is {block_size}. Use auto or xla")
    if setting == "cpu" and not (cpu_kernels and device.platform == "cpu"):
        raise ConfigError("engine.attention = cpu: Kiln's CPU kernel serves steps on the CPU, where Kiln's CPU "
                          "kernels are built (engine.cpu_kernels = auto and a C++ compiler). Use auto or xla")
    if setting in ("xla", "pallas", "cpu"):
        return setting
    if gpu_capable(device) and fits:
        return "pallas"
    return "cpu" if cpu_kernels and device.platform == "cpu" else "xla"


def _kernel(scalars_ref, tables_ref, pos_ref, q_ref, k_ref, v_ref, m_ref, norm_ref, acc_ref, *, block_size: int,
            softcap: float | None):
    q = q_ref[...]  # [R, D] float32, scaled
    pos = pos_ref[...]  # [R] query positions (-1: padding)
    layer, window = scalars_ref[0], scalars_ref[1]  # window 0: none
    rows = q.shape[0]
    # blocks holding keys 0..the tile's last query position: this tile's own context, not the step's;
    # under a window, from the block of the first key its first query sees
    n_blocks = (jnp.max(pos) + block_size) // block_size
    earliest = jnp.min(jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max)) - window + 1
    first_block = jnp.where(window > 0, jnp.maximum(earliest, 0) // block_size, 0)
    offsets = jax.lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)

    def block(j, carry):
        m, norm, acc = carry
        b = tables_ref[j]
        k = k_ref[layer, b].astype(jnp.float32)  # [B, D]
        v = v_ref[layer, b].astype(jnp.float32)
        scores = jnp.dot(q, k.T)  # [R, B]
        if softcap:
            scores = softcap * jnp.tanh(scores / softcap)
        key_pos = j * block_size + offsets
        visible = (key_pos <= pos[:, None]) & ((window == 0) | (key_pos > pos[:, None] - window))
        scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        p = jnp.exp(scores - m_new[:, None])
        correction = jnp.exp(m - m_new)
        return m_new, norm * correction + p.sum(axis=-1), acc * correction[:, None] + jnp.dot(p, v)

    init = (jnp.full((rows,), -1e30, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    m, norm, acc = jax.lax.fori_loop(first_block, n_blocks, block, init)
    m_ref[...], norm_ref[...], acc_ref[...] = m, norm, acc


@functools.partial(jax.jit, static_argnames=("softcap", "interpret"))
def ragged_paged_attention(q_tiles: jax.Array, q_pos: jax.Array, tables: jax.Array, k_pool: jax.Array,
                           v_pool: jax.Array, layer_idx, window=0, *, softcap: float | None = None,
                           interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The online softmax's state after every key of each (KV head, tile), as the XLA path keeps it.

    q_tiles: [KH, NT, R, D] float32 queries, scaled (row r of a tile: head g, query q of the group);
    q_pos: [NT, R] their positions (-1: padding); tables: [NT, W] each tile's row's blocks; pools:
    [L, KH, N, B, D] in the model's float type; layer_idx: the layer and window: its sliding window in
    tokens, 0 for none (traced scalars, so layers that differ share one kernel). Traced under a
    tensor-parallel mesh (`jax.set_mesh`, as the runner compiles), each device runs the kernel on its
    own KV heads (shard_map), or on all of them where the mesh does not divide them. Returns the
    running max and normalizer [KH, NT, R] and the unnormalized output [KH, NT, R, D]."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and AXIS in mesh.axis_names:  # a tensor-parallel step: each device runs its KV heads
        heads = P(AXIS) if q_tiles.shape[0] % mesh.shape[AXIS] == 0 else P()  # else every head everywhere
        pool = P(None, AXIS) if heads != P() else P()
        run = functools.partial(_call, softcap=softcap, interpret=interpret)
        return jax.shard_map(run, in_specs=(heads, P(), P(), pool, pool, P(), P()), out_specs=(heads, heads, heads),
                             check_vma=False)(q_tiles, q_pos, tables, k_pool, v_pool, layer_idx, window)
    return _call(q_tiles, q_pos, tables, k_pool, v_pool, layer_idx, window, softcap=softcap, interpret=interpret)


def _call(q_tiles, q_pos, tables, k_pool, v_pool, layer_idx, window, *, softcap, interpret):
    KH, NT, R, D = q_tiles.shape
    B = k_pool.shape[3]
    rows = max(MIN_ROWS, pl.next_power_of_2(R))  # Triton's blocks: powers of two, 16 rows at least
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows - R), (0, 0)))
    q_pos = jnp.pad(q_pos, ((0, 0), (0, rows - R)), constant_values=-1)
    L, W, N = k_pool.shape[0], tables.shape[1], k_pool.shape[2]
    tile = pl.BlockSpec((None, None, rows, D), lambda h, t: (h, t, 0, 0))
    state = pl.BlockSpec((None, None, rows), lambda h, t: (h, t, 0))
    head_pool = pl.BlockSpec((L, None, N, B, D), lambda h, t: (0, h, 0, 0, 0))  # read by the block table
    m, norm, acc = pl.pallas_call(
        functools.partial(_kernel, block_size=B, softcap=softcap),
        grid=(KH, NT),
        in_specs=[pl.BlockSpec((2,), lambda h, t: (0,)), pl.BlockSpec((None, W), lambda h, t: (t, 0)),
                  pl.BlockSpec((None, rows), lambda h, t: (t, 0)), tile, head_pool, head_pool],
        out_specs=[state, state, tile],
        out_shape=[jax.ShapeDtypeStruct((KH, NT, rows), jnp.float32)] * 2 +
                  [jax.ShapeDtypeStruct((KH, NT, rows, D), jnp.float32)],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(),  # Triton, not Mosaic GPU (the module's docstring)
        name="ragged_paged_attention",
    )(jnp.stack([jnp.asarray(layer_idx, jnp.int32), jnp.asarray(window, jnp.int32)]), tables.astype(jnp.int32),
      q_pos.astype(jnp.int32),
      q_tiles, k_pool, v_pool)
    return m[:, :, :R], norm[:, :, :R], acc[:, :, :R]


def cpu_kernel_takes(rows: int, block_size: int) -> bool:
    """Whether Kiln's CPU attention kernel takes tiles of `rows` query rows (a decode step's few)."""
    return rows <= kernels.ATTENTION_MAX_ROWS and block_size <= kernels.ATTENTION_MAX_BLOCK


def cpu_paged_attention(q_tiles: jax.Array, q_pos: jax.Array, tables: jax.Array, k_pool: jax.Array,
                        v_pool: jax.Array, layer_idx, window=0, *, softcap: float | None = None):
    """`ragged_paged_attention`'s state, computed by Kiln's CPU kernel (kiln.kernels.cpu): the same
    inputs (pools in their float type: float32, bfloat16 or float16) and outputs. For tiles of a few
    query rows, where XLA:CPU's path is a chain of small gathers and matmuls up to the step's longest
    context."""
    KH, NT, R, D = q_tiles.shape
    state = jax.ShapeDtypeStruct((KH, NT, R), jnp.float32)
    call = jax.ffi.ffi_call(kernels.ATTENTION_TARGET, (state, state, jax.ShapeDtypeStruct((KH, NT, R, D), jnp.float32)))
    scalars = jnp.stack([jnp.asarray(layer_idx, jnp.int32), jnp.asarray(window, jnp.int32)])
    return call(q_tiles.astype(jnp.float32), q_pos.astype(jnp.int32), tables.astype(jnp.int32), k_pool, v_pool,
                scalars, softcap=np.float32(softcap or 0.0))
