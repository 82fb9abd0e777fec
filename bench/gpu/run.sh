#!/usr/bin/env bash
# The GPU benchmarks, on a lent GPU machine, from the repository root, with .gpu/ carried (made by
# bench/gpu/prepare.py). Each bench has a time limit so that one that runs long leaves the rest
# their turn; every log is kept under $OUT (or /tmp/kiln-gpu).
#   T_GPU (s)     bench/gpu.py                (the one-table GPU benchmark; GPU_ARGS=--skip-trl without TRL)
#   T_SERVE (s)   bench/serve_throughput.py   (1 and 32 streams against transformers on the GPU)
#   T_TRAIN (s)   bench/serve_while_training.py (4 streams: idle, an SFT job, a GRPO job)
set -u
OUT=${OUT:-/tmp/kiln-gpu}
mkdir -p "$OUT"
if [ -z "${SKIP_WHEELS:-}" ]; then  # SKIP_WHEELS=1: a dry run where Kiln is installed (e.g. its venv, on a CPU)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/wheels/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1
# Two JAX processes share the GPU (a bench and the server it starts): neither takes it all up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
# One compilation cache for every server of the run: the first start builds the step set, the rest load it.
export KILN_CACHE_COMPILATION_DIR=/tmp/kiln-jax KILN_MODEL_PATH=/tmp/kiln-model
# A KV pool of 4 GiB holds the benches' contexts many times over (auto would take 0.9 of what is free).
export KILN_ENGINE_KV_CACHE_MEMORY=${KILN_ENGINE_KV_CACHE_MEMORY:-4GiB}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)" \
  | tee -a "$OUT/gpu.txt"
python3 bench/random_model.py .gpu/model "$KILN_MODEL_PATH" ${LAYERS:+--layers $LAYERS} | tee -a "$OUT/gpu.txt" || exit 1
if [ $# -gt 0 ]; then  # other benches instead: run.sh 'timeout 100 python3 bench/model_step.py ...' ...
  for cmd in "$@"; do date +%T; bash -c "$cmd" 2>&1 | tee -a "$OUT/benches.log"; done
  exit
fi
date +%T; timeout "${T_GPU:-480}" python3 bench/gpu.py ${GPU_ARGS:-} 2>&1 \
  | grep -v "^WARNING: All log messages" | tee "$OUT/gpu.log"
date +%T; timeout "${T_SERVE:-330}" python3 bench/serve_throughput.py --skip-cold ${SERVE_ARGS:-} 2>&1 \
  | grep -v "^WARNING: All log messages" | tee "$OUT/serve_throughput.log"
date +%T; timeout "${T_TRAIN:-200}" python3 bench/serve_while_training.py --quiet 15 ${TRAIN_ARGS:-} 2>&1 \
  | tee "$OUT/serve_while_training.log"
