"""The engine's steps lower for a CUDA GPU, here on the CPU: every forward bucket of an engine whose
attention is the Pallas kernel (what `attention = auto` picks on a GPU of compute capability 8.0+),
and its samplers. Lowering needs no GPU: it is the step from JAX's program to XLA's, where a kernel
that a GPU backend cannot take fails (JAX's default Mosaic GPU lowering could not take the kernel).
Compiling and running on a GPU is bench/gpu.py's part."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from server_process import FOUR_DEVICES
from tiny_models import served_hf_dir

from kiln.engine.config import EngineConfig
from kiln.engine.core import EngineCore
from kiln.models.loader import load_model

FEW_BUCKETS = dict(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, decode_row_buckets=(1, 4),
                   prefill_token_buckets=(64,))


def assert_steps_lower_for_cuda(runner) -> None:
    """Every forward bucket and sampler of `runner`, lowered as it compiles them but for CUDA; each
    forward step carries the kernel as Triton."""
    for bucket in runner.buckets.forwards:
        text = runner.lowered(*runner.forward_program(bucket), platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text, bucket
        if runner.mesh is not None:
            assert "sdy.manual_computation" in text, bucket  # the kernel in its shard_map
    for rows in runner.buckets.sampler_rows:
        runner.lowered(*runner.sampler_program(rows), platforms=("cuda",))


# grouped-query heads; windowed and global layers with q/k norms; attention sinks and experts
@pytest.mark.parametrize("variant", ["llama", "gemma3", "gpt-oss"])
def test_every_step_lowers_for_cuda_with_the_pallas_kernel(variant, tmp_path, kiln_cache, tiny_model):
    model = load_model(str(served_hf_dir(variant, tmp_path / variant, kiln_cache, seed=5)), show_progress=False)
    assert_steps_lower_for_cuda(EngineCore(model, EngineConfig(attention="pallas", **FEW_BUCKETS)).runner)


MESH_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{tests!r}, {tests!r} + "/engine"]
    from test_gpu_lowering import FEW_BUCKETS, assert_steps_lower_for_cuda
    from tiny_models import make_hf_model, write_gguf
    from kiln.engine.config import EngineConfig
    from kiln.engine.core import EngineCore
    from kiln.models.loader import load_model

    # 4 KV heads: each device runs the kernel on its own; 2: on every head, replicated
    for kv_heads in (4, 2):
        hf = make_hf_model("llama", vocab_size=260, num_key_value_heads=kv_heads)
        model = load_model(write_gguf(hf, {tmp!r} + f"/kv{{kv_heads}}.gguf"), show_progress=False)
        runner = EngineCore(model, EngineConfig(attention="pallas", tensor_parallel=4, **FEW_BUCKETS)).runner
        assert runner.mesh is not None
        assert_steps_lower_for_cuda(runner)
    print("OK")
    """
)


def test_steps_with_the_kernel_lower_for_cuda_over_a_tensor_parallel_mesh(tmp_path):
    env = {**os.environ, "XLA_FLAGS": FOUR_DEVICES, "JAX_PLATFORMS": "cpu"}
    code = MESH_SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]), tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
