"""Kiln's CPU kernel for few-row int4 products (kiln.kernels.cpu) against XLA's dequantize-then-multiply
path: the same products (both nibble layouts, float16 and float32 scales, 64-column blocks and their
16-column tails), the same gradients, and only where it is asked for and fits."""

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiln.kernels import cpu as cpu_kernels
from kiln.models import quant

pytestmark = pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
                                reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module")
def kernel():
    assert cpu_kernels.enable(), "the CPU kernel did not build or register (see the kiln.kernels log)"


def int4_weight(shape, scales, seed=0):
    w = quant.for_matmul(quant.quantize_int4(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)))
    if scales == "float32":
        w = w._replace(scale=w.scale.astype(np.float32), offset=w.offset.astype(np.float32))
    return w


@functools.partial(jax.jit, static_argnames=("int4_kernel",))
def product(x, w, int4_kernel):
    return quant.matmul(x, w, jnp.float32, int4_kernel)


@pytest.mark.parametrize("scales", ["float16", "float32"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("shape", [(64, 256), (576, 960), (256, 64), (96, 96)])  # pairs along out, then along in
def test_kernel_products_are_xla_products(kernel, shape, rows, scales):
    w = int4_weight(shape, scales)
    x = np.random.default_rng(1).standard_normal((rows, shape[0])).astype(np.float32)
    assert quant._paired_along_out(w) == (shape[1] > shape[0])
    assert "kiln_int4_matmul" in product.lower(x, w, int4_kernel=True).as_text()
    got, want = product(x, w, int4_kernel=True), product(x, w, int4_kernel=False)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_the_kernel_is_used_only_where_asked_and_for_few_rows(kernel):
    w = int4_weight((64, 256), "float16")
    for rows, asked, used in ((1, False, False), (cpu_kernels.INT4_MAX_ROWS, True, True),
                              (cpu_kernels.INT4_MAX_ROWS + 1, True, False), (32, True, False)):
        x = np.ones((rows, 64), np.float32)
        assert ("kiln_int4_matmul" in product.lower(x, w, int4_kernel=asked).as_text()) == used, (rows, asked)
    x = np.ones((1, 64), np.float32)
    mixed = w._replace(offset=w.offset.astype(np.float32))  # scales and offsets of two types: XLA's path
    assert "kiln_int4_matmul" not in product.lower(x, mixed, int4_kernel=True).as_text()
    odd = int4_weight((64, 40), "float16")  # 40 output columns: not whole 16-column blocks
    assert "kiln_int4_matmul" not in product.lower(np.ones((1, 64), np.float32), odd, int4_kernel=True).as_text()


def test_gradients_through_the_kernel_are_xla_gradients(kernel):
    """Training's products never ask for the kernel, but a gradient through one that did is XLA's."""
    w = int4_weight((64, 256), "float16")
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)

    def loss(x, int4_kernel):
        return jnp.sum(jnp.sin(quant.matmul(x, w, jnp.float32, int4_kernel)))

    got = jax.jit(jax.grad(functools.partial(loss, int4_kernel=True)))(x)
    want = jax.jit(jax.grad(functools.partial(loss, int4_kernel=False)))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-4 * float(np.abs(want).max()))


def test_a_built_kernel_is_reused_and_named_in_stored_steps_keys(kernel):
    assert cpu_kernels.enable()  # a second call does nothing more
    assert cpu_kernels.state().startswith("int4:")
    assert list(cpu_kernels._cache_dir().glob("kiln_kernels_*.so"))
