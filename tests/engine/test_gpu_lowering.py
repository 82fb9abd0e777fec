"""The engine's steps lower for a CUDA GPU, here on the CPU: every forward bucket of an engine whose
attention is the Pallas kernel (what `attention = auto` picks on a GPU of compute capability 8.0+),
and its samplers. Lowering needs no GPU: it is the step from JAX's program to XLA's, where a kernel
that a GPU backend cannot take fails (JAX's default Mosaic GPU lowering could not take the kernel).
Compiling and running on a GPU is bench/gpu.py's part."""

import pytest
from tiny_models import served_hf_dir

from kiln.engine.config import EngineConfig
from kiln.engine.core import EngineCore
from kiln.models.loader import load_model

FEW_BUCKETS = dict(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, decode_row_buckets=(1, 4),
                   prefill_token_buckets=(64,))


def lowered_for_cuda(fn, *args, **static) -> str:
    return fn.trace(*args, **static).lower(lowering_platforms=("cuda",)).as_text()


# grouped-query heads; windowed and global layers with q/k norms; attention sinks and experts
@pytest.mark.parametrize("variant", ["llama", "gemma3", "gpt-oss"])
def test_every_step_lowers_for_cuda_with_the_pallas_kernel(variant, tmp_path, kiln_cache, tiny_model):
    model = load_model(str(served_hf_dir(variant, tmp_path / variant, kiln_cache, seed=5)), show_progress=False)
    runner = EngineCore(model, EngineConfig(attention="pallas", **FEW_BUCKETS)).runner
    params, kv = runner.abstract
    for bucket in runner.buckets.forwards:
        inputs = runner.layout.padding_inputs(bucket)
        text = lowered_for_cuda(runner.step_fns[0], params, kv, *inputs[:3], runner._lora_abstract(bucket), inputs[3],
                                cfg=runner.cfg, prompt_logprobs=bucket.kind == "prefill", attention="pallas")
        assert "xla.gpu.triton" in text, bucket  # the kernel, as Triton
    for rows in runner.buckets.sampler_rows:
        lowered_for_cuda(runner.step_fns[1], *runner._sampler_args(rows), feed_rows=runner.layout.feed_rows)
