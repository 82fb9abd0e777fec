"""bench/gpu.py, the GPU benchmark, in its dry run: the same code paths as on a GPU at tiny sizes (a
random 2-layer model of the default model's shape), printing its one table; and its refusal to run
without a dependency it needs."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_prints_every_row_of_the_table(kiln_cache):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KILN_")}, "KILN_CACHE_DIR": str(kiln_cache),
           "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]]
             for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    for rows in (1, 4):
        assert float(table[f"decode, {rows} rows (tok/s)"][0]) > 0
        assert table[f"bytes read per step, {rows} rows (MB; GB/s)"][1].startswith("stream ")
        unhidden, host = table[f"host time not hidden / host work per step, {rows} rows (ms)"][0].split(" / ")
        assert float(unhidden) >= 0 and float(host) > 0
    assert table["decode bare step, 4 rows, Pallas attention (tok/s)"][1].startswith("XLA attention ")
    assert float(table["prefill, 2 x 40 tokens (tok/s)"][0]) > 0
    assert table["prefill matmul TFLOP/s"][2].endswith("x")
    assert table["decode, 4 rows, 4 adapters (tok/s)"][1].startswith("no adapter ")
    sft, grpo = table["SFT, batch 2 x 128 (tok/s)"], table["GRPO step, 2 x 2 x 4 tokens (s)"]
    assert sft[1].startswith("TRL ") and sft[2].endswith("x")  # TRL ran, on the same (random) weights
    assert grpo[1].startswith("TRL ") and grpo[2].endswith("x faster")
    assert "dry run at tiny sizes" in proc.stdout and "2 layers, bfloat16" in proc.stdout


def test_a_missing_dependency_stops_it_by_name(tmp_path):
    blocked = tmp_path / "trl"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('trl is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert "missing: trl (trl is not installed here)" in proc.stderr and "installs nothing" in proc.stderr
