"""Tensor-parallel forward on 4 forced CPU devices equals the single-device forward (dense models and
mixtures of experts, whose experts' hidden widths are split, no expert parallelism)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from server_process import FOUR_DEVICES

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    assert len(jax.devices()) == 4, jax.devices()
    from jax.sharding import PartitionSpec as P
    from tiny_models import make_hf_model, save_hf_model
    from kiln.models.batch import RowWork, build_step_inputs
    from kiln.models.decoder import forward, init_kv_cache
    from kiln.models.hf_loader import load_hf_dir
    from kiln.models.sharding import make_mesh, shard_kv, shard_params

    step = jax.jit(forward, static_argnames=("cfg", "unroll"))
    # 2 KV heads: not divisible by 4, replicated; mixtures of experts: each expert's width split
    for variant, kv_heads in (("qwen2", 4), ("llama", 2), ("qwen3-moe", 4), ("gpt-oss", 4)):
        path = save_hf_model(make_hf_model(variant, num_key_value_heads=kv_heads), {tmp!r} + "/" + variant)
        cfg, params, _ = load_hf_dir(path, np.float32, show_progress=False)
        rows = [RowWork(list(range(3, 40)), 0, [4, 1, 6]), RowWork(list(range(50, 61)), 0, [2])]
        inputs = build_step_inputs(rows, 16)
        single, _ = step(jax.device_put(params, jax.devices()[0]), init_kv_cache(cfg, 8, 16), inputs, cfg)
        mesh = make_mesh()
        sharded_params = shard_params(params, cfg, mesh)
        kv = shard_kv(init_kv_cache(cfg, 8, 16), cfg, mesh)
        spec = sharded_params["layers"]["q_proj"].sharding.spec
        assert spec == P(None, None, "tp"), spec
        if kv_heads == 4:
            assert kv.k.sharding.spec == P(None, "tp", None, None, None), kv.k.sharding.spec
        if cfg.num_experts:
            spec = sharded_params["layers"]["experts_down"].sharding.spec
            assert spec == P(None, None, "tp", None), spec
        out, new_kv = step(sharded_params, kv, inputs, cfg)
        assert len(out.sharding.device_set) == 4
        np.testing.assert_allclose(np.asarray(out), np.asarray(single), atol=1e-5, rtol=0)
        print(variant, "max diff", float(np.abs(np.asarray(out) - np.asarray(single)).max()))
    print("OK")
    """
)


def test_forward_on_four_cpu_devices_matches_one(tmp_path):
    env = {**os.environ, "XLA_FLAGS": FOUR_DEVICES, "JAX_PLATFORMS": "cpu"}
    code = SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]), tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
