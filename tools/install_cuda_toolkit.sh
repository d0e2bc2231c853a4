#!/usr/bin/env bash
# Installs the part of the CUDA toolkit that building mmdispatch's CUDA
# kernels needs (nvcc, cicc/ptxas, the CUDA headers, CUB, libcudart_static.a)
# from NVIDIA's PyPI wheels into one directory laid out like /usr/local/cuda.
# No GPU, no driver and no distribution repository are needed, so it works in
# any manylinux container (cibuildwheel's before-all for the CUDA flavour).
#
#   tools/install_cuda_toolkit.sh [PREFIX]   # default /usr/local/cuda
#   CUDA_HOME=PREFIX MMDISPATCH_WITH_CUDA=1 python -m build --wheel
#
# MMDISPATCH_CUDA_VERSION picks the toolkit release (default 13.0.*, what the
# project's CI builds with; nvcc 13 targets sm_75 and newer).
set -euo pipefail
prefix=${1:-/usr/local/cuda}
version=${MMDISPATCH_CUDA_VERSION:-13.0.*}
python=${PYTHON:-$(command -v python3 || command -v python)}
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT

# nvcc + its crt headers and cicc (nvvm), the runtime (headers and
# libcudart_static.a) and CCCL (CUB, used by the nms kernel), all of one
# release: --no-deps so that nothing resolves to another release.
"$python" -m pip install --quiet --no-deps --target "$staging" \
    "nvidia-cuda-nvcc==$version" "nvidia-cuda-crt==$version" "nvidia-nvvm==$version" \
    "nvidia-cuda-runtime==$version" "nvidia-cuda-cccl==$version"
mkdir -p "$prefix"
cp -a "$staging"/nvidia/cu*/. "$prefix"/
[ -e "$prefix/lib64" ] || ln -s lib "$prefix/lib64"
"$prefix/bin/nvcc" --version | tail -n 2
