"""Benchmarks of the CPU kernels and of the per-call cost, on issue 4's
standard workload, side by side with torchvision when it is installed.

    python -m mmdispatch bench [--quick] [--json PATH] [--repeat N]

Every figure is the median of `repeat` timed runs (after one warm-up run).
Ratios are torchvision / mmdispatch measured in the same run; without
torchvision the table shows only our figures. Timings are never asserted
anywhere: CI may run --quick as a smoke test.
"""
import argparse
import json
import platform
import statistics
import sys
import time
import timeit

import numpy as np

import mmdispatch
from mmdispatch import ops

# Standard workload: an FPN P2 level of an 800x1216 image, 512 rois per image.
STANDARD = dict(batch=2, channels=256, height=200, width=304, rois_per_image=512,
                image=(800, 1216), spatial_scale=0.25, output=7, nms_boxes=20000)
QUICK = dict(STANDARD, channels=32, rois_per_image=128, nms_boxes=4000)


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


def nms_workload(n, seed=0):
    """Corners uniform in [0, 1000), sides uniform in [8, 200], random scores."""
    rng = np.random.default_rng(seed)
    corner = rng.uniform(0, 1000, size=(n, 2))
    side = rng.uniform(8, 200, size=(n, 2))
    boxes = np.concatenate([corner, corner + side], axis=1).astype(np.float32)
    return boxes, rng.random(n).astype(np.float32)


def median_time(fn, repeat):
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


def torchvision_ops():
    try:
        import torch
        import torchvision
    except ImportError:
        return None
    return torch, torchvision


def roi_align_cases(cfg, tv):
    feature, rois = roi_workload(cfg)
    scale, size = cfg["spatial_scale"], cfg["output"]
    for sr in (2, 0):
        def forward():
            return ops.roi_align_forward(feature, rois, size, scale, sr, "avg", True)[0]

        out = forward()
        grad = np.ones_like(out)

        def forward_backward():
            forward()
            ops.roi_align_backward(grad, rois, None, None, feature.shape, scale, sr, "avg", True)

        theirs_fwd = theirs_fb = None
        if tv is not None:
            torch, torchvision = tv
            t_feature = torch.from_numpy(feature)
            t_rois = torch.from_numpy(rois)

            def theirs_forward():
                with torch.no_grad():
                    torchvision.ops.roi_align(t_feature, t_rois, size, scale, sr, True)

            def theirs_forward_backward():
                x = t_feature.clone().requires_grad_(True)
                torchvision.ops.roi_align(x, t_rois, size, scale, sr, True).sum().backward()

            theirs_fwd, theirs_fb = theirs_forward, theirs_forward_backward
        label = f"roi_align sampling_ratio={sr}"
        yield f"{label} forward", forward, theirs_fwd
        yield f"{label} forward+backward", forward_backward, theirs_fb


def nms_case(cfg, tv):
    boxes, scores = nms_workload(cfg["nms_boxes"])
    theirs = None
    if tv is not None:
        torch, torchvision = tv
        t_boxes, t_scores = torch.from_numpy(boxes), torch.from_numpy(scores)

        def theirs():
            torchvision.ops.nms(t_boxes, t_scores, 0.5)
    return f"nms {cfg['nms_boxes']} boxes, IoU 0.5", lambda: ops.nms(boxes, scores, 0.5), theirs


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


def run(quick=False, repeat=None):
    cfg = QUICK if quick else STANDARD
    repeat = repeat or (3 if quick else 5)
    tv = torchvision_ops()
    rows = []

    def record(name, ours, theirs, unit):
        rows.append({"benchmark": name, "unit": unit, "mmdispatch": ours,
                     "torchvision": theirs,
                     "ratio": (theirs / ours) if theirs is not None else None})

    for name, fn, theirs_fn in roi_align_cases(cfg, tv):
        progress(f"bench: {name} ...")
        theirs = median_time(theirs_fn, repeat) if theirs_fn else None
        record(name, median_time(fn, repeat), theirs, "s")
    name, fn, theirs_fn = nms_case(cfg, tv)
    progress(f"bench: {name} ...")
    theirs = median_time(theirs_fn, repeat) if theirs_fn else None
    record(name, median_time(fn, repeat), theirs, "s")
    for name, fn, theirs_fn in call_cost_cases(tv):
        progress(f"bench: {name} ...")
        theirs = median_call(theirs_fn, max(repeat, 5)) if theirs_fn else None
        record(name, median_call(fn, max(repeat, 5)), theirs, "s/call")
    return {
        "workload": "quick" if quick else "standard",
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "repeat": repeat,
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "python": platform.python_version(), "numpy": np.__version__,
                    "cpu_status": next(d["status"] for d in mmdispatch.devices()
                                       if d["device"] == "cpu")},
        "torchvision": None if tv is None else tv[1].__version__,
        "results": rows,
    }


def format_value(value, unit):
    if value is None:
        return "-"
    return f"{value * 1e6:.2f} µs" if unit == "s/call" else f"{value:.4f} s"


def table(report):
    lines = [f"workload: {report['workload']}, median of {report['repeat']} runs; "
             f"torchvision: {report['torchvision'] or 'not installed'}",
             f"machine: {report['machine']['platform']}; CPU {report['machine']['cpu_status']}",
             "",
             "| benchmark | mmdispatch | torchvision | torchvision / mmdispatch |",
             "|---|---|---|---|"]
    for row in report["results"]:
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
        lines.append(f"| {row['benchmark']} | {format_value(row['mmdispatch'], row['unit'])} | "
                     f"{format_value(row['torchvision'], row['unit'])} | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mmdispatch bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small workload, for smoke tests (well under a minute)")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per benchmark")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    report = run(quick=args.quick, repeat=args.repeat)
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        progress(f"bench: results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
