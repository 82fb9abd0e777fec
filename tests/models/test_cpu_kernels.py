"""Kiln's CPU kernels for int4 products (kiln.kernels.cpu) against XLA's dequantize-then-multiply path:
the same products (both nibble layouts, float16 and float32 scales, 64-column blocks and their
16-column tails, few rows streamed and more rows in panels), the same gradients, and only where it
is asked for and fits; their portable build
against the vectorized one (the attention kernel's own checks against XLA's attention:
tests/models/test_paged_attention_kernel.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiln.kernels import cpu as kernels
from kiln.models import quant
from kiln.models.paged_attention import cpu_paged_attention

pytestmark = pytest.mark.skipif(kernels.compiler() is None,
                                reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module")
def kernel():
    assert kernels.enable(), "the CPU kernel did not build or register (see the kiln.kernels log)"


def int4_weight(shape, scales, seed=0):
    w = quant.for_matmul(quant.quantize_int4(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)))
    if scales == "float32":
        w = w._replace(scale=w.scale.astype(np.float32), offset=w.offset.astype(np.float32))
    return w


@functools.partial(jax.jit, static_argnames=("cpu_kernels",))
def product(x, w, cpu_kernels):
    return quant.matmul(x, w, jnp.float32, cpu_kernels)


@pytest.mark.parametrize("scales", ["float16", "float32"])
@pytest.mark.parametrize("rows", [1, 2, 5, 13, 32, 200])  # streamed; panels: tiles of 12 rows, chunks of 192
@pytest.mark.parametrize("shape", [(64, 256), (576, 960), (256, 64), (96, 96)])  # pairs along out, then along in
def test_kernel_products_are_xla_products(kernel, shape, rows, scales):
    w = int4_weight(shape, scales)
    x = np.random.default_rng(1).standard_normal((rows, shape[0])).astype(np.float32)
    assert quant._paired_along_out(w) == (shape[1] > shape[0])
    assert "kiln_int4_matmul" in product.lower(x, w, cpu_kernels=True).as_text()
    got, want = product(x, w, cpu_kernels=True), product(x, w, cpu_kernels=False)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_the_kernel_is_used_only_where_asked_and_fits(kernel):
    w = int4_weight((64, 256), "float16")
    panels = kernels.product_max_rows() is None  # (built with AVX-512: any rows)
    for rows, asked, used in ((1, False, False), (kernels.STREAMING_MAX_ROWS, True, True),
                              (kernels.STREAMING_MAX_ROWS + 1, True, panels), (512, True, panels)):
        x = np.ones((rows, 64), np.float32)
        assert ("kiln_int4_matmul" in product.lower(x, w, cpu_kernels=asked).as_text()) == used, (rows, asked)
    x = np.ones((1, 64), np.float32)
    mixed = w._replace(offset=w.offset.astype(np.float32))  # scales and offsets of two types: XLA's path
    assert "kiln_int4_matmul" not in product.lower(x, mixed, cpu_kernels=True).as_text()
    odd = int4_weight((64, 40), "float16")  # 40 output columns: not whole 16-column blocks
    assert "kiln_int4_matmul" not in product.lower(np.ones((1, 64), np.float32), odd, cpu_kernels=True).as_text()
    sixteens = int4_weight((64, 48), "float16")  # whole 16-column blocks, but panels take 32 columns
    assert "kiln_int4_matmul" in product.lower(np.ones((2, 64), np.float32), sixteens, cpu_kernels=True).as_text()
    assert "kiln_int4_matmul" not in product.lower(np.ones((8, 64), np.float32), sixteens, cpu_kernels=True).as_text()


def test_a_stacked_weight_is_multiplied_at_its_layer_in_place(kernel):
    """Layers under scan: the kernel reads layer i of the stack (no copy of the layer's slice), XLA's
    path slices it; both compute layer i's product."""
    layers = [int4_weight((64, 256), "float16", seed=i) for i in range(3)]
    stacked = jax.tree.map(lambda *a: np.stack(a), *layers)
    x = np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32)

    @functools.partial(jax.jit, static_argnames=("cpu_kernels",))
    def at(x, i, cpu_kernels):
        return quant.matmul(x, quant.LayerOf(stacked, i), jnp.float32, cpu_kernels)

    text = at.lower(x, jnp.int32(1), cpu_kernels=True).compile().as_text()
    assert "kiln_int4_matmul" in text and "dynamic-slice" not in text
    for i, w in enumerate(layers):
        want = product(x, w, cpu_kernels=False)
        for cpu_kernels in (True, False):
            np.testing.assert_allclose(np.asarray(at(x, jnp.int32(i), cpu_kernels)), np.asarray(want), rtol=1e-5,
                                       atol=1e-5 * float(np.abs(want).max()))


def test_gradients_through_the_kernel_are_xla_gradients(kernel):
    """Training's products never ask for the kernel, but a gradient through one that did is XLA's."""
    w = int4_weight((64, 256), "float16")
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)

    def loss(x, cpu_kernels):
        return jnp.sum(jnp.sin(quant.matmul(x, w, jnp.float32, cpu_kernels)))

    got = jax.jit(jax.grad(functools.partial(loss, cpu_kernels=True)))(x)
    want = jax.jit(jax.grad(functools.partial(loss, cpu_kernels=False)))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-4 * float(np.abs(want).max()))


def test_a_built_kernel_is_reused_and_named_in_stored_steps_keys(kernel):
    assert kernels.enable()  # a second call does nothing more
    assert kernels.state().startswith("kernels:")
    assert list(kernels._cache_dir().glob("kiln_kernels_*.so"))


def int8_table(rows, cols, scales, seed=3):
    t = quant.quantize_table(np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32))
    return t._replace(scale=t.scale.astype(np.float32)) if scales == "float32" else t


@functools.partial(jax.jit, static_argnames=("cpu_kernels",))
def head(x, t, cpu_kernels):
    return quant.table_logits(x, t, jnp.float32, cpu_kernels)


@pytest.mark.parametrize("scales", ["float16", "float32"])
@pytest.mark.parametrize("rows", [1, 4, 7, 32])  # streamed, then in panels (tiles of 6 rows)
def test_kernel_head_logits_are_xla_logits(kernel, rows, scales):
    """An int8 table as the LM head (the default model's Q8_0 embedding): every row, padding included."""
    if rows > kernels.STREAMING_MAX_ROWS and kernels.product_max_rows() is not None:
        pytest.skip("more rows than the streaming loops take need the AVX-512 build")
    t = int8_table(300, 96, scales)
    x = np.random.default_rng(4).standard_normal((rows, 96)).astype(np.float32)
    assert "kiln_int8_table_logits" in head.lower(x, t, cpu_kernels=True).as_text()
    got, want = head(x, t, cpu_kernels=True), head(x, t, cpu_kernels=False)
    assert got.shape == want.shape == (rows, t.q.shape[0])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    many = np.ones((kernels.STREAMING_MAX_ROWS + 1, 96), np.float32)  # (in panels, built with AVX-512)
    panels = kernels.product_max_rows() is None
    assert ("kiln_int8_table_logits" in head.lower(many, t, cpu_kernels=True).as_text()) == panels
    dx = jax.grad(lambda x: jnp.sum(jnp.tanh(head(x, t, cpu_kernels=True))))(x)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(jax.grad(lambda x: jnp.sum(jnp.tanh(head(x, t, False))))(x)),
                               rtol=1e-3, atol=1e-4 * float(np.abs(dx).max()))


def test_the_portable_build_computes_what_the_vectorized_one_does(kernel, tmp_path):
    """A CPU without AVX-512 runs the kernels' portable loops: built here for a plain x86-64 (or this
    machine's architecture elsewhere), registered under other names, and held against XLA's path."""
    import ctypes
    import platform

    compiler = kernels.compiler()
    arch = ("-march=x86-64-v2",) if platform.machine() in ("x86_64", "AMD64") else ()
    library = tmp_path / "kiln_kernels_portable.so"
    kernels._compile(compiler, library, arch)
    handle = ctypes.cdll.LoadLibrary(str(library))
    jax.ffi.register_ffi_target("test_portable_int4", jax.ffi.pycapsule(handle.KilnInt4Matmul), platform="cpu")
    jax.ffi.register_ffi_target("test_portable_table", jax.ffi.pycapsule(handle.KilnInt8TableLogits), platform="cpu")
    jax.ffi.register_ffi_target("test_portable_attention", jax.ffi.pycapsule(handle.KilnPagedAttention),
                                platform="cpu")
    for shape in ((64, 256), (256, 64)):
        w = int4_weight(shape, "float16")
        for rows in (1, 3, 7, 13):  # streamed, then panels
            x = np.random.default_rng(5).standard_normal((rows, shape[0])).astype(np.float32)
            got = jax.ffi.ffi_call("test_portable_int4", jax.ShapeDtypeStruct((rows, shape[1]), jnp.float32))(
                x, *(a[None] for a in w), np.zeros(1, np.int32))  # one layer of a stack
            want = product(x, w, cpu_kernels=False)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                                       atol=1e-5 * float(np.abs(want).max()))
    t = int8_table(40, 64, "float16")
    x = np.random.default_rng(6).standard_normal((2, 64)).astype(np.float32)
    got = jax.ffi.ffi_call("test_portable_table", jax.ShapeDtypeStruct((2, 40), jnp.float32))(x, t.q, t.scale)
    want = head(x, t, cpu_kernels=False)[:, :40]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))

    for dtype in (jnp.float32, jnp.bfloat16):  # decode attention: 3 query rows of a tile, a window on one pass
        rng = np.random.default_rng(7)
        k, v = (jnp.asarray(rng.standard_normal((2, 2, 20, 16, 64)), dtype) for _ in range(2))
        q = jnp.asarray(rng.standard_normal((2, 3, 3, 64)) * 0.3, jnp.float32)
        pos = jnp.asarray(np.repeat([[5], [40], [-1]], 3, axis=1), jnp.int32)
        tables = jnp.asarray(rng.permutation(np.arange(1, 20))[:12].reshape(3, 4), jnp.int32)
        for window in (0, 20):
            args = (q, pos, tables, k, v, jnp.asarray([1, window], jnp.int32))
            state = jax.ShapeDtypeStruct((2, 3, 3), jnp.float32)
            outs = (state, state, jax.ShapeDtypeStruct(q.shape, jnp.float32))
            got = jax.ffi.ffi_call("test_portable_attention", outs)(*args, softcap=np.float32(0))
            want = cpu_paged_attention(*args[:5], 1, window)
            for a, b in zip(got, want, strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
