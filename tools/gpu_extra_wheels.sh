#!/usr/bin/env bash
# Downloads, on this CPU machine, the wheels of test dependencies a borrowed
# GPU machine lacks (it has no network; in 2026-11 it had torch,
# torchvision, CuPy, numpy, sympy, hypothesis and pytest, not onnx): by
# default onnx, onnxscript and onnxruntime with what they need beyond
# those, for tests/torch/test_onnx.py's CUDA tests, for the GPU machine's
# Python (3.12), into .whl-extra/ (ignored: echo '/.whl-*/' >> .git/info/exclude;
# 37 MB on 2026-11-28, of the 64 MiB a device run carries). Then carry
# [".whl", ".whl-extra"] and run
#   OUT=$OUT WHEEL=$(ls .whl/*.whl) EXTRA_WHEELS=.whl-extra bash tools/gpu_check.sh all
#
# Environment: PACKAGES (default "onnx onnxscript onnxruntime onnx-ir
# ml_dtypes protobuf flatbuffers packaging"), PY_VERSION (default 3.12), DEST (default
# .whl-extra).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dest="$repo/${DEST:-.whl-extra}"
rm -rf "$dest" && mkdir -p "$dest"
# --no-deps: only these (the GPU machine has numpy, sympy and
# typing_extensions with torch)
pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$dest" \
    ${PACKAGES:-onnx onnxscript onnxruntime onnx-ir ml_dtypes protobuf flatbuffers packaging}
du -sh "$dest"
ls "$dest"
