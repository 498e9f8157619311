#!/bin/bash
# The GPU check on a GPU machine that reaches no registry, from what
# benchmarks/gpu_bundle.sh packed (.whl, .whl-hub, .gcex carried beside the checkout):
# the environment, then benchmarks/gpu_check.py over all its parts, its table and
# the applications' logs written under $OUT (or ./gpu-out).
#
#   GPU_CHECK_S=540 bash benchmarks/gpu_session.sh [gpu_check.py options, e.g. --only speed]
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/hubsite .whl-hub/*.whl 2>&1 | tail -3
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/hubsite
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
nproc; python3 --version
python3 -c "import torch, numpy, transformers, timm; print('torch', torch.__version__, 'numpy', numpy.__version__, 'transformers', transformers.__version__, 'timm', timm.__version__)"
python3 -c "import triton; print('triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/appsite .whl/*.whl 2>&1 | tail -3
cp -r .gcex/examples_utils /tmp/appsite/
timeout "${GPU_CHECK_S:-540}" python3 benchmarks/gpu_check.py --examples .gcex \
    --app-deps /tmp/appsite --log-dir "$OUT/apps" --workers 6 --json "$OUT/gpu_check.json" \
    "$@" 2>&1 | tee "$OUT/gpu_check.log"
