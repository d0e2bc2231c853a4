#!/usr/bin/env bash
# Builds, on this CPU machine, the wheel a borrowed GPU machine installs
# instead of building there (tools/gpu_check.sh's WHEEL=; about 90 s of its
# device time saved): CUDA kernels for one architecture, for the GPU
# machine's Python (3.12 there in 2026-11), from a clean clone of HEAD so
# that the in-tree build/ of another Python is left alone. Writes .whl/ in
# the repository (ignore it: echo /.whl/ >> .git/info/exclude), which a
# device run carries: carry [".whl"], then
#   OUT=$OUT WHEEL=$(ls .whl/*.whl) bash tools/gpu_check.sh all
#
# Environment: PYTHON (an interpreter of the GPU machine's minor version;
# default pyenv's 3.12 where it exists, else python3.12),
# MMDISPATCH_CUDA_ARCH_LIST (default 9.0: the H100 and H200), REF (a commit
# to build instead of HEAD) and DEST (the folder written, default .whl):
# REF=<commit> DEST=.whl-base builds the baseline that gpu_check.sh's
# BASELINE= benches beside HEAD in the same run; MMDISPATCH_NVCC_DEFINES
# (setup.py) with DEST builds a variant of one code path, e.g.
# MMDISPATCH_NVCC_DEFINES=MMD_CUDA_VECTOR_ATOMICS=0 DEST=.whl-novec.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$(ls -d /root/.pyenv/versions/3.12.*/bin/python 2>/dev/null | tail -1)}
py=${py:-python3.12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m venv "$work/venv"
"$work/venv/bin/pip" install -q setuptools Cython 'numpy>=2.0,<2.1' wheel
git clone -q "$repo" "$work/src"
[ -n "${REF:-}" ] && git -C "$work/src" checkout -q "$REF"
dest="$repo/${DEST:-.whl}"
(cd "$work/src" && MMDISPATCH_WITH_CUDA=1 \
    MMDISPATCH_CUDA_ARCH_LIST=${MMDISPATCH_CUDA_ARCH_LIST:-9.0} \
    "$work/venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/out" .)
rm -rf "$dest" && mkdir -p "$dest" && cp "$work"/out/*.whl "$dest/"
ls "$dest"
