"""The ragged paged-attention kernels (kiln.models.paged_attention) against the XLA path of the same
step on random block tables and context lengths: the Pallas kernel, run in Pallas's interpret mode on
the CPU, and Kiln's CPU kernel (kiln.kernels.cpu, for tiles of a few query rows); decode tiles and
mixed prefill chunks, grouped-query heads, 16-bit pools held as bits, a softcap, a sliding window
(on every layer, or on some) and attention sinks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiln.errors import ConfigError
from kiln.kernels import cpu as cpu_kernels
from kiln.models import decoder
from kiln.models.config import ModelConfig
from kiln.models.decoder import StepInputs, table_width
from kiln.models.paged_attention import gpu_capable, kernel_for

BLOCK = 16
COMPILER = cpu_kernels.compiler() is not None


def config(**overrides) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=3,
                num_heads=6, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=4096, tie_word_embeddings=True)
    return ModelConfig(**{**base, **overrides})


def random_step(rng, cfg: ModelConfig, rows: int, query_tile: int, num_blocks: int = 96):
    """A step of `rows` rows, each with a random context (0-200 tokens before its new ones) and 1 to
    `query_tile` new tokens (a decode row or a prefill chunk), its blocks a random pick of the pool.
    Returns the queries [T, H, D] and the step's inputs, padded as the runner pads them."""
    T, NT, W = rows * query_tile + 3, rows + 1, table_width(24, BLOCK)  # a padding token and a padding tile
    free = list(rng.permutation(np.arange(1, num_blocks)))
    positions, tile_tokens = np.zeros(T, np.int32), np.full((NT, query_tile), T, np.int32)
    tile_blocks, token = np.zeros((NT, W), np.int32), 0
    for r in range(rows):
        context, new = int(rng.integers(0, 200)), int(rng.integers(1, query_tile + 1))
        blocks = [int(free.pop()) for _ in range(-(-(context + new) // BLOCK))]
        tile_blocks[r, :len(blocks)] = blocks
        for i in range(new):
            positions[token], tile_tokens[r, i] = context + i, token
            token += 1
    inputs = StepInputs(np.zeros(T, np.int32), positions, np.zeros(T, np.int32), np.zeros(T, np.int32), tile_tokens,
                        tile_blocks)
    q = jnp.asarray(rng.standard_normal((T, cfg.num_heads, cfg.head_dim)), jnp.float32)
    return q, inputs


def pools(rng, cfg: ModelConfig, num_blocks: int, dtype):
    shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, BLOCK, cfg.head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype) for _ in range(2))
    if jnp.dtype(dtype).itemsize == 2:  # held as bits, as the engine holds a 16-bit pool
        k, v = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k, v))
    return k, v


@pytest.mark.parametrize("case", [
    dict(query_tile=1),  # decode rows
    dict(query_tile=8),  # prefill chunks beside decode rows
    dict(query_tile=4, dtype=jnp.bfloat16),
    dict(query_tile=1, dtype=jnp.float16),
    dict(query_tile=2, cfg=dict(head_dim=40)),  # a head no whole number of 16-lane vectors
    dict(query_tile=4, cfg=dict(attn_logit_softcapping=20.0)),
    dict(query_tile=4, cfg=dict(sliding_window=40)),  # every layer windowed: blocks before the window unread
    dict(query_tile=4, cfg=dict(sliding_window=40), sliding=True),  # layers that differ: this one windowed
    dict(query_tile=4, cfg=dict(sliding_window=40), sliding=False),  # and this one global
    dict(query_tile=2, cfg=dict(num_kv_heads=1), sinks=True),
])
def test_the_kernels_equal_the_xla_path(case):
    kernels = ("pallas", "cpu") if COMPILER and cpu_kernels.enable() else ("pallas",)
    rng = np.random.default_rng(len(str(case)))
    cfg = config(**case.get("cfg", {}))
    dtype = case.get("dtype", jnp.float32)
    for trial in range(2):
        q, inputs = random_step(rng, cfg, rows=5, query_tile=case["query_tile"])
        k_pool, v_pool = pools(rng, cfg, 96, dtype)
        sinks = jnp.asarray(rng.standard_normal(cfg.num_heads), jnp.float32) if case.get("sinks") else None
        layer = jnp.int32(trial + 1)
        inputs = StepInputs(*(jnp.asarray(x) for x in inputs))
        sliding = None if "sliding" not in case else jnp.bool_(case["sliding"])
        attend = functools.partial(decoder._attention, q, k_pool, v_pool, layer, inputs, cfg, dtype, sliding=sliding,
                                   sinks=sinks)

        out = {kernel: np.asarray(attend(kernel=kernel)) for kernel in ("xla", *kernels)}
        real = np.asarray(inputs.tile_tokens).ravel()
        real = real[real < q.shape[0]]
        assert np.abs(out["xla"][real]).max() > 0.01  # the step attended to something
        for kernel in kernels:
            np.testing.assert_allclose(out[kernel], out["xla"], atol=2e-5, rtol=1e-4, err_msg=kernel)
        if "cpu" in kernels:  # the CPU kernel takes tiles of up to 16 query rows, XLA's path longer ones
            rows = cfg.num_heads // cfg.num_kv_heads * case["query_tile"]
            called = "kiln_paged_attention" in jax.jit(attend, static_argnames="kernel").lower(kernel="cpu").as_text()
            assert called == (rows <= cpu_kernels.ATTENTION_MAX_ROWS), rows


class Device:
    """What kernel_for reads of a JAX device."""

    def __init__(self, platform, capability=None, kind="NVIDIA H100 80GB HBM3"):
        self.platform, self.device_kind = platform, kind
        if capability is not None:
            self.compute_capability = capability


def test_the_kernel_is_chosen_by_capability_not_by_name():
    assert kernel_for("auto", Device("gpu", "9.0")) == "pallas"
    assert kernel_for("auto", Device("gpu", "8.0", kind="anything")) == "pallas"
    assert kernel_for("auto", Device("gpu", "7.5", kind="NVIDIA H100")) == "xla"  # the capability decides
    assert kernel_for("auto", Device("gpu", kind="AMD Instinct MI300X")) == "xla"  # no CUDA capability
    assert kernel_for("auto", Device("cpu")) == "xla" and not gpu_capable(Device("cpu"))
    # Kiln's CPU kernel where it is built, on a CPU only, and never against an explicit setting
    assert kernel_for("auto", Device("cpu"), cpu_kernels=True) == "cpu"
    assert kernel_for("xla", Device("cpu"), cpu_kernels=True) == "xla"
    assert kernel_for("auto", Device("gpu", "9.0"), cpu_kernels=True) == "pallas"
    assert kernel_for("cpu", Device("cpu"), cpu_kernels=True) == "cpu"
    for device, built in ((Device("cpu"), False), (Device("gpu", "9.0"), True)):
        with pytest.raises(ConfigError, match=r"engine.attention = cpu: .* Use auto or xla"):
            kernel_for("cpu", device, cpu_kernels=built)
    assert kernel_for("xla", Device("gpu", "9.0")) == "xla" and kernel_for("pallas", Device("cpu")) == "pallas"
    # and by the model's shapes, which Triton must tile (powers of two, 16 or more)
    assert kernel_for("auto", Device("gpu", "9.0"), head_dim=64, block_size=16) == "pallas"
    assert kernel_for("auto", Device("gpu", "9.0"), head_dim=80, block_size=16) == "xla"
    assert kernel_for("auto", Device("gpu", "9.0"), head_dim=64, block_size=8) == "xla"
    assert kernel_for("pallas", Device("cpu"), head_dim=80, block_size=16) == "pallas"  # interpret mode takes any
    with pytest.raises(ConfigError, match=r"engine.attention = pallas.*head_dim is 80 and engine.block_size is 16"):
        kernel_for("pallas", Device("gpu", "9.0"), head_dim=80, block_size=16)


def lowered_for_cuda(head_dim: int, block_size: int = BLOCK, kv_heads: int = 3, dtype=jnp.bfloat16,
                     softcap: float | None = None) -> str:
    """The kernel lowered for a CUDA GPU on this CPU (no GPU needed): the module's text."""
    from kiln.models.paged_attention import ragged_paged_attention

    tiles, rows, layers, blocks = 8, 12, 30, 1000
    args = [jax.ShapeDtypeStruct(shape, t) for shape, t in (
        ((kv_heads, tiles, rows, head_dim), jnp.float32), ((tiles, rows), jnp.int32), ((tiles, 33), jnp.int32),
        ((layers, kv_heads, blocks, block_size, head_dim), dtype),
        ((layers, kv_heads, blocks, block_size, head_dim), dtype), ((), jnp.int32), ((), jnp.int32))]
    step = jax.jit(lambda *a: ragged_paged_attention(*a, softcap=softcap))
    return step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_the_kernel_lowers_for_cuda_where_kernel_for_would_pick_it(head_dim):
    """JAX's default GPU lowering for Pallas (Mosaic GPU) cannot take this kernel, so it asks for
    Triton; Triton tiles only power-of-two sides, which `kernel_for` checks before it picks the kernel."""
    picked = kernel_for("auto", Device("gpu", "9.0"), head_dim=head_dim, block_size=BLOCK) == "pallas"
    assert picked == (head_dim != 96)
    if picked:
        assert "xla.gpu.triton" in lowered_for_cuda(head_dim, softcap=50.0 if head_dim == 128 else None)
    else:
        with pytest.raises(ValueError, match="power of 2"):
            lowered_for_cuda(head_dim)
