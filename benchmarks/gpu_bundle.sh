#!/bin/bash
# Packs, here (where the package registries answer), what the GPU check needs on a
# GPU machine that reaches nothing: run it, then carry .whl, .whl-hub and .gcex there
# and run benchmarks/gpu_session.sh (see docs/host_device.md, "The GPU check").
#
#   benchmarks/gpu_bundle.sh EXAMPLES EXAMPLES_UTILS [PYTHON_VERSION]
#
# EXAMPLES: graphcore/examples (a checkout or a bare mirror); EXAMPLES_UTILS:
# graphcore/examples-utils (its v3.4 tag); PYTHON_VERSION: the GPU machine's (3.12).
#   .gcex      BERT's and ViT's applications, and examples_utils (their import)
#   .whl       the applications' own packages, as wheels for that Python: transformers
#              4.36 (their modeling code needs a 4.x), its hub and tokenizers, tfrecord
#              with protobuf 3.20 (its generated example_pb2 predates protobuf 4),
#              cppimport and mako (examples_utils' imports), attrdict3 and randaugment
#              (ViT's); wandb gets graphcore_apps.py's stand-in
#   .whl-hub   this checkout's transformers, for the model-hub subset (the GPU
#              image's may be older: 5.17's BART and Whisper draw LayerDrop's number
#              in every training forward, which a static trace refuses)
set -euo pipefail
cd "$(dirname "$0")/.."
EXAMPLES=${1:?usage: gpu_bundle.sh EXAMPLES EXAMPLES_UTILS [PYTHON_VERSION]}
UTILS=${2:?usage: gpu_bundle.sh EXAMPLES EXAMPLES_UTILS [PYTHON_VERSION]}
PYV=${3:-3.12}
PIP=".venv/bin/pip"
for d in .whl .whl-hub .gcex; do
    grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
rm -rf .whl .whl-hub .gcex && mkdir -p .whl .whl-hub .gcex
apps="nlp/bert/pytorch vision/vit/pytorch"
if [ -d "$EXAMPLES/nlp/bert/pytorch" ]; then
    for a in $apps; do mkdir -p ".gcex/$a" && cp -r "$EXAMPLES/$a/." ".gcex/$a/"; done
else
    git -C "$EXAMPLES" archive HEAD $apps | tar x -C .gcex
fi
if [ -d "$UTILS/examples_utils" ]; then cp -r "$UTILS/examples_utils" .gcex/
else git -C "$UTILS" archive v3.4 examples_utils | tar x -C .gcex; fi
$PIP download -q --no-deps -d .whl transformers==4.36.2 huggingface_hub==0.20.3 \
    attrdict3==2.0.2 randaugment==1.0.2 protobuf==3.20.3 mako
$PIP download -q --no-deps -d .whl --only-binary=:all: --python-version "$PYV" \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    tokenizers==0.15.2
$PIP wheel -q --no-deps -w .whl tfrecord==1.14.1 cppimport
rm -f .whl/*.tar.gz
hub=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
$PIP download -q --no-deps -d .whl-hub "transformers==$hub"
du -sh .whl .whl-hub .gcex
