"""One call of each chosen GPU workload of the bench, ours then
torchvision's, for a kernel profiler to time kernel by kernel, e.g.

    ncu --section SpeedOfLight --print-summary per-kernel \
        python tools/gpu_profile.py "roi_pool" "deform_conv2d forward ("

shows each kernel's duration and its memory and compute throughput beside
torchvision's kernels for the same work. Arguments keep the bench rows
whose names contain one of them (all of roi_align, roi_pool, nms,
deform_conv2d's and multi_scale_deformable_attn's rows without); a name
with "deterministic" in it keeps the rows run on the deterministic CUDA
backend, as the bench names them ("roi_align sampling_ratio=2
forward+backward, deterministic backend"). Needs
CuPy, a GPU, and torch with torchvision for their side.

    python tools/gpu_profile.py --host

instead breaks the host cost of the bench's tiny CuPy ops.roi_align call
down: the call beside the entry point with preallocated outputs, a
cupy.empty, and the array's __cuda_array_interface__, each the bench's
median per call (host time: kernels are queued, not waited for), then
cProfile's top functions over many calls; the same for a tiny torch
CUDA call, plain and with autograd recorded, beside torchvision's. Then
what keeping scratch across synchronisations saves: the bench's nms and deform_conv2d
workloads (each synchronised) as they run, beside the same followed by
mmdispatch.empty_cache("cuda"), which returns the scratch to the driver
as CUDA's default pool did at every synchronisation before mmdispatch
had its own pool (the cost of empty_cache itself after a synchronisation
is printed too, to subtract).

    python tools/gpu_profile.py --products

times the bench's deform_conv2d workloads, ours beside torchvision's, and
says whether the process has loaded cuBLAS for our products: run it once as it
is and once with MMDISPATCH_CUBLAS=none to compare cuBLAS's products with
our own tiles on one machine."""
import cProfile
import pstats
import sys

import cupy

from mmdispatch import bench


def host():
    import numpy as np

    from mmdispatch import _core, ops
    x = cupy.zeros((1, 1, 4, 4), cupy.float32)
    rois = cupy.asarray(np.array([[0, 0, 0, 3, 3]], np.float32))
    out = cupy.empty((1, 1, 1, 1), cupy.float32)
    empty = cupy.empty((0,), cupy.float32)
    parts = {
        "ops.roi_align (tiny)": lambda: ops.roi_align(x, rois, 1, 1.0, 2),
        "roi_align_forward_impl, outputs given": lambda: _core.roi_align_forward_impl(
            x, rois, out, empty, empty, 1, 1, 1.0, 2, 1, True),
        "cupy.empty((1, 1, 1, 1))": lambda: cupy.empty((1, 1, 1, 1), cupy.float32),
        "x.__cuda_array_interface__": lambda: x.__cuda_array_interface__,
        "cupy.cuda.get_current_stream()": cupy.cuda.get_current_stream,
    }
    breakdown(parts, lambda: ops.roi_align(x, rois, 1, 1.0, 2))


def breakdown(parts, call, sync=None):
    """Each of `parts`' median per call (the bench's, over batches of 20000),
    then cProfile's top functions over 20000 calls of `call` (between two
    sync() where given)."""
    for name, fn in parts.items():
        print(f"gpu_profile: {name}: {bench.median_call(fn, 5, 20000) * 1e6:.2f} us",
              flush=True)
    if sync is not None:
        sync()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20000):
        call()
    profile.disable()
    if sync is not None:
        sync()
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)


def torch_host():
    """Where a tiny torch CUDA roi_align call's host time goes, plain and
    with autograd recorded (on the H200 of 2026-11-27: 22.7 and 43.8 us,
    torchvision's 23.2 and 25.7 us; on the CPU machine the autograd part
    cost 8.5 us then, 5.5 us since the autograd code is generated per op,
    2026-11-28): the pieces beside the whole, then cProfile's top
    functions of the autograd call."""
    try:
        import torch
        import torchvision
    except ImportError as exc:
        print(f"gpu_profile: torch host parts skipped: {exc}", flush=True)
        return
    import mmdispatch.torch as mt
    from mmdispatch.torch._library import DERIVED
    x = torch.zeros((1, 1, 4, 4), device="cuda")
    grad_x = x.clone().requires_grad_(True)
    rois = torch.tensor([[0, 0, 0, 3, 3]], dtype=torch.float32, device="cuda")
    op = DERIVED["roi_align_forward_impl"]
    args = (grad_x, rois, 1, 1, 1.0, 2, 1, True)
    parts = {
        "mt.roi_align (tiny, torch cuda)": lambda: mt.roi_align(x, rois, 1, 1.0, 2, True),
        "mt.roi_align, autograd recorded": lambda: mt.roi_align(grad_x, rois, 1, 1.0, 2, True),
        "torchvision roi_align (tiny)": lambda: torchvision.ops.roi_align(x, rois, 1, 1.0, 2,
                                                                          True),
        "torchvision roi_align, autograd recorded": lambda: torchvision.ops.roi_align(
            grad_x, rois, 1, 1.0, 2, True),
        "op.run(eager=True) (the implementation alone)": lambda: op.run(*args, eager=True),
        "Gradient.apply (the implementation with autograd)": lambda: op.gradient.apply(*args),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch.empty((1, 1, 1, 1), device='cuda')": lambda: torch.empty((1, 1, 1, 1),
                                                                        device="cuda"),
    }
    breakdown(parts, lambda: mt.roi_align(grad_x, rois, 1, 1.0, 2, True), torch.cuda.synchronize)


def sync():
    cupy.cuda.Device().synchronize()


def cases(*workloads):
    """The bench's GPU cases (name, ours, theirs, traffic) of each
    (case maker, workload) pair, each side synchronised, torchvision's where
    torch sees the GPU (else theirs is None)."""
    tv = bench.torchvision_ops()
    theirs_device = "cuda" if tv is not None and tv[0].cuda.is_available() else None
    return [case for make, cfg in workloads
            for case in make(cfg, cupy.asarray, sync, theirs_device, tv)]


def scratch():
    import mmdispatch

    def released(fn):
        def run():
            fn()
            mmdispatch.empty_cache("cuda")
        return run

    for name, ours, _, _ in cases((bench.device_cases, bench.STANDARD),
                                  (bench.deform_cases, bench.DCN_STANDARD)):
        if name.startswith(("nms", "deform_conv2d")):
            kept, freed = bench.median_time(ours, 9), bench.median_time(released(ours), 9)
            print(f"gpu_profile: {name}: {kept * 1e6:.1f} us with scratch kept, "
                  f"{freed * 1e6:.1f} us with it released after each call", flush=True)
    alone = bench.median_call(released(sync), 5, 2000)
    print(f"gpu_profile: synchronize + empty_cache alone: {alone * 1e6:.2f} us", flush=True)


def products():
    import os

    workload = cases((bench.deform_cases, bench.DCN_STANDARD))   # imports torch and CuPy
    with open("/proc/self/maps") as maps:   # what the kernels' lookup finds: a libcublas.*
        loaded = any("/libcublas." in line for line in maps)
    setting = os.environ.get("MMDISPATCH_CUBLAS", "unset")
    has = f"cuBLAS {'loaded' if loaded else 'not loaded'}, MMDISPATCH_CUBLAS={setting}"
    for name, ours, theirs, _ in workload:
        mine = bench.median_time(ours, 9)
        other = bench.median_time(theirs, 9) if theirs is not None else float("nan")
        print(f"gpu_profile: {name} ({has}): {mine * 1e3:.3f} ms, torchvision "
              f"{other * 1e3:.3f} ms", flush=True)


def main(wanted):
    for name, ours, theirs, _ in cases((bench.device_cases, bench.STANDARD),
                                       (bench.deform_cases, bench.DCN_STANDARD),
                                       (bench.msda_cases, bench.MSDA_STANDARD)):
        # a row's deterministic run (the bench's name for it) only where a
        # wanted name says "deterministic"
        for label, run, other, det in ((name, ours, theirs, False),
                                       (bench.deterministic_name(name),
                                        bench.deterministic(ours), None, True)):
            if (det or wanted) and not any(w in label and ("deterministic" in w) == det
                                           for w in wanted):
                continue
            print(f"gpu_profile: {label}", flush=True)
            run()
            if other is not None:
                other()


if __name__ == "__main__":
    if sys.argv[1:] == ["--host"]:
        host()
        torch_host()
        scratch()
    elif sys.argv[1:] == ["--products"]:
        products()
    else:
        main(sys.argv[1:])
