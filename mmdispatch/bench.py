"""Benchmarks of the CPU kernels and of the per-call cost, on the
standard workload (STANDARD below), side by side with torchvision when it is installed.

    python -m mmdispatch bench [--quick] [--gpu-only] [--json PATH] [--plot PNG] [--repeat N]
    python -m mmdispatch bench --compare BASE NEW [--threshold PERCENT]

Every figure is the median of `repeat` timed runs (after one warm-up run).
Ratios are torchvision / mmdispatch measured in the same run; without
torchvision the table shows only our figures. Timings are never asserted
anywhere: CI may run --quick as a smoke test.

Dispatch overhead is what the dispatcher adds to a call: roi_align_forward_impl
with a registered no-op C kernel minus a Cython function that hands the same
Python arguments straight to that kernel (mmdispatch._benchkit), timed in
alternating batches; the median of the per-batch differences is reported.
The overhead-fraction sweep divides it by the time of real roi_align calls of
growing size (the --plot figure, when matplotlib is installed).

On a machine where mmdispatch's CUDA kernels run and CuPy is installed, the
same workload also runs on the GPU (CuPy arrays), each timed call waiting for
the device, side by side with torchvision's CUDA kernels when torch sees the
GPU, and the backward workloads once more with the `deterministic` CUDA
backend, with each kernel's achieved memory bandwidth (the least traffic
its work needs over its time) against the device's peak; the host-side cost of
a call with CuPy arrays is measured: the dispatch of a no-op kernel (no
device work) and a whole tiny ops.roi_align call (beside torchvision's on
CUDA tensors), per call over a batch of calls with one wait at the end; and
a row says whether a roi_align forward+backward returns while a long kernel
queued before it still runs (no host-device synchronisation). Elsewhere the
report says why the GPU part was skipped. Import time (fresh interpreters,
beside numpy's) is measured everywhere. Where torch is installed, the same
workload runs through mmdispatch.torch on torch tensors (forward+backward
through autograd; and MultiScaleRoIAlign pooling its rois from an FPN's
P2-P5) beside torchvision's ops on the same tensors, on the CPU
and, where our CUDA kernels run and torch sees a GPU, on CUDA, with the
per-call cost of a tiny roi_align without and with autograd recorded, and
of torchvision's own roi_align with our kernel behind its op
(mmdispatch.torch.replace_torchvision_kernels).
The cost of dispatch hooks: the tiny ops.roi_align call with
mmdispatch.trace(a no-op callback) and with mmdispatch.profile() active,
beside the same call without hooks (ratio below 1: the hooked call is
slower). Where Dask is installed (extra 'dask'), mmdispatch.dask's
workloads run on a LocalCluster of 1 and then 2 worker processes; their
ratio column is the speed-up of 2 workers over 1.

--compare runs nothing: it sets two earlier runs side by side (each its
--json file, or the log of its stderr, which holds every row as it was
measured), row by row: our figure in each and its change, torchvision's own
change between the runs (how far the machine drifted), and each run's ratio
to torchvision. A row whose change exceeds --threshold percent, beyond
torchvision's drift where it has one, is marked slower or faster. For
timing a change: the bench of the build before it and of the build with
it, on one machine (tools/gpu_check.sh's BASELINE does this on a GPU).

--gpu-only runs only the GPU rows (CuPy arrays and mmdispatch.torch on
CUDA), for a borrowed GPU machine whose time is short: the CPU rows take
minutes (their numpy and grid_sample references most of it) and measure
nothing about the GPU.
"""
import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import timeit
import warnings

import numpy as np

import mmdispatch
from mmdispatch import _benchkit, _core, ops

# Standard workload: an FPN P2 level of an 800x1216 image, 512 rois per image.
STANDARD = dict(batch=2, channels=256, height=200, width=304, rois_per_image=512,
                image=(800, 1216), spatial_scale=0.25, output=7, nms_boxes=20000,
                rotated_boxes=2000, soft_nms_boxes=5000, focal=(120_000, 80))
QUICK = dict(STANDARD, channels=32, rois_per_image=128, nms_boxes=4000, rotated_boxes=500,
             soft_nms_boxes=1000, focal=(8_000, 80))
# focal: RetinaNet's classification loss (sigmoid_focal_loss, reduction
# "sum") over (anchors, classes) logits, one-hot targets with a positive in
# one anchor of 100: its P3-P7 anchors of a 640x960 image (about 120,000),
# COCO's 80 classes.
# R-FCN's position-sensitive head on ResNet-50 stage 3 (stride 16): 10 output
# channels of 7x7 bins, 512 rois per image.
PS_STANDARD = dict(batch=2, channels=490, height=50, width=76, rois_per_image=512,
                   image=(800, 1216), spatial_scale=1 / 16, output=7)
PS_QUICK = dict(PS_STANDARD, channels=98, rois_per_image=128)
# A deformable 3x3 convolution of ResNet-50 stage 3 (DCNv2: with a mask).
DCN_STANDARD = dict(batch=2, in_channels=256, out_channels=256, height=64, width=64, kernel=3,
                    offset_groups=1)
DCN_QUICK = dict(DCN_STANDARD, in_channels=64, out_channels=64, height=32, width=32)
# Deformable DETR's encoder: 4 levels of an 800x1216 image at strides 8 to
# 64, every position a query, 8 heads of 32 channels, 4 points per level.
MSDA_STANDARD = dict(batch=2, heads=8, dims=32, points=4, spread=2.0,
                     levels=((100, 150), (50, 75), (25, 38), (13, 19)))
MSDA_QUICK = dict(MSDA_STANDARD, levels=((25, 38), (13, 19), (7, 10), (4, 5)))


def progress(text):
    print(text, file=sys.stderr, flush=True)


def roi_workload(cfg, seed=0):
    """Feature map and rois: centres uniform over the image, sides uniform
    in [16, 400] px, clipped to the image."""
    rng = np.random.default_rng(seed)
    feature = rng.standard_normal((cfg["batch"], cfg["channels"], cfg["height"],
                                   cfg["width"])).astype(np.float32)
    img_h, img_w = cfg["image"]
    k = cfg["batch"] * cfg["rois_per_image"]
    centre = rng.uniform([0, 0], [img_w, img_h], size=(k, 2))
    side = rng.uniform(16, 400, size=(k, 2))
    lo = np.clip(centre - side / 2, 0, [img_w, img_h])
    hi = np.clip(centre + side / 2, 0, [img_w, img_h])
    batch = np.repeat(np.arange(cfg["batch"]), cfg["rois_per_image"])[:, None]
    rois = np.concatenate([batch, lo, hi], axis=1).astype(np.float32)
    return feature, rois


def fpn_workload(cfg, seed=0):
    """An FPN's maps P2-P5 (strides 4 to 32) of the standard workload's
    images, P2 its feature map, and its rois as one (L, 4) array of boxes
    in image coordinates per image (torchvision's MultiScaleRoIAlign's
    input; those of 16 to 400 px pool from P2 to P4)."""
    feature, rois = roi_workload(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    maps = {"p2": feature}
    for level in (3, 4, 5):
        shape = (*feature.shape[:2], -(-feature.shape[2] // 2 ** (level - 2)),
                 -(-feature.shape[3] // 2 ** (level - 2)))
        maps[f"p{level}"] = rng.standard_normal(shape).astype(np.float32)
    boxes = [np.ascontiguousarray(rois[rois[:, 0] == i, 1:]) for i in range(cfg["batch"])]
    return maps, boxes


def nms_workload(n, seed=0):
    """Corners uniform in [0, 1000), sides uniform in [8, 200], random scores."""
    rng = np.random.default_rng(seed)
    corner = rng.uniform(0, 1000, size=(n, 2))
    side = rng.uniform(8, 200, size=(n, 2))
    boxes = np.concatenate([corner, corner + side], axis=1).astype(np.float32)
    return boxes, rng.random(n).astype(np.float32)


def torch_waiter(torch, device):
    """A function that waits for torch's queued work on torch device
    `device` (on the CPU there is none)."""
    return (lambda: None) if device == "cpu" else torch.cuda.synchronize


def median_time(fn, repeat):
    """Median seconds of `repeat` runs after a warm-up run; a function with
    a `single_run` attribute (a reference too slow to repeat) is timed
    once, without warm-up."""
    if getattr(fn, "single_run", False):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_call(fn, repeat, number=2000):
    """Median seconds per call of a fast function, over `repeat` batches."""
    return statistics.median(timeit.repeat(fn, repeat=repeat, number=number)) / number


def dispatch_overhead(repeat, number=20000):
    """(median ns of the no-op call through the dispatcher, of the raw call,
    of their per-batch difference) on a tiny roi_align argument set."""
    x = np.zeros((1, 1, 4, 4), np.float32)
    rois = np.zeros((1, 5), np.float32)
    out = np.empty((1, 1, 1, 1), np.float32)
    argmax_y, argmax_x = np.empty((0,), np.float32), np.empty((0,), np.float32)
    args = (x, rois, out, argmax_y, argmax_x, 1, 1, 1.0, 2, 1, True)
    dispatched, raw = _core.roi_align_forward_impl, _benchkit.raw_roi_align_forward
    noop = _benchkit.noop_roi_align_forward_kernel()
    pairs = []
    # registered in the cpu/default slot, as a user's own kernel would be
    # (selecting another backend with use_backend costs a thread-local read)
    with mmdispatch.register_impl("roi_align_forward_impl", "cpu", noop, override=True):
        for _ in range(max(repeat, 5) * 3):
            a = timeit.timeit(lambda: dispatched(*args), number=number) / number
            b = timeit.timeit(lambda: raw(*args), number=number) / number
            pairs.append((a, b))
    return (statistics.median(a for a, _ in pairs) * 1e9,
            statistics.median(b for _, b in pairs) * 1e9,
            statistics.median(a - b for a, b in pairs) * 1e9)


# (N, C, H, W, rois) for the overhead-fraction sweep, tiny to the standard workload.
SWEEP = [(1, 1, 4, 4, 1), (1, 4, 16, 16, 4), (1, 16, 32, 32, 16), (1, 32, 64, 64, 64),
         (2, 64, 100, 152, 256), (2, 256, 200, 304, 1024)]


def overhead_sweep(overhead_ns, quick, repeat):
    """Dispatch overhead as a fraction of roi_align_forward_impl calls (7x7,
    sampling_ratio 2, avg) of growing size."""
    points = []
    for n, c, h, w, k in SWEEP[:-2] if quick else SWEEP:
        cfg = dict(STANDARD, batch=n, channels=c, height=h, width=w, rois_per_image=k // n)
        feature, rois = roi_workload(cfg)
        rois[:, 1:] *= min(h / 200, w / 304)  # keep the rois on this smaller map
        out = np.empty((k, c, 7, 7), np.float32)
        none = np.empty((0,), np.float32)

        def call():
            _core.roi_align_forward_impl(feature, rois, out, none, none, 7, 7, 0.25, 2, 1, True)

        seconds = median_call(call, repeat, number=max(1, int(2e-2 / max(_once(call), 1e-7))))
        points.append({"shape": [n, c, h, w], "rois": k, "seconds": seconds,
                       "overhead_fraction": overhead_ns * 1e-9 / seconds})
    return points


def _once(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def plot_overhead(report, path):
    """Overhead fraction against op time on log axes; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    points = report["overhead"]["sweep"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog([p["seconds"] * 1e6 for p in points],
              [p["overhead_fraction"] * 100 for p in points], "o-", label="mmdispatch")
    ax.axhspan(0.1, 10, color="0.9", label="seed articles: ~10% (light) to <0.1% (heavy ops)")
    ax.set_xlabel("roi_align_forward_impl call time (µs)")
    ax.set_ylabel("dispatch overhead (% of call)")
    ax.set_title(f"dispatch overhead {report['overhead']['overhead_ns']:.0f} ns per call")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def peak_extra_bytes(fn, output_bytes):
    """Peak memory numpy and Python allocate during fn() beyond its output
    (tracemalloc sees numpy's buffers; the C kernels keep their per-roi
    weights on the stack up to 64 samples a side, on the heap beyond)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] - output_bytes
    finally:
        tracemalloc.stop()


def torchvision_ops():
    try:
        import torch
        import torchvision
    except ImportError:
        return None
    return torch, torchvision


def call_cost_cases(tv):
    """Per-call costs on a tiny input (1x1x4x4, one roi, 1x1 output)."""
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    rois = np.array([[0, 0, 0, 3, 3]], dtype=np.float32)
    out = np.empty((1, 1, 1, 1), np.float32)
    empty = np.empty((0,), np.float32)
    one = np.ones(1)
    theirs = None
    if tv is not None:
        torch, torchvision = tv
        t_x, t_rois = torch.from_numpy(x), torch.from_numpy(rois)

        def theirs():
            torchvision.ops.roi_align(t_x, t_rois, 1, 1.0, 2, True)
    yield "roi_align call, tiny input", lambda: ops.roi_align(x, rois, 1, 1.0, 2), theirs
    yield ("roi_align_forward_impl call, tiny input",
           lambda: mmdispatch.roi_align_forward_impl(x, rois, out, empty, empty, 1, 1, 1.0, 2, 1,
                                                     True), None)
    yield "np.add, 1-element arrays", lambda: np.add(one, one), None


def hook_cost(repeat):
    """(seconds per tiny ops.roi_align call without a hook, with
    mmdispatch.trace(no-op) active, with mmdispatch.profile() active),
    medians of batches timed in turn."""
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    rois = np.array([[0, 0, 0, 3, 3]], dtype=np.float32)

    def call():
        ops.roi_align(x, rois, 1, 1.0, 2)

    plain, traced, profiled = [], [], []
    for _ in range(max(repeat, 5)):
        plain.append(median_call(call, 1))
        with mmdispatch.trace(lambda event, record: None):
            traced.append(median_call(call, 1))
        with mmdispatch.profile():
            profiled.append(median_call(call, 1))
    return statistics.median(plain), statistics.median(traced), statistics.median(profiled)


# mmdispatch.dask workloads: (boxes per side of the IoU, images, boxes per image)
DASK_STANDARD = (40_000, 1000, 1000)
DASK_QUICK = (8_000, 100, 1000)


def dask_scaling(quick, repeat):
    """Wall times of mmdispatch.dask workloads on a LocalCluster of 1 and of
    2 worker processes (one thread each), computed from in-memory inputs:
    per-row maxima of an n x n IoU (5000-box blocks) and NMS over a Bag of
    images. Returns ({workload: {workers: seconds}}, None) or (None, why
    skipped)."""
    try:
        import dask.array as da
        import dask.bag as db
        import distributed
        from mmdispatch import dask as mdask
    except ImportError as exc:
        return None, f"Dask is not installed ({exc.name}): pip install 'mmdispatch[dask]'"
    n, images, per_image = DASK_QUICK if quick else DASK_STANDARD
    rng = np.random.default_rng(0)

    def boxes(count):
        b = rng.random((count, 4), dtype=np.float32) * 3000
        b[:, 2:] = b[:, :2] + rng.random((count, 2), dtype=np.float32) * 100
        return b

    a, b = da.from_array(boxes(n), chunks=(5000, 4)), da.from_array(boxes(n), chunks=(5000, 4))
    records = [{"image_id": i, "boxes": boxes(per_image),
                "scores": rng.random(per_image, dtype=np.float32)} for i in range(images)]
    workloads = {
        f"dask: bbox_overlaps {n:,} x {n:,} per-row max":
            lambda: mdask.bbox_overlaps(a, b).max(axis=1).compute(),
        f"dask: nms over a Bag of {images:,} images x {per_image:,} boxes":
            lambda: mdask.nms(db.from_sequence(records, npartitions=16), 0.5).compute(),
    }
    times = {name: {} for name in workloads}
    for workers in (1, 2):
        progress(f"bench: mmdispatch.dask on {workers} worker process(es) ...")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # distributed's notes on large graphs
            with distributed.LocalCluster(n_workers=workers, threads_per_worker=1,
                                          processes=True, dashboard_address=None) as cluster, \
                    distributed.Client(cluster):
                for name, fn in workloads.items():
                    fn()   # warm-up: workers import mmdispatch
                    times[name][workers] = median_time(fn, min(repeat, 3))
    return times, None


def cuda_runtime():
    """(cupy module, None) where mmdispatch's CUDA kernels can run, else
    (None, why not)."""
    status = next((d for d in mmdispatch.devices() if d["device"] == "cuda"), None)
    if status is None:
        return None, "this build has no CUDA kernels"
    if not status["available"]:
        return None, f"CUDA kernels unusable here: {status['status']}"
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed"
    return cupy, None


def least_traffic(feature, rois, size):
    """The least memory traffic, in bytes, of each benchmark's work (each
    array read or written once, the whole map read), from which the GPU part
    reports achieved bandwidth: roi_align forward (read the map, write the
    output), forward+backward (and read the gradient, zero and write
    grad_input), roi_pool forward+backward (and the int64 argmax, written
    then read), and nms of n boxes (boxes and scores read, the n x n/64
    suppression mask written and read)."""
    map_bytes = feature.nbytes
    pooled_bytes = len(rois) * feature.shape[1] * size * size * feature.itemsize
    return {"forward": map_bytes + pooled_bytes,
            "forward+backward": 3 * map_bytes + 2 * pooled_bytes,
            "roi_pool": 3 * map_bytes + 2 * pooled_bytes + 4 * pooled_bytes,
            "nms": lambda n: 5 * 4 * n + 2 * n * ((n + 63) // 64) * 8}


def device_cases(cfg, to_device, sync, theirs_device=None, tv=None):
    """(name, ours, theirs, bytes) for the roi_align, roi_pool and nms
    workloads on a device: arrays moved there by to_device, every timed call
    followed by sync() (the device finishing its work); theirs runs
    torchvision on torch device `theirs_device` ("cpu", "cuda"; None: no
    comparison); bytes is the least memory traffic the work needs (each
    array read or written once, the whole map read), from which the GPU
    part reports achieved bandwidth. With numpy and a no-op sync these are
    the CPU benchmarks."""
    feature, rois = roi_workload(cfg)
    d_feature, d_rois = to_device(feature), to_device(rois)
    scale, size = cfg["spatial_scale"], cfg["output"]
    pooled = (len(rois), feature.shape[1], size, size)
    traffic = least_traffic(feature, rois, size)
    torch = torchvision = None
    if tv is not None and theirs_device is not None:
        torch, torchvision = tv
        t_feature = torch.from_numpy(feature).to(theirs_device)
        t_rois = torch.from_numpy(rois).to(theirs_device)

        theirs_sync = torch_waiter(torch, theirs_device)

    for sr in (2, 0):
        def forward(sr=sr):
            ops.roi_align_forward(d_feature, d_rois, size, scale, sr, "avg", True)
            sync()

        grad = to_device(np.ones((len(rois), feature.shape[1], size, size), np.float32))

        def forward_backward(sr=sr):
            ops.roi_align_forward(d_feature, d_rois, size, scale, sr, "avg", True)
            ops.roi_align_backward(grad, d_rois, None, None, feature.shape, scale, sr, "avg",
                                   True)
            sync()

        theirs_fwd = theirs_fb = None
        if torch is not None:
            def theirs_fwd(sr=sr):
                with torch.no_grad():
                    torchvision.ops.roi_align(t_feature, t_rois, size, scale, sr, True)
                theirs_sync()

            def theirs_fb(sr=sr):
                x = t_feature.detach().requires_grad_(True)
                torchvision.ops.roi_align(x, t_rois, size, scale, sr, True).sum().backward()
                theirs_sync()

        yield (f"roi_align sampling_ratio={sr} forward", forward, theirs_fwd,
               traffic["forward"])
        yield (f"roi_align sampling_ratio={sr} forward+backward", forward_backward, theirs_fb,
               traffic["forward+backward"])

    grad = to_device(np.ones(pooled, np.float32))

    def pool_forward_backward():
        output, argmax = ops.roi_pool_forward(d_feature, d_rois, size, scale)
        ops.roi_pool_backward(grad, d_rois, argmax, feature.shape, scale)
        sync()

    theirs_pool = None
    if torch is not None:
        def theirs_pool():
            x = t_feature.detach().requires_grad_(True)
            torchvision.ops.roi_pool(x, t_rois, size, scale).sum().backward()
            theirs_sync()

    yield "roi_pool forward+backward", pool_forward_backward, theirs_pool, traffic["roi_pool"]

    for n in sorted({2000, cfg["nms_boxes"]}):
        boxes, scores = nms_workload(n)
        d_boxes, d_scores = to_device(boxes), to_device(scores)

        def nms(d_boxes=d_boxes, d_scores=d_scores):
            ops.nms(d_boxes, d_scores, 0.5)
            sync()

        theirs_nms = None
        if torch is not None:
            t_boxes = torch.from_numpy(boxes).to(theirs_device)
            t_scores = torch.from_numpy(scores).to(theirs_device)

            def theirs_nms(t_boxes=t_boxes, t_scores=t_scores):
                torchvision.ops.nms(t_boxes, t_scores, 0.5)
                theirs_sync()

        yield f"nms {n} boxes, IoU 0.5", nms, theirs_nms, traffic["nms"](n)


def torch_cases(cfg, device, tv):
    """(name, ours, theirs, bytes) for the standard workload through
    mmdispatch.torch (torch tensors; forward+backward through autograd)
    beside torchvision's ops on the same tensors (None without torchvision),
    on torch device `device`; plus the per-call cost of a tiny roi_align,
    without and with a gradient to compute."""
    import torch

    import mmdispatch.torch as mt

    sync = torch_waiter(torch, device)

    feature, rois = roi_workload(cfg)
    t_feature = torch.from_numpy(feature).to(device)
    t_rois = torch.from_numpy(rois).to(device)
    scale, size = cfg["spatial_scale"], cfg["output"]
    traffic = least_traffic(feature, rois, size)
    libraries = [("", mt)] + ([("tv", tv[1].ops)] if tv is not None else [])

    def pair(make):
        fns = {tag: make(lib) for tag, lib in libraries}
        return fns[""], fns.get("tv")

    for sr in (2, 0):
        def forward(lib, sr=sr):
            def run():
                with torch.no_grad():
                    lib.roi_align(t_feature, t_rois, size, scale, sr, True)
                sync()
            return run

        def forward_backward(lib, sr=sr):
            def run():
                x = t_feature.detach().requires_grad_(True)
                lib.roi_align(x, t_rois, size, scale, sr, True).sum().backward()
                sync()
            return run

        yield (f"roi_align sampling_ratio={sr} forward", *pair(forward), traffic["forward"])
        yield (f"roi_align sampling_ratio={sr} forward+backward (autograd)",
               *pair(forward_backward), traffic["forward+backward"])

    maps, image_boxes = fpn_workload(cfg)
    fpn_maps = {name: torch.from_numpy(m).to(device) for name, m in maps.items()}
    fpn_boxes = [torch.from_numpy(b).to(device) for b in image_boxes]

    def multiscale(lib):
        pooler = lib.MultiScaleRoIAlign(list(fpn_maps), size, 2)

        def run():
            x = {name: m.detach().requires_grad_(True) for name, m in fpn_maps.items()}
            pooler(x, fpn_boxes, [cfg["image"]] * cfg["batch"]).sum().backward()
            sync()
        return run

    yield ("MultiScaleRoIAlign, FPN P2-P5, forward+backward (autograd)", *pair(multiscale),
           None)

    def pool_forward_backward(lib):
        def run():
            x = t_feature.detach().requires_grad_(True)
            lib.roi_pool(x, t_rois, size, scale).sum().backward()
            sync()
        return run

    yield ("roi_pool forward+backward (autograd)", *pair(pool_forward_backward),
           traffic["roi_pool"])
    boxes, scores = nms_workload(cfg["nms_boxes"])
    t_boxes = torch.from_numpy(boxes).to(device)
    t_scores = torch.from_numpy(scores).to(device)

    def nms(lib):
        def run():
            lib.nms(t_boxes, t_scores, 0.5)
            sync()
        return run

    yield f"nms {cfg['nms_boxes']} boxes, IoU 0.5", *pair(nms), traffic["nms"](len(boxes))
    anchors, classes = cfg["focal"]
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(anchors, classes, generator=g) * 2 - 4).to(device)
    labels = torch.zeros(anchors, classes)
    positive = torch.arange(0, anchors, 100)
    labels[positive, torch.randint(0, classes, (len(positive),), generator=g)] = 1
    labels = labels.to(device)

    def focal(lib, backward):
        def run():
            x = logits.detach().requires_grad_(backward)
            with torch.set_grad_enabled(backward):
                loss = lib.sigmoid_focal_loss(x, labels, 0.25, 2, "sum")
            if backward:
                loss.backward()
            sync()
        return run

    elements = anchors * classes * logits.element_size()   # bytes of one such array
    name = f"sigmoid_focal_loss ({anchors}, {classes}), sum"
    yield f"{name}, forward", *pair(lambda lib: focal(lib, False)), 2 * elements
    yield (f"{name}, forward+backward (autograd)", *pair(lambda lib: focal(lib, True)),
           5 * elements)


def torch_call_costs(device, tv, number=2000):
    """{name: (ours, torchvision's or None)}: seconds per call of a tiny
    roi_align through mmdispatch.torch, without and with autograd, and
    (with torchvision) through torchvision.ops.roi_align with our kernel
    behind its op; of a tiny sigmoid_focal_loss, and its forward+backward
    (many launches a call in torchvision's, one or two in ours)."""
    import torch

    import mmdispatch.torch as mt
    x = torch.zeros((1, 1, 4, 4), device=device)
    grad_x = x.clone().requires_grad_(True)
    rois = torch.tensor([[0, 0, 0, 3, 3]], dtype=torch.float32, device=device)
    costs = {}

    def call(lib, tensor):
        return lambda: lib.roi_align(tensor, rois, 1, 1.0, 2, True)

    for name, tensor in (("roi_align call, tiny input", x),
                         ("roi_align call, tiny input, autograd recorded", grad_x)):
        costs[name] = (median_call(call(mt, tensor), 5, number),
                       median_call(call(tv[1].ops, tensor), 5, number) if tv is not None
                       else None)
    logits = torch.randn(8, 4, device=device)
    labels = (torch.rand(8, 4, device=device) > 0.7).float()
    grad_logits = logits.clone().requires_grad_(True)

    def focal(lib, backward):
        if backward:
            return lambda: lib.sigmoid_focal_loss(grad_logits, labels, 0.25, 2, "sum").backward()
        return lambda: lib.sigmoid_focal_loss(logits, labels, 0.25, 2, "sum")

    for name, backward in (("sigmoid_focal_loss call, tiny input (8, 4), sum", False),
                           ("sigmoid_focal_loss forward+backward, tiny input (8, 4), sum",
                            True)):
        costs[name] = (median_call(focal(mt, backward), 5, number),
                       median_call(focal(tv[1].ops, backward), 5, number) if tv is not None
                       else None)
    if tv is not None:   # torchvision's own function, its op served by our kernel
        with mt.replace_torchvision_kernels(device):
            ours = median_call(call(tv[1].ops, x), 5, number)
        costs["roi_align call, tiny input, torchvision.ops on our kernels "
              "(replace_torchvision_kernels)"] = (ours, costs["roi_align call, tiny input"][1])
    return costs


def run_torch(quick, repeat, tv, gpu_only=False):
    """mmdispatch.torch's rows (CPU unless gpu_only, and CUDA when torch
    sees a GPU and our CUDA kernels run), or (None, reason) without torch
    (or, with gpu_only, without CUDA)."""
    try:
        import torch

        import mmdispatch.torch  # noqa: F401
    except ImportError as exc:
        return None, f"torch is not installed ({exc})"
    cfg = QUICK if quick else STANDARD
    devices = [] if gpu_only else ["cpu"]
    if torch.cuda.is_available() and cuda_runtime()[0] is not None:
        devices.append("cuda")
    if not devices:
        return None, "torch sees no GPU, or mmdispatch's CUDA kernels do not run here"
    rows = []
    for device in devices:
        prefix = f"torch {device}: "
        rows += timed_rows(torch_cases(cfg, device, tv), repeat, prefix)
        progress(f"bench: {prefix}per-call cost ...")
        for name, (ours, theirs) in torch_call_costs(device, tv).items():
            rows.append(result_row(prefix + name, "s/call", ours, theirs))
    return rows, None


def device_call_costs(to_device, sync, device, number=2000, theirs=None):
    """Host-side cost per call on a device, over `number` calls and one
    sync(): roi_align_forward_impl dispatching to a no-op C kernel
    registered for `device` (the dispatcher's host work: intake of the 5
    arrays, device check, lookup; no device work), and a whole tiny
    ops.roi_align call (launches included), beside `theirs` (a callable
    making torchvision's tiny call, None: no comparison). {name: (seconds
    per call, theirs or None)}."""
    x = to_device(np.zeros((1, 1, 4, 4), np.float32))
    rois = to_device(np.array([[0, 0, 0, 3, 3]], np.float32))
    out = to_device(np.empty((1, 1, 1, 1), np.float32))
    empty = to_device(np.empty((0,), np.float32))
    args = (x, rois, out, empty, empty, 1, 1, 1.0, 2, 1, True)
    impl = _core.roi_align_forward_impl

    def batch(fn):
        def run_batch():
            for _ in range(number):
                fn()
            sync()
        return run_batch

    def per_call(fn, repeat=7):
        run_batch = batch(fn)
        run_batch()
        return statistics.median(_once(run_batch) for _ in range(repeat)) / number

    noop = _benchkit.noop_roi_align_forward_kernel()
    with mmdispatch.register_impl("roi_align_forward_impl", device, noop, override=True):
        dispatch = per_call(lambda: impl(*args))
    tiny = per_call(lambda: ops.roi_align(x, rois, 1, 1.0, 2))
    return {"no-op kernel through roi_align_forward_impl (host)": (dispatch, None),
            "roi_align call, tiny input (host, launches included)":
                (tiny, per_call(theirs) if theirs is not None else None)}


def returns_before_queued_work(cupy):
    """Whether ops.roi_align (and its backward) return while a kernel queued
    before them on the stream is still running: no host-device
    synchronisation on the default path. (returned early, host seconds of
    the two calls)."""
    spin = cupy.RawKernel(r"""
    extern "C" __global__ void spin(long long cycles) {
        const long long start = clock64();
        while (clock64() - start < cycles) {}
    }""", "spin")
    x = cupy.asarray(np.random.default_rng(0).standard_normal((2, 16, 32, 32), np.float32))
    rois = cupy.asarray(np.array([[0, 0, 0, 20, 20], [1, 4, 4, 30, 12]], np.float32))
    stream = cupy.cuda.get_current_stream()
    out = ops.roi_align(x, rois, 7, 1.0, 2)     # warm (the error word is allocated once)
    stream.synchronize()
    spin((1,), (1,), (np.int64(1_000_000_000),))   # about half a second
    start = time.perf_counter()
    out = ops.roi_align(x, rois, 7, 1.0, 2)
    ops.roi_align_backward(out, rois, None, None, x.shape, 1.0, 2)
    seconds = time.perf_counter() - start
    early = not stream.done
    stream.synchronize()
    return early, seconds


def peak_bandwidth(cupy):
    """The current GPU's peak memory bandwidth in bytes/s, from its memory
    clock and bus width (double data rate), or None where CUDA does not say."""
    try:
        attributes = cupy.cuda.Device().attributes
        clock_khz = attributes["MemoryClockRate"]
        bus_bits = attributes["GlobalMemoryBusWidth"]
    except Exception:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def import_seconds(repeat):
    """Median wall time of `import mmdispatch` in a fresh interpreter, and of
    `import numpy` for reference (the same interpreter start-up in both)."""
    import subprocess
    import tempfile

    def timed(statement):
        code = ("import time; t = time.perf_counter(); " + statement +
                "; print(time.perf_counter() - t)")
        # not from the current directory: a source tree's mmdispatch/ would
        # shadow the installed package
        return statistics.median(
            float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True, cwd=tempfile.gettempdir()).stdout)
            for _ in range(repeat))

    return timed("import mmdispatch"), timed("import numpy")


def tail_latency(quick):
    """{situation: (p50, p99)} of a mid-size roi_align call (1x16x32x32 map,
    16 rois, 7x7, sampling_ratio 2): alone, beside one busy process, and
    beside one busy process per core (the same priority as ours). A
    parallel call that waited for a thread the scheduler has not run would
    take a time slice (milliseconds); with every core busy even a serial
    call is preempted now and then, so there p99 is the scheduler's."""
    import os
    import subprocess

    rng = np.random.default_rng(0)
    x = rng.random((1, 16, 32, 32), dtype=np.float32)
    xy = rng.uniform(0, 19, (16, 2))
    rois = np.concatenate([np.zeros((16, 1)), xy, xy + rng.uniform(2, 13, (16, 2))],
                          axis=1).astype(np.float32)
    calls = 300 if quick else 3000

    def percentiles(busy):
        load = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(busy)]
        try:
            time.sleep(0.2 if busy else 0)
            for _ in range(20):
                ops.roi_align(x, rois, 7, 1.0, 2)
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                ops.roi_align(x, rois, 7, 1.0, 2)
                times.append(time.perf_counter() - start)
        finally:
            for proc in load:
                proc.kill()
                proc.wait()
        return np.percentile(times, 50), np.percentile(times, 99)

    cores = os.cpu_count() or 1
    return {"idle": percentiles(0), "one other busy process": percentiles(1),
            f"{cores} other busy processes": percentiles(cores)}


def deterministic(fn):
    """fn run on the deterministic CUDA backend."""
    def run_deterministic():
        with mmdispatch.use_backend("cuda", "deterministic"):
            fn()
    return run_deterministic


def tf32_cases(cases, tv):
    """The cases (name, ours, theirs, traffic) with float32 products
    allowed in TF32 on both sides (mmdispatch.set_float32_matmul_precision
    and torch.set_float32_matmul_precision "high", as a training script
    that sets torch's puts torchvision's and mmdispatch.torch's products),
    each restored to what it was after the call."""
    torch = tv[0] if tv is not None else None

    def at_high(fn, library):   # library: mmdispatch or torch, whose setting fn runs under
        def run():
            before = library.get_float32_matmul_precision()
            library.set_float32_matmul_precision("high")
            try:
                fn()
            finally:
                library.set_float32_matmul_precision(before)
        return run

    for name, ours, theirs, traffic in cases:
        yield (f"{name}, TF32 products (float32 matmul precision 'high')",
               at_high(ours, mmdispatch),
               at_high(theirs, torch) if theirs is not None and torch is not None else None,
               traffic)


def deterministic_name(name):
    """The name of row `name` run on the deterministic CUDA backend."""
    return f"{name}, deterministic backend"


def result_row(name, unit, ours, theirs=None, traffic=None):
    """The row, also printed on stderr as it is made, so a run cut short (a
    borrowed GPU's time running out) still shows what it measured."""
    row = {"benchmark": name, "unit": unit, "mmdispatch": ours, "torchvision": theirs,
           "ratio": (theirs / ours) if theirs is not None and ours else None,
           "bytes": traffic}
    progress(f"bench: = {name}: {format_value(ours, unit)}"
             + (f", theirs {format_value(theirs, unit)} ({row['ratio']:.2f}x)"
                if row["ratio"] is not None else ""))
    return row


def timed_rows(cases, repeat, prefix=""):
    """Result rows of (name, ours, theirs, bytes) cases: median seconds of
    each side (theirs None: no comparison), their ratio, the traffic."""
    rows = []
    for name, fn, theirs_fn, traffic in cases:
        progress(f"bench: {prefix}{name} ...")
        theirs = median_time(theirs_fn, repeat) if theirs_fn else None
        rows.append(result_row(prefix + name, "s", median_time(fn, repeat), theirs, traffic))
    return rows


def ps_cases(cfg, to_device, sync, theirs_device=None, tv=None):
    """(name, ours, theirs, None) for the position-sensitive workload
    (ps_roi_align with adaptive sampling, torchvision's default, and
    ps_roi_pool; forward, and forward+backward), as device_cases."""
    feature, rois = roi_workload(cfg)
    d_feature, d_rois = to_device(feature), to_device(rois)
    scale, size = cfg["spatial_scale"], cfg["output"]
    grad = to_device(np.ones((len(rois), feature.shape[1] // size ** 2, size, size), np.float32))
    torch = torchvision = None
    if tv is not None and theirs_device is not None:
        torch, torchvision = tv
        t_feature = torch.from_numpy(feature).to(theirs_device)
        t_rois = torch.from_numpy(rois).to(theirs_device)
    for name, ours, backward, theirs_op in (
            ("ps_roi_align", lambda: ops.ps_roi_align(d_feature, d_rois, size, scale, -1),
             lambda: ops.ps_roi_align_backward(grad, d_rois, feature.shape, scale, -1),
             lambda x: torchvision.ops.ps_roi_align(x, t_rois, size, scale, -1)),
            ("ps_roi_pool", lambda: ops.ps_roi_pool(d_feature, d_rois, size, scale),
             lambda: ops.ps_roi_pool_backward(grad, d_rois, feature.shape, scale),
             lambda x: torchvision.ops.ps_roi_pool(x, t_rois, size, scale))):
        def forward(ours=ours):
            ours()
            sync()

        def forward_backward(ours=ours, backward=backward):
            ours()
            backward()
            sync()

        theirs_fwd = theirs_fb = None
        if torch is not None:
            theirs_sync = torch_waiter(torch, theirs_device)

            def theirs_fwd(theirs_op=theirs_op):
                with torch.no_grad():
                    theirs_op(t_feature)
                theirs_sync()

            def theirs_fb(theirs_op=theirs_op):
                theirs_op(t_feature.detach().requires_grad_(True)).sum().backward()
                theirs_sync()
        yield f"{name} R-FCN head forward", forward, theirs_fwd, None
        yield f"{name} R-FCN head forward+backward", forward_backward, theirs_fb, None


def mmcv_focal_cases(cfg, to_device, sync, theirs_device=None, tv=None):
    """(name, ours, theirs, bytes) for MMCV's sigmoid_focal_loss (class
    indices, C for background: what mmdet's RetinaNet head calls) on the
    focal workload, forward and forward+backward (its backward gives
    d sum(loss) / d input), beside torchvision's sigmoid_focal_loss of the
    same targets one-hot (the same loss), forward and forward+backward of
    its sum through autograd."""
    anchors, classes = cfg["focal"]
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((anchors, classes)) * 2 - 4).astype(np.float32)
    labels = np.full(anchors, classes, np.int64)
    labels[::100] = rng.integers(0, classes, len(labels[::100]))
    d_logits, d_labels = to_device(logits), to_device(labels)

    def forward():
        ops.sigmoid_focal_loss_forward(d_logits, d_labels, 2.0, 0.25)
        sync()

    def forward_backward():
        ops.sigmoid_focal_loss_forward(d_logits, d_labels, 2.0, 0.25)
        ops.sigmoid_focal_loss_backward(d_logits, d_labels, 2.0, 0.25)
        sync()

    theirs_fwd = theirs_fb = None
    if tv is not None and theirs_device is not None:
        torch, torchvision = tv
        t_logits = torch.from_numpy(logits).to(theirs_device)
        t_one_hot = torch.from_numpy(labels[:, None] == np.arange(classes)).float().to(
            theirs_device)

        theirs_sync = torch_waiter(torch, theirs_device)

        def theirs_fwd():
            with torch.no_grad():
                torchvision.ops.sigmoid_focal_loss(t_logits, t_one_hot, 0.25, 2, "none")
            theirs_sync()

        def theirs_fb():
            x = t_logits.detach().requires_grad_(True)
            torchvision.ops.sigmoid_focal_loss(x, t_one_hot, 0.25, 2, "sum").backward()
            theirs_sync()
    elements = logits.nbytes   # the logits read, a loss or gradient of their size written
    name = f"MMCV sigmoid_focal_loss ({anchors}, {classes}) (vs torchvision's, one-hot)"
    yield f"{name} forward", forward, theirs_fwd, 2 * elements + labels.nbytes
    yield f"{name} forward+backward", forward_backward, theirs_fb, 4 * elements + labels.nbytes
    yield from softmax_focal_cases(cfg, to_device, sync, theirs_device, tv)


def softmax_focal_cases(cfg, to_device, sync, theirs_device=None, tv=None):
    """(name, ours, theirs, bytes) for MMCV's softmax_focal_loss over the
    focal workload's anchors and its classes plus a background class,
    forward and forward+backward (a gradient of ones per row), beside the
    same loss in torch's ops (log_softmax, the target's column, the focal
    term; its sum through autograd): torchvision has no softmax focal
    loss, and MMCV's has no CPU kernel."""
    anchors, classes = cfg["focal"]
    classes += 1
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((anchors, classes)) * 2).astype(np.float32)
    labels = rng.integers(0, classes, anchors)
    ones = np.ones(anchors, np.float32)
    d_logits, d_labels, d_ones = to_device(logits), to_device(labels), to_device(ones)

    def forward():
        ops.softmax_focal_loss_forward(d_logits, d_labels, 2.0, 0.25)
        sync()

    def forward_backward():
        ops.softmax_focal_loss_forward(d_logits, d_labels, 2.0, 0.25)
        ops.softmax_focal_loss_backward(d_logits, d_labels, d_ones, 2.0, 0.25)
        sync()

    theirs_fwd = theirs_fb = None
    if tv is not None and theirs_device is not None:
        torch = tv[0]
        t_logits = torch.from_numpy(logits).to(theirs_device)
        t_labels = torch.from_numpy(labels).to(theirs_device)[:, None]
        theirs_sync = torch_waiter(torch, theirs_device)

        def loss(x):
            log_p = torch.log_softmax(x, 1).gather(1, t_labels)[:, 0]
            return -0.25 * (1 - log_p.exp()) ** 2 * log_p

        def theirs_fwd():
            with torch.no_grad():
                loss(t_logits)
            theirs_sync()

        def theirs_fb():
            x = t_logits.detach().requires_grad_(True)
            loss(x).sum().backward()
            theirs_sync()
    name = f"MMCV softmax_focal_loss ({anchors}, {classes}) (vs torch's log_softmax form)"
    rows = labels.nbytes + ones.nbytes   # the logits read; a loss per row or a gradient written
    yield f"{name} forward", forward, theirs_fwd, logits.nbytes + rows
    yield f"{name} forward+backward", forward_backward, theirs_fb, 3 * logits.nbytes + 2 * rows


def deform_cases(cfg, to_device, sync, theirs_device=None, tv=None):
    """(name, ours, theirs, None) for a deformable convolution with a mask
    (stride 1, padding 1): forward, and forward+backward with respect to
    all five inputs, as device_cases."""
    rng = np.random.default_rng(0)
    n, c_in, c_out = cfg["batch"], cfg["in_channels"], cfg["out_channels"]
    h, w, k, g = cfg["height"], cfg["width"], cfg["kernel"], cfg["offset_groups"]
    host = [rng.standard_normal((n, c_in, h, w)),
            rng.standard_normal((n, 2 * g * k * k, h, w)) * 2,
            rng.random((n, g * k * k, h, w)),
            rng.standard_normal((c_out, c_in, k, k)) * (c_in * k * k) ** -0.5,
            rng.standard_normal(c_out)]
    host = [a.astype(np.float32) for a in host]
    x, offset, mask, weight, bias = (to_device(a) for a in host)
    grad = to_device(np.ones((n, c_out, h, w), np.float32))

    def forward():
        ops.deform_conv2d(x, offset, weight, bias, 1, 1, 1, mask)
        sync()

    def forward_backward():
        ops.deform_conv2d(x, offset, weight, bias, 1, 1, 1, mask)
        ops.deform_conv2d_backward(grad, x, offset, weight, 1, 1, 1, mask)
        sync()

    theirs_fwd = theirs_fb = None
    if tv is not None and theirs_device is not None:
        torch, torchvision = tv
        t = [torch.from_numpy(a).to(theirs_device) for a in host]

        theirs_sync = torch_waiter(torch, theirs_device)

        def theirs_fwd():
            with torch.no_grad():
                torchvision.ops.deform_conv2d(t[0], t[1], t[3], t[4], padding=1, mask=t[2])
            theirs_sync()

        def theirs_fb():
            leaves = [a.detach().requires_grad_(True) for a in t]
            torchvision.ops.deform_conv2d(leaves[0], leaves[1], leaves[3], leaves[4], padding=1,
                                          mask=leaves[2]).sum().backward()
            theirs_sync()
    shape = f"{n}x{c_in}x{h}x{w}, {c_out} out, {k}x{k}, mask"
    yield f"deform_conv2d forward ({shape})", forward, theirs_fwd, None
    yield f"deform_conv2d forward+backward ({shape})", forward_backward, theirs_fb, None


def grid_sample_attention(torch, value, shapes, locations, weights):
    """Multi-scale deformable attention as the pure-PyTorch fallback of MMCV
    and Deformable DETR computes it: per level, value as an (N*M, D, H, W)
    map, sampled by grid_sample at 2 * location - 1, then weighted and summed
    over levels and points. (N, Q, M * D)."""
    import torch.nn.functional as F
    n, _, m, d = value.shape
    q, levels, points = locations.shape[1], locations.shape[3], locations.shape[4]
    sampled, start = [], 0
    for level, (h, w) in enumerate(shapes):
        plane = value[:, start:start + h * w].permute(0, 2, 3, 1).reshape(n * m, d, h, w)
        start += h * w
        grid = (2 * locations[:, :, :, level] - 1).permute(0, 2, 1, 3, 4).reshape(n * m, q,
                                                                                  points, 2)
        sampled.append(F.grid_sample(plane, grid, mode="bilinear", padding_mode="zeros",
                                     align_corners=False))      # (N*M, D, Q, P)
    attn = weights.permute(0, 2, 1, 3, 4).reshape(n * m, 1, q, levels * points)
    out = (torch.cat(sampled, dim=-1) * attn).sum(-1)            # (N*M, D, Q)
    return out.reshape(n, m * d, q).transpose(1, 2)


def msda_cases(cfg, to_device, sync, theirs_device=None, tv=None):
    """(name, ours, theirs, bytes) for multi-scale deformable attention with
    every position a query, against grid_sample_attention (the fallback
    MMCV and Deformable DETR ship): forward, and forward+backward with
    respect to value, sampling_locations and attention_weights. bytes: each
    input read and each output written once."""
    rng = np.random.default_rng(0)
    shapes = np.array(cfg["levels"], np.int64)
    sizes = shapes.prod(1)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    n, m, d, p = cfg["batch"], cfg["heads"], cfg["dims"], cfg["points"]
    s = q = int(sizes.sum())
    # as in the encoder: each query's reference point is its own cell's
    # centre; a point samples around it, `spread` cells away on each level
    # (the normal scale of learned offsets, MMCV's initial ring: 1 to 4)
    centres = np.concatenate([np.stack(np.meshgrid((np.arange(w) + 0.5) / w,
                                                   (np.arange(h) + 0.5) / h), -1).reshape(-1, 2)
                              for h, w in shapes])
    cells = rng.standard_normal((n, q, m, len(shapes), p, 2)) * cfg["spread"]
    locations = centres[None, :, None, None, None, :] + cells / shapes[:, ::-1][:, None, :]
    host = [rng.standard_normal((n, s, m, d)).astype(np.float32), locations.astype(np.float32),
            rng.random((n, q, m, len(shapes), p)).astype(np.float32)]
    host[2] /= host[2].sum(axis=(3, 4), keepdims=True)
    value, locations, weights = (to_device(a) for a in host)
    d_shapes, d_starts = to_device(shapes), to_device(starts)
    grad = to_device(np.ones((n, q, m * d), np.float32))
    inputs = sum(a.nbytes for a in host)
    out_bytes = n * q * m * d * 4

    def forward():
        ops.multi_scale_deformable_attn(value, d_shapes, d_starts, locations, weights)
        sync()

    def forward_backward():
        ops.multi_scale_deformable_attn(value, d_shapes, d_starts, locations, weights)
        ops.multi_scale_deformable_attn_backward(value, d_shapes, d_starts, locations, weights,
                                                 grad)
        sync()

    theirs_fwd = theirs_fb = None
    if tv is not None and theirs_device is not None:
        torch = tv[0]
        t = [torch.from_numpy(a).to(theirs_device) for a in host]
        levels = [tuple(map(int, hw)) for hw in shapes]

        theirs_sync = torch_waiter(torch, theirs_device)

        def theirs_fwd():
            with torch.no_grad():
                grid_sample_attention(torch, *t[:1], levels, *t[1:])
            theirs_sync()

        def theirs_fb():
            leaves = [a.detach().requires_grad_(True) for a in t]
            grid_sample_attention(torch, leaves[0], levels, *leaves[1:]).sum().backward()
            theirs_sync()
    shape = (f"N={n}, {q} queries, {m}x{d}, {len(shapes)} levels x {p} points; vs a "
             f"grid_sample fallback")
    yield (f"multi_scale_deformable_attn forward ({shape})", forward, theirs_fwd,
           inputs + out_bytes)
    yield (f"multi_scale_deformable_attn forward+backward ({shape})", forward_backward,
           theirs_fb, 2 * (inputs + out_bytes))


def rotated_corners(boxes, clockwise=True):
    """(n, 4, 2) corners of (n, 5) rotated boxes, in order of positive
    signed area (box_iou_rotated's definition)."""
    angle = boxes[:, 4] if clockwise else -boxes[:, 4]
    c, s = np.cos(angle)[:, None], np.sin(angle)[:, None]
    dx = np.array([-0.5, 0.5, 0.5, -0.5]) * boxes[:, 2:3]
    dy = np.array([-0.5, -0.5, 0.5, 0.5]) * boxes[:, 3:4]
    return np.stack([boxes[:, :1] + dx * c - dy * s, boxes[:, 1:2] + dx * s + dy * c], -1)


def numpy_box_iou_rotated(boxes1, boxes2, rows=64):
    """IoU of every pair of rotated boxes, vectorised with numpy: the
    intersection is the convex hull of the corners of each box inside the
    other and of the edges' crossings (24 candidate points a pair), its
    area by the shoelace formula over the candidates sorted by angle (the
    ones that do not count replaced by the first that does). In blocks of
    `rows` rows, so memory stays bounded."""
    b1, b2 = np.asarray(boxes1, np.float64), np.asarray(boxes2, np.float64)
    p_all, q_all = rotated_corners(b1), rotated_corners(b2)
    area1, area2 = b1[:, 2] * b1[:, 3], b2[:, 2] * b2[:, 3]
    out = np.zeros((len(b1), len(b2)))
    q = q_all[None]                                          # (1, M, 4, 2)

    def inside(points, polygon):                             # points (R, M, K, 2)
        a, b = polygon, np.roll(polygon, -1, axis=-2)         # (R, M, 4, 2)
        e = (b - a)[:, :, None]                               # (R, M, 1, 4, 2)
        d = points[:, :, :, None] - a[:, :, None]             # (R, M, K, 4, 2)
        return ((e[..., 0] * d[..., 1] - e[..., 1] * d[..., 0]) >= -1e-9).all(-1)

    with np.errstate(invalid="ignore", divide="ignore"):
        for r0 in range(0, len(b1), rows):
            p = np.broadcast_to(p_all[r0:r0 + rows, None], (min(rows, len(b1) - r0),
                                                             len(b2), 4, 2))
            qq = np.broadcast_to(q, p.shape)
            a, b = p, np.roll(p, -1, axis=-2)                   # edges of box 1
            c, d = qq, np.roll(qq, -1, axis=-2)                 # edges of box 2
            ab, cd = (b - a)[:, :, :, None], (d - c)[:, :, None]
            ca = c[:, :, None] - a[:, :, :, None]               # (R, M, 4, 4, 2)
            den = ab[..., 0] * cd[..., 1] - ab[..., 1] * cd[..., 0]
            t = (ca[..., 0] * cd[..., 1] - ca[..., 1] * cd[..., 0]) / den
            u = (ca[..., 0] * ab[..., 1] - ca[..., 1] * ab[..., 0]) / den
            cross = a[:, :, :, None] + t[..., None] * ab
            ok_cross = (den != 0) & (t >= 0) & (t <= 1) & (u >= 0) & (u <= 1)
            points = np.concatenate([p, qq, cross.reshape(*p.shape[:2], 16, 2)], axis=2)
            valid = np.concatenate([inside(p, qq), inside(qq, p),
                                    ok_cross.reshape(*p.shape[:2], 16)], axis=2)
            points = np.where(valid[..., None], points, 0.0)   # parallel edges: NaN
            count = valid.sum(-1, keepdims=True)
            centre = points.sum(2) / np.maximum(count, 1)
            angle = np.arctan2(points[..., 1] - centre[..., None, 1],
                               points[..., 0] - centre[..., None, 0])
            order = np.argsort(np.where(valid, angle, np.inf), axis=-1)
            points = np.take_along_axis(points, order[..., None], axis=2)
            valid = np.take_along_axis(valid, order, axis=2)
            points = np.where(valid[..., None], points, points[:, :, :1])
            nxt = np.roll(points, -1, axis=2)
            twice = (points[..., 0] * nxt[..., 1] - nxt[..., 0] * points[..., 1]).sum(-1)
            inter = np.where(count[..., 0] >= 3, np.abs(twice) / 2, 0.0)
            union = area1[r0:r0 + rows, None] + area2[None] - inter
            out[r0:r0 + rows] = np.where(union > 0, inter / union, 0.0)
    return out


def numpy_nms_rotated(boxes, scores, iou_threshold):
    """nms_rotated's definition with numpy: by descending score, each kept
    box removes the later boxes within reach of it (centres closer than the
    half diagonals) whose IoU with it (numpy_box_iou_rotated) exceeds the
    threshold."""
    boxes = np.asarray(boxes, np.float64)
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    b = boxes[order]
    reach = 0.5 * np.hypot(b[:, 2], b[:, 3])
    removed = np.zeros(len(b), bool)
    kept = []
    for i in range(len(b)):
        if removed[i]:
            continue
        kept.append(order[i])
        later = np.arange(i + 1, len(b))
        near = later[~removed[later] & (np.hypot(b[later, 0] - b[i, 0], b[later, 1] - b[i, 1])
                                        <= reach[i] + reach[later])]
        if len(near):
            removed[near[numpy_box_iou_rotated(b[i:i + 1], b[near])[0] > iou_threshold]] = True
    return np.array(kept, np.int64)


def rotated_boxes(cfg, n, seed=0):
    """n rotated boxes (float32): centres over the image, sides 16-400 px,
    any angle."""
    rng = np.random.default_rng(seed)
    img_h, img_w = cfg["image"]
    return np.concatenate([rng.uniform([0, 0], [img_w, img_h], (n, 2)),
                           rng.uniform(16, 400, (n, 2)), rng.uniform(-np.pi, np.pi, (n, 1))],
                          axis=1).astype(np.float32)


def rotated_cases(cfg, to_device=None, sync=None):
    """(name, ours, theirs, None) for box_iou_rotated and nms_rotated of
    boxes spread over an image: on the CPU against numpy_box_iou_rotated and
    numpy_nms_rotated; with to_device (arrays moved to a device, every timed
    call followed by sync(), as device_cases), ours alone."""
    on_device = to_device is not None
    move = to_device if on_device else (lambda a: a)
    done = sync if on_device else (lambda: None)
    n = cfg["rotated_boxes"]
    boxes = rotated_boxes(cfg, n)
    d_boxes = move(boxes)

    def iou():
        ops.box_iou_rotated(d_boxes, d_boxes)
        done()
    yield (f"box_iou_rotated {n}x{n}" + ("" if on_device else " (vs vectorised numpy)"), iou,
           None if on_device else lambda: numpy_box_iou_rotated(boxes, boxes), None)
    n = cfg["nms_boxes"]
    boxes = rotated_boxes(cfg, n, 1)
    scores = np.random.default_rng(2).random(n).astype(np.float32)
    d_boxes, d_scores = move(boxes), move(scores)

    def nms():
        ops.nms_rotated(d_boxes, d_scores, 0.5)
        done()

    def theirs():
        numpy_nms_rotated(boxes, scores, 0.5)
    theirs.single_run = True   # about a minute for 20,000 boxes
    yield (f"nms_rotated {n} boxes, IoU 0.5" +
           ("" if on_device else " (vs vectorised numpy, timed once)"), nms,
           None if on_device else theirs, None)


def numpy_soft_nms(boxes, scores, idxs, iou_threshold, sigma, min_score, method):
    """batched soft_nms's definition with numpy, in the boxes' dtype: each
    step selects the remaining box of highest score (the lowest index of
    equal ones; no NaN scores), decays the remaining boxes of its class by
    the method's weight of their IoU with it, and drops those below
    min_score. Returns (dets, inds)."""
    boxes = np.asarray(boxes)
    t = boxes.dtype.type
    x1, y1, x2, y2 = boxes.T
    area = (x2 - x1) * (y2 - y1)
    score = np.array(scores, copy=True)
    remaining = np.arange(len(boxes))
    inds = []
    dets = []
    while remaining.size:
        k = int(np.argmax(score[remaining]))   # remaining is ascending: the first of ties
        i = int(remaining[k])
        inds.append(i)
        dets.append((*boxes[i], score[i]))
        remaining = np.delete(remaining, k)
        same = remaining[idxs[remaining] == idxs[i]]
        w = np.maximum(np.minimum(x2[i], x2[same]) - np.maximum(x1[i], x1[same]), t(0))
        h = np.maximum(np.minimum(y2[i], y2[same]) - np.maximum(y1[i], y1[same]), t(0))
        inter = w * h
        union = area[i] + area[same] - inter
        with np.errstate(divide="ignore", invalid="ignore"):
            iou = np.where(union > 0, inter / union, t(0))
        if method == "gaussian":
            score[same] *= np.exp(-(iou * iou) / t(sigma))
        else:
            hit = iou.astype(np.float64) >= iou_threshold   # compared as the kernels do
            score[same[hit]] *= (t(1) - iou[hit]) if method == "linear" else t(0)
        remaining = remaining[~(score[remaining].astype(np.float64) < min_score)]
    return np.array(dets, boxes.dtype).reshape(-1, 5), np.array(inds, np.int64)


def soft_nms_cases(cfg, to_device=None, sync=None):
    """(name, ours, theirs, None): soft_nms (linear, IoU 0.5, min_score
    0.05, as detectors' test-time soft-NMS) of detections of one class and,
    batched, of 80 classes; on the CPU against numpy_soft_nms; with
    to_device (as rotated_cases), ours alone."""
    on_device = to_device is not None
    move = to_device if on_device else (lambda a: a)
    done = sync if on_device else (lambda: None)
    n = cfg["soft_nms_boxes"]
    boxes, scores = nms_workload(n, 3)
    for classes in (1, 80):
        idxs = np.random.default_rng(4).integers(0, classes, n)
        d_boxes, d_scores, d_idxs = move(boxes), move(scores), move(idxs)

        def ours(d_idxs=d_idxs, classes=classes):
            if classes == 1:
                ops.soft_nms(d_boxes, d_scores, 0.5, 0.5, 0.05, "linear")
            else:
                ops.batched_soft_nms(d_boxes, d_scores, d_idxs, 0.5, 0.5, 0.05, "linear")
            done()

        def theirs(idxs=idxs):
            numpy_soft_nms(boxes, scores, idxs, 0.5, 0.5, 0.05, "linear")
        name = "soft_nms" if classes == 1 else "batched soft_nms"
        yield (f"{name} {n} boxes, {classes} class{'es' if classes > 1 else ''}, linear" +
               ("" if on_device else " (vs vectorised numpy)"), ours,
               None if on_device else theirs, None)


def run_cuda(quick, repeat, tv):
    """The GPU benchmarks, or (None, reason) when they cannot run here."""
    cupy, reason = cuda_runtime()
    if cupy is None:
        return None, reason
    cfg = QUICK if quick else STANDARD
    theirs_device = None
    if tv is not None and tv[0].cuda.is_available():
        theirs_device = "cuda"

    def sync():
        cupy.cuda.Device().synchronize()

    rows = timed_rows(device_cases(cfg, cupy.asarray, sync, theirs_device, tv), repeat,
                      "CUDA ")
    rows += timed_rows(ps_cases(PS_QUICK if quick else PS_STANDARD, cupy.asarray, sync,
                                theirs_device, tv), repeat, "CUDA ")
    rows += timed_rows(deform_cases(DCN_QUICK if quick else DCN_STANDARD, cupy.asarray, sync,
                                    theirs_device, tv), repeat, "CUDA ")
    rows += timed_rows(tf32_cases(deform_cases(DCN_QUICK if quick else DCN_STANDARD,
                                               cupy.asarray, sync, theirs_device, tv), tv),
                       repeat, "CUDA ")
    msda = MSDA_QUICK if quick else MSDA_STANDARD
    rows += timed_rows(msda_cases(msda, cupy.asarray, sync, theirs_device, tv), repeat, "CUDA ")

    rows += timed_rows(mmcv_focal_cases(cfg, cupy.asarray, sync, theirs_device, tv), repeat,
                       "CUDA ")
    rows += timed_rows(rotated_cases(cfg, cupy.asarray, sync), repeat, "CUDA ")
    rows += timed_rows(soft_nms_cases(cfg, cupy.asarray, sync), repeat, "CUDA ")
    rows += timed_rows([(deterministic_name(name), deterministic(fn), None, traffic)
                        for cases in (device_cases(cfg, cupy.asarray, sync),
                                      msda_cases(msda, cupy.asarray, sync))
                        for name, fn, _, traffic in cases
                        if name.endswith("backward")], repeat, "CUDA ")
    peak = peak_bandwidth(cupy)
    for row in rows:
        row["peak_bandwidth"] = peak
    progress("bench: CUDA host-side cost per call ...")
    theirs = None
    if theirs_device is not None:
        torch, torchvision = tv
        t_x = torch.zeros((1, 1, 4, 4), device="cuda")
        t_rois = torch.tensor([[0, 0, 0, 3, 3]], dtype=torch.float32, device="cuda")

        def theirs():
            torchvision.ops.roi_align(t_x, t_rois, 1, 1.0, 2, True)

    costs = device_call_costs(cupy.asarray, sync, "cuda", theirs=theirs)
    for name, (seconds, their_seconds) in costs.items():
        rows.append(result_row(f"CUDA {name}", "s/call", seconds, their_seconds))
    progress("bench: CUDA call behind a long kernel ...")
    early, seconds = returns_before_queued_work(cupy)
    rows.append(result_row("CUDA roi_align forward+backward behind a long kernel: returned "
                           f"before it finished: {'yes' if early else 'NO'}", "s/call", seconds))
    return rows, None


def run(quick=False, repeat=None, gpu_only=False):
    cfg = QUICK if quick else STANDARD
    repeat = repeat or (3 if quick else 5)
    tv = torchvision_ops()
    rows = []
    overhead_ns, sweep = None, []

    def record(name, ours, theirs, unit):
        rows.append(result_row(name, unit, ours, theirs))

    if not gpu_only:
        overhead_ns, sweep = run_cpu(cfg, quick, repeat, tv, rows)
    progress("bench: import time ...")
    ours_import, numpy_import = import_seconds(max(repeat, 5))
    record("import mmdispatch (fresh interpreter)", ours_import, None, "s")
    record("import numpy (fresh interpreter, reference point)", numpy_import, None, "s")
    cuda_rows, cuda_skipped = run_cuda(quick, repeat, tv)
    rows += cuda_rows or []
    torch_rows, torch_skipped = run_torch(quick, repeat, tv, gpu_only)
    rows += torch_rows or []
    dask_skipped = "--gpu-only" if gpu_only else None
    if not gpu_only:
        dask_times, dask_skipped = dask_scaling(quick, repeat)
        for name, by_workers in (dask_times or {}).items():
            # the ratio column: 1 worker's time / 2 workers' time, the speed-up
            record(f"{name}, 2 workers (vs 1)", by_workers[2], by_workers[1], "s")
        progress("bench: peak memory of a forward call ...")
        feature, rois = roi_workload(cfg)
        out_bytes = rois.shape[0] * feature.shape[1] * cfg["output"] ** 2 * feature.itemsize
        for sr in (2, 0):
            extra = peak_extra_bytes(lambda: ops.roi_align(feature, rois, cfg["output"],
                                                           cfg["spatial_scale"], sr), out_bytes)
            record(f"roi_align sampling_ratio={sr} forward: peak memory beyond the output",
                   extra, None, "bytes")
    return {
        "workload": ("quick" if quick else "standard") + (", GPU rows only" if gpu_only else ""),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "repeat": repeat,
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "python": platform.python_version(), "numpy": np.__version__,
                    "cpu_status": next(d["status"] for d in mmdispatch.devices()
                                       if d["device"] == "cpu"),
                    "cpu_products": f"{mmdispatch._core.gemm_provider()}; register tiles "
                                    f"{mmdispatch._core.cpu_tiles()}"},
        "torchvision": None if tv is None else tv[1].__version__,
        "cuda_skipped": cuda_skipped,
        "torch_skipped": torch_skipped,
        "dask_skipped": dask_skipped,
        "results": rows,
        "overhead": {"overhead_ns": overhead_ns, "sweep": sweep},
    }


def run_cpu(cfg, quick, repeat, tv, rows):
    """Appends the CPU rows to `rows`; returns (dispatch overhead in ns, the
    overhead-fraction sweep)."""

    def record(name, ours, theirs, unit):
        rows.append(result_row(name, unit, ours, theirs))

    rows += timed_rows(device_cases(cfg, np.asarray, lambda: None,
                                    "cpu" if tv is not None else None, tv), repeat)
    rows += timed_rows(ps_cases(PS_QUICK if quick else PS_STANDARD, np.asarray, lambda: None,
                                "cpu" if tv is not None else None, tv), repeat)
    rows += timed_rows(deform_cases(DCN_QUICK if quick else DCN_STANDARD, np.asarray,
                                    lambda: None, "cpu" if tv is not None else None, tv), repeat)
    rows += timed_rows(msda_cases(MSDA_QUICK if quick else MSDA_STANDARD, np.asarray,
                                  lambda: None, "cpu" if tv is not None else None, tv), repeat)
    rows += timed_rows(mmcv_focal_cases(cfg, np.asarray, lambda: None,
                                        "cpu" if tv is not None else None, tv), repeat)
    rows += timed_rows(rotated_cases(cfg), repeat)
    rows += timed_rows(soft_nms_cases(cfg), repeat)
    for name, fn, theirs_fn in call_cost_cases(tv):
        progress(f"bench: {name} ...")
        theirs = median_call(theirs_fn, max(repeat, 5)) if theirs_fn else None
        record(name, median_call(fn, max(repeat, 5)), theirs, "s/call")
    progress("bench: dispatch overhead (no-op kernel vs raw call) ...")
    dispatched_ns, raw_ns, overhead_ns = dispatch_overhead(repeat)
    record("no-op kernel through roi_align_forward_impl", dispatched_ns * 1e-9, None, "s/call")
    record("no-op kernel, raw Cython call", raw_ns * 1e-9, None, "s/call")
    record("dispatch overhead (difference)", overhead_ns * 1e-9, None, "s/call")
    progress("bench: hook cost (tiny roi_align with trace() / profile() active) ...")
    plain, traced, profiled = hook_cost(repeat)
    record("roi_align call, tiny input, mmdispatch.trace(no-op) active (vs none)", traced,
           plain, "s/call")
    record("roi_align call, tiny input, mmdispatch.profile() active (vs none)", profiled,
           plain, "s/call")
    progress("bench: overhead fraction sweep ...")
    sweep = overhead_sweep(overhead_ns, quick, repeat)
    progress("bench: tail latency of a mid-size call, idle and under load ...")
    for when, (p50, p99) in tail_latency(quick).items():
        record(f"mid-size roi_align call p50, {when}", p50, None, "s/call")
        record(f"mid-size roi_align call p99, {when}", p99, None, "s/call")
    return overhead_ns, sweep


def format_value(value, unit):
    if value is None:
        return "-"
    if unit == "bytes":
        return f"{value / 2**20:.2f} MiB"
    if unit == "s/call":
        return f"{value * 1e9:.0f} ns" if value < 1e-6 else f"{value * 1e6:.2f} µs"
    if value < 0.1:   # GPU rows take tens of µs: three digits where 0.0000 s said nothing
        return f"{value * 1e3:.3g} ms"
    return f"{value:.4f} s"


def table(report):
    lines = [f"workload: {report['workload']}, median of {report['repeat']} runs; "
             f"torchvision: {report['torchvision'] or 'not installed'}",
             f"machine: {report['machine']['platform']}; CPU {report['machine']['cpu_status']}",
             *([f"CPU matrix products: {report['machine']['cpu_products']}"]
               if report["machine"].get("cpu_products") else []),
             *([f"CUDA benchmarks skipped: {report['cuda_skipped']}"]
               if report.get("cuda_skipped") else []),
             *([f"PyTorch benchmarks skipped: {report['torch_skipped']}"]
               if report.get("torch_skipped") else []),
             *([f"Dask benchmarks skipped: {report['dask_skipped']}"]
               if report.get("dask_skipped") else []),
             "",
             "| benchmark | mmdispatch | torchvision | torchvision / mmdispatch |",
             "|---|---|---|---|"]
    for row in report["results"]:
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
        lines.append(f"| {row['benchmark']} | {format_value(row['mmdispatch'], row['unit'])} | "
                     f"{format_value(row['torchvision'], row['unit'])} | {ratio} |")
    # a GPU row without a least traffic (soft_nms, ...) has no bandwidth
    gpu = [row for row in report["results"] if "peak_bandwidth" in row and row["bytes"]]
    if gpu:
        peak = gpu[0]["peak_bandwidth"]
        lines += ["", f"CUDA achieved memory bandwidth (least traffic / time; device peak "
                      f"{peak / 1e9:.0f} GB/s)" if peak else
                  "CUDA achieved memory bandwidth (least traffic / time; peak unknown)",
                  "", "| kernel | traffic | mmdispatch | of peak | torchvision | of peak |",
                  "|---|---|---|---|---|---|"]
        for row in gpu:
            cells = []
            for seconds in (row["mmdispatch"], row["torchvision"]):
                rate = row["bytes"] / seconds if seconds else None
                cells += [f"{rate / 1e9:.0f} GB/s" if rate else "-",
                          f"{rate / peak * 100:.1f} %" if rate and peak else "-"]
            lines.append(f"| {row['benchmark']} | {row['bytes'] / 2**20:.0f} MiB | "
                         + " | ".join(cells) + " |")
    if report["overhead"]["sweep"]:
        lines += ["", "| roi_align_forward_impl call (N, C, H, W; rois; 7x7) | time | "
                  "dispatch overhead share |", "|---|---|---|"]
    for p in report["overhead"]["sweep"]:
        lines.append(f"| {tuple(p['shape'])}; {p['rois']} | "
                     f"{format_value(p['seconds'], 's/call')} | "
                     f"{p['overhead_fraction'] * 100:.3g} % |")
    return "\n".join(lines)


# a row as result_row prints it on stderr: "bench: = NAME: OURS[, theirs THEIRS (R.RRx)]"
_VALUE = r"(?:-|[-+0-9.e]+ (?:ns|µs|ms|s|MiB))"
_PRINTED_ROW = re.compile(rf"^bench: = (?P<name>.+): (?P<ours>{_VALUE})"
                          rf"(?:, theirs (?P<theirs>{_VALUE}) \([-+0-9.e]+x\))?$")
_SCALE = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "MiB": 2.0 ** 20}


def _printed_value(text):
    if text is None or text == "-":
        return None
    number, unit = text.split(" ")
    return float(number) * _SCALE[unit]


def load_results(path):
    """{benchmark: row} of a run: its --json file, or the log of its
    stderr, whose progress lines hold each row as it was measured (a run cut
    short by its time has those and no JSON). Printed values carry three
    digits."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        return {row["benchmark"]: row for row in json.loads(text)["results"]}
    rows = {}
    for line in text.splitlines():
        match = _PRINTED_ROW.match(line.strip())
        if match:
            ours, theirs = _printed_value(match["ours"]), _printed_value(match["theirs"])
            rows[match["name"]] = {"benchmark": match["name"], "mmdispatch": ours,
                                   "torchvision": theirs,
                                   "unit": "bytes" if match["ours"].endswith("MiB") else "s",
                                   "ratio": theirs / ours if theirs and ours else None}
    if not rows:
        raise ValueError(f"{path}: neither a bench --json file nor a bench log with rows")
    return rows


def _change(new, old):
    return new / old - 1 if new is not None and old else None


def compare_table(base, new, threshold=0.05, names=("base", "new")):
    """Markdown table of the rows of two runs (load_results), in the new
    run's order: our figure in each, its change, torchvision's change between
    the runs (how far the machine itself drifted), and the ratio to
    torchvision in each. A row whose figure changed by more than `threshold`
    (a fraction) beyond torchvision's own drift, where it has one, is marked
    slower or faster (lower is better: every row is a time or a memory)."""
    def percent(change):
        return "-" if change is None else f"{change * 100:+.1f} %"

    def ratio(row):
        return "-" if row.get("ratio") is None else f"{row['ratio']:.2f}x"

    a, b = names
    lines = [f"| benchmark | {a} | {b} | change | torchvision's change | {a} vs torchvision | "
             f"{b} vs torchvision | verdict |", "|---|---|---|---|---|---|---|---|"]
    for name, row in new.items():
        if name not in base:
            continue
        old = base[name]
        ours = _change(row["mmdispatch"], old["mmdispatch"])
        drift = _change(row.get("torchvision"), old.get("torchvision"))
        verdict = ""
        if ours is not None:
            beyond = (1 + ours) / (1 + drift) - 1 if drift is not None and drift > -1 else ours
            if beyond > threshold and ours > threshold:
                verdict = "slower"
            elif beyond < -threshold and ours < -threshold:
                verdict = "faster"
        lines.append(f"| {name} | {format_value(old['mmdispatch'], row['unit'])} | "
                     f"{format_value(row['mmdispatch'], row['unit'])} | {percent(ours)} | "
                     f"{percent(drift)} | {ratio(old)} | {ratio(row)} | {verdict} |")
    for label, only in ((f"only in {a}", [n for n in base if n not in new]),
                        (f"only in {b}", [n for n in new if n not in base])):
        if only:
            lines += ["", f"{label}: " + "; ".join(only)]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mmdispatch bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small workload, for smoke tests (well under a minute)")
    parser.add_argument("--gpu-only", action="store_true",
                        help="only the GPU rows (and import time): no CPU, Dask or memory rows")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per benchmark")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--plot", default=None,
                        help="write the overhead-fraction plot to this PNG (needs matplotlib)")
    parser.add_argument("--compare", nargs=2, metavar=("BASE", "NEW"), default=None,
                        help="run nothing: compare two earlier runs, each its --json file or "
                             "the log of its stderr (a run cut short has only that)")
    parser.add_argument("--threshold", type=float, default=5.0,
                        help="with --compare: the change, in percent beyond torchvision's "
                             "own, that marks a row slower or faster (default 5)")
    args = parser.parse_args(argv)
    if args.compare:
        try:
            base, new = (load_results(path) for path in args.compare)
        except (OSError, ValueError, KeyError) as e:
            parser.error(f"--compare: {e}")
        names = tuple(os.path.basename(path) for path in args.compare)
        print(compare_table(base, new, args.threshold / 100, names))
        return 0
    if args.gpu_only and args.plot:
        parser.error("--plot draws the CPU overhead sweep, which --gpu-only leaves out")
    report = run(quick=args.quick, repeat=args.repeat, gpu_only=args.gpu_only)
    print(table(report))
    if args.plot:
        if plot_overhead(report, args.plot):
            progress(f"bench: plot written to {args.plot}")
        else:
            progress("bench: matplotlib is not installed; no plot written")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        progress(f"bench: results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
