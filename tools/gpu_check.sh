#!/usr/bin/env bash
# The checks a GPU machine is for, each part one command: a borrowed GPU
# machine goes cold soon after a command ends, and one command may run
# about 10 minutes, so each part builds what it needs and logs under $OUT.
#
#   tools/gpu_check.sh tests      build, then the whole suite from outside the tree
#   tools/gpu_check.sh sanitize   build, then compute-sanitizer memcheck on the CUDA
#                                 tests and racecheck on the deterministic backend
#   tools/gpu_check.sh bench      build, then python -m mmdispatch bench (CUDA rows;
#                                 GPU_ONLY=1: only those), the BASELINE builds' GPU
#                                 rows, then torchvision's Faster/Mask R-CNN on its
#                                 kernels and on ours (tools/bench_models.py --device cuda)
#   tools/gpu_check.sh profile    build, then ncu's per-kernel summary (throughput,
#                                 warp stalls, occupancy) of the bench's roi_align, roi_pool,
#                                 deform_conv2d, msda forward+backward and nms (2,000
#                                 boxes) workloads, ours beside torchvision's; then
#                                 where a tiny CuPy call's host time goes, what the
#                                 scratch pool saves (tools/gpu_profile.py --host) and
#                                 deform_conv2d with and without cuBLAS (--products)
#   tools/gpu_check.sh all        for a short loan (15 minutes of device time, one
#                                 call of at most 10): build once, the suite, the
#                                 bench's GPU rows only (--gpu-only), the BASELINE
#                                 builds' GPU rows, the whole models (at most
#                                 90 s), the profile, then memcheck and
#                                 racecheck, each cut to what is left of BUDGET
#                                 seconds (default 540), in that order of priority
#
# Environment: OUT (logs; default ./gpu-logs), PYTHON (default python3),
# MMDISPATCH_CUDA_ARCH_LIST (default 9.0: one arch builds in about a minute),
# EXTRA_WHEELS=a folder of wheels to install first (test dependencies the
# machine lacks; tools/gpu_extra_wheels.sh writes one),
# SKIP_BUILD=1 to use the mmdispatch already installed, WHEEL=path to install
# a wheel built elsewhere instead of building (about 90 s of device time saved:
# build one for the machine's Python with MMDISPATCH_WITH_CUDA=1 and carry
# it), JOBS (pytest -n, default 12), BUDGET (seconds: part all's, 540 by
# default; a single part's only when given, so that two parts run one after
# the other fit one device command), MEMCHECK_K (pytest -k of the memcheck
# run, default cuda), BASELINE=paths of wheels of
# earlier builds, space-separated (tools/gpu_wheel.sh with REF= and DEST=):
# the bench's GPU rows run once more on each, in the same run, to time the
# changes between them (bench-baseline-<the wheel's folder>.txt, e.g.
# bench-baseline-whl-base.txt for .whl-base/); list them oldest first: each
# run is then compared row by row with the next (mmdispatch bench --compare,
# compare-to-<the later run>.txt), the last with this build's bench;
# PROFILE_BASELINE=paths of wheels: ncu's summary of the roi_align forward
# rows on each of those builds too (profile-<the wheel's folder>.txt). The
# last lines of each log are printed as each step ends; a step cut short by
# its time leaves its partial log.
#
# The logs are written under LOGS (default /tmp/gpu-check-logs) and packed
# after every step into one file, $OUT/gpu-logs.tgz: a device run brings
# back at most 8 files from $OUT (on 2026-11-27 the first 8 of 25 logs came
# back, pytest.log not among them), and a run killed at its limit still
# leaves the pack of the steps it finished.
set -uo pipefail
part=${1:?usage: tools/gpu_check.sh tests|sanitize|bench|profile|all}
case "$part" in
tests|sanitize|bench|profile|all) ;;
*) echo "unknown part: $part (tests, sanitize, bench, profile or all)" >&2; exit 2 ;;
esac
repo=$(cd "$(dirname "$0")/.." && pwd)
final=${OUT:-$PWD/gpu-logs}
out=${LOGS:-/tmp/gpu-check-logs}
py=${PYTHON:-python3}
# a device call's $OUT starts empty: its first invocation starts the logs
# afresh (a warm machine keeps /tmp), later ones add to them
[ -e "$final/gpu-logs.tgz" ] || rm -rf "$out"
mkdir -p "$out" "$final"
began=$(date +%s)
# the wheels' paths absolute: the parts run from /tmp (outside the source
# tree), where a relative BASELINE or PROFILE_BASELINE did not install
# (the H200 run of 2026-11-27: "its wheel did not install")
absolute() {
    local path out=()
    for path in $1; do
        out+=("$(cd "$(dirname "$path")" 2> /dev/null && pwd || dirname "$path")/$(basename "$path")")
    done
    echo "${out[*]}"
}
WHEEL=$(absolute "${WHEEL:-}") BASELINE=$(absolute "${BASELINE:-}")
PROFILE_BASELINE=$(absolute "${PROFILE_BASELINE:-}")
# the logs so far, as one file in $OUT (written aside, then renamed)
pack() {
    tar czf "$final/.gpu-logs.tgz" -C "$out" . 2> /dev/null &&
        mv -f "$final/.gpu-logs.tgz" "$final/gpu-logs.tgz"
}
# the GPU's clocks, power and temperature now (a slow row on a throttled
# card is not a slow kernel): appended to gpu.txt
clocks() {
    echo "# $1" >> "$out/gpu.txt"
    nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu \
        --format=csv >> "$out/gpu.txt" 2>&1
    # (its own query: drivers that renamed the field refuse the whole query)
    nvidia-smi --query-gpu=clocks_event_reasons.active --format=csv >> "$out/gpu.txt" 2>&1 ||
        nvidia-smi --query-gpu=clocks_throttle_reasons.active --format=csv >> "$out/gpu.txt" 2>&1
}
# seconds left of BUDGET, at most $1 (part all, or any part given a BUDGET);
# $1 for a single part without one
left() {
    if [ "$part" != all ] && [ -z "${BUDGET:-}" ]; then echo "$1"; return; fi
    local rest=$(( ${BUDGET:-540} - ($(date +%s) - began) ))
    [ "$rest" -lt "$1" ] && echo $(( rest > 1 ? rest : 1 )) || echo "$1"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$out/gpu.txt" 2>&1
clocks "before part $part"
pack

if [ -n "${WHEEL:-}" ]; then
    "$py" -m pip install --no-deps --force-reinstall "$WHEEL" > "$out/build.log" 2>&1 || {
        tail -20 "$out/build.log"; pack; exit 1; }
    echo "installed $WHEEL"
elif [ "${SKIP_BUILD:-0}" != 1 ]; then
    start=$(date +%s)
    (cd "$repo" && MMDISPATCH_CUDA_ARCH_LIST=${MMDISPATCH_CUDA_ARCH_LIST:-9.0} \
        "$py" -m pip install --no-build-isolation --no-deps . > "$out/build.log" 2>&1) || {
        tail -40 "$out/build.log"; pack; exit 1; }
    echo "build: $(( $(date +%s) - start )) s"
fi
# optional test dependencies the GPU machine lacks (it has no network):
# EXTRA_WHEELS=a folder of wheels (tools/gpu_extra_wheels.sh), e.g. onnx,
# onnxscript and onnxruntime for tests/torch/test_onnx.py
if [ -n "${EXTRA_WHEELS:-}" ]; then
    "$py" -m pip install --no-index --no-deps "$(absolute "$EXTRA_WHEELS")"/*.whl \
        > "$out/extra-wheels.log" 2>&1 && echo "installed the wheels of $EXTRA_WHEELS" ||
        { echo "EXTRA_WHEELS did not install (tests that need them skip):"; tail -5 "$out/extra-wheels.log"; }
fi
# outside the source tree: its mmdispatch/ has no compiled extension
cd /tmp
"$py" -c "import mmdispatch; print([d['device'] + ': ' + d['status'] for d in mmdispatch.devices()])"
# a wheel of an earlier build into /tmp/baseline (first on PYTHONPATH for
# the commands that time it), pip's output into $2; says so and fails when
# the wheel does not install
install_baseline() {
    rm -rf /tmp/baseline && "$py" -m pip install -q --no-deps --target /tmp/baseline "$1" \
        > "$2" 2>&1 || { echo "$(basename "$2" -install.log): its wheel did not install"; false; }
}
# ncu's kernel summary of the bench's rows named (gpu_profile.py), into $1,
# at most $2 seconds; the clocks left alone (--clock-control none: times
# comparable with the bench's; ncu's default locks the SM clock at its base)
ncu_rows() {
    local log=$1 limit=$2; shift 2
    timeout "$(left "$limit")" ncu --clock-control none --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section LaunchStats \
        --section MemoryWorkloadAnalysis --print-summary per-kernel \
        "$py" "$repo/tools/gpu_profile.py" "$@" > "$log" 2>&1
}

case "$part" in
tests|all)
    workers=()   # pytest-xdist is on the GPU machines, not in the test extra
    "$py" -c "import xdist" 2> /dev/null && workers=(-n "${JOBS:-12}")
    timeout "$(left 300)" "$py" -m pytest "$repo/tests" "${workers[@]}" -q -ra \
        -p no:cacheprovider --durations 15 > "$out/pytest.log" 2>&1
    echo "pytest exit $? ($(( $(date +%s) - began )) s in)"; tail -45 "$out/pytest.log"
    clocks "after the tests"; pack
    ;;&
bench|all)
    flags=(--repeat 5 --json "$out/bench.json")
    { [ "$part" = all ] || [ "${GPU_ONLY:-0}" = 1 ]; } && flags+=(--gpu-only)
    timeout "$(left 3000)" "$py" -m mmdispatch bench "${flags[@]}" > "$out/bench.txt" 2>&1
    echo "bench exit $? ($(( $(date +%s) - began )) s in)"; tail -70 "$out/bench.txt"
    clocks "after the bench"; pack
    ;;&
bench|all)
    # earlier builds' GPU rows, each compared with the next (about 20 s a
    # build on the H200 of 2026-11-27: before the models and the profile, so
    # that a run cut short still times a change against the build before it)
    runs=()
    for wheel in ${BASELINE:-}; do   # each earlier build (oldest first), first on the path
        name=baseline-$(basename "$(dirname "$wheel")" | sed 's/^\.//')
        install_baseline "$wheel" "$out/$name-install.log" || continue
        PYTHONPATH=/tmp/baseline${PYTHONPATH:+:$PYTHONPATH} timeout "$(left 120)" "$py" -m mmdispatch \
            bench --gpu-only --repeat 5 --json "$out/bench-$name.json" \
            > "$out/bench-$name.txt" 2>&1
        echo "$name bench exit $? ($(( $(date +%s) - began )) s in)"
        # row by row against the build after it (the next baseline, or this one)
        [ -s "$out/bench-$name.json" ] && runs+=("$out/bench-$name.json") \
            || runs+=("$out/bench-$name.txt")
        pack
    done
    [ -s "$out/bench.json" ] && runs+=("$out/bench.json") || runs+=("$out/bench.txt")
    for (( i = 0; i + 1 < ${#runs[@]}; i++ )); do
        to=$(basename "${runs[i+1]}"); to=${to%.*}
        "$py" -m mmdispatch bench --compare "${runs[i]}" "${runs[i+1]}" \
            > "$out/compare-to-$to.txt" 2>&1
        echo "compare $(basename "${runs[i]}") -> $(basename "${runs[i+1]}"):"
        grep -E "slower|faster|only in|Error|error" "$out/compare-to-$to.txt"
    done
    pack
    ;;&
bench|all)
    # whole torchvision detection models, its kernels vs ours behind its ops
    timeout "$(left 90)" "$py" "$repo/tools/bench_models.py" --device cuda --repeat 5 \
        > "$out/models.txt" 2>&1
    echo "models exit $? ($(( $(date +%s) - began )) s in)"; tail -4 "$out/models.txt"
    pack
    ;;&
profile|all)
    # roi_align's rows first: on the H200 of 2026-11-27 its forward took 1.29 ms
    # (sampling_ratio 2) and 6.88 ms (0) where the same kernel took 0.661 and
    # 2.21 ms on an H100 (2026-11-26), and builds with and without the
    # transposed kernels timed alike: which kernels run, and how long each
    ncu_rows "$out/profile.txt" 150 "roi_align sampling_ratio=2" "roi_align sampling_ratio=0 forward" \
        "roi_pool" "deform_conv2d" "multi_scale_deformable_attn forward+backward" "nms 2000 boxes"
    echo "profile exit $? ($(( $(date +%s) - began )) s in)"
    grep -E "Context [0-9]|Duration" "$out/profile.txt" | head -80
    pack
    # the deterministic roi_align backward (4.1x the default's time on the
    # H200 of 2026-11-27, target 2x): its kernel's stalls
    ncu_rows "$out/profile-deterministic.txt" 40 \
        "roi_align sampling_ratio=2 forward+backward, deterministic"
    echo "deterministic profile exit $?"; grep -E "Duration" "$out/profile-deterministic.txt"
    pack
    # the same roi_align rows on other builds (PROFILE_BASELINE: wheels, as BASELINE)
    for wheel in ${PROFILE_BASELINE:-}; do
        name=$(basename "$(dirname "$wheel")" | sed 's/^\.//')
        install_baseline "$wheel" "$out/profile-$name-install.log" || continue
        PYTHONPATH=/tmp/baseline${PYTHONPATH:+:$PYTHONPATH} ncu_rows "$out/profile-$name.txt" 60 \
            "roi_align sampling_ratio=2 forward" "roi_align sampling_ratio=0 forward"
        echo "profile of $name exit $? ($(( $(date +%s) - began )) s in)"; pack
    done
    timeout "$(left 60)" "$py" "$repo/tools/gpu_profile.py" --host > "$out/host.txt" 2>&1
    echo "host profile exit $?"; grep "gpu_profile:" "$out/host.txt"
    # deform_conv2d's products through cuBLAS (loaded by torch) and through our own tiles
    for cublas in default none; do
        MMDISPATCH_CUBLAS=$cublas timeout "$(left 60)" "$py" "$repo/tools/gpu_profile.py" \
            --products > "$out/products-$cublas.txt" 2>&1
        echo "products ($cublas) exit $?"; grep "gpu_profile:" "$out/products-$cublas.txt"
    done
    pack
    ;;&
sanitize|all)
    # memcheck: every CUDA test of the ops and of deferred errors (bad data
    # made harmless must never read or write out of bounds). --launch-timeout 0:
    # CUDA starts lazily, after pytest's collection, which takes longer than
    # the sanitizer's default 10 s wait for it (then it ran nothing, 2026-11-26)
    timeout "$(left 420)" compute-sanitizer --tool memcheck --launch-timeout 0 --leak-check no --error-exitcode 99 \
        "$py" -m pytest "$repo/tests/ops" "$repo/tests/test_deferred.py" -q -k "${MEMCHECK_K:-cuda}" \
        -p no:cacheprovider > "$out/memcheck.log" 2>&1
    echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$out/memcheck.log" | tail -5
    pack
    timeout "$(left 150)" compute-sanitizer --tool racecheck --launch-timeout 0 --error-exitcode 99 \
        "$py" -m pytest "$repo/tests/ops/test_roi_align.py" "$repo/tests/ops/test_roi_pool.py" \
        -q -k "cuda and deterministic" -p no:cacheprovider > "$out/racecheck.log" 2>&1
    echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed|failed" \
        "$out/racecheck.log" | tail -5
    pack
    ;;
esac
