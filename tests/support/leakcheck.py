#!/usr/bin/env python3
"""Checks that many small dispatches keep the resident set flat.

    python tests/support/leakcheck.py                  # a million calls
    python tests/support/leakcheck.py --calls 20000 --max-growth-kib 8192 --json out.json

Cycles through small calls of every kind the dispatcher handles, answered
and refused: numpy arrays on the fast path and strided ones, DLPack-only
arrays (a capsule made and freed per call), a Python kernel, a C kernel
capsule, user functions (outputs allocated per call), and the error paths:
bad dtype (the kernel's TypeError), a non-array argument, a read-only
output, an output overlapping an input, a bad scalar, a bad roi, a device
mismatch (an object whose __dlpack_device__ says (2, 0)) and
KernelNotFoundError (every array on a device without kernels), plus
registering and removing a kernel. RSS is read from /proc/self/statm at the
start, after a warm-up (10% of the calls) and every 10% after it; growth is
measured from the warm-up. Exit status 1 when it exceeds --max-growth-kib.
"""
import argparse
import gc
import json
import os
import sys
import time

import numpy as np

import mmdispatch
from mmdispatch import _benchkit, ops
from stand_ins import DLPackOnly, FakeDeviceArray   # beside this file

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE // 1024


def calls():
    """(name, fn, expected exception or None)."""
    x = np.arange(1 * 2 * 4 * 4, dtype=np.float32).reshape(1, 2, 4, 4)
    rois = np.array([[0, 0, 0, 3, 3]], np.float32)
    out = np.zeros((1, 2, 2, 2), np.float32)
    empty = np.zeros((0,), np.float32)
    scalars = (2, 2, 1.0, 2, 1, True)
    boxes = np.array([[0, 0, 2, 2], [1, 1, 3, 3], [4, 4, 5, 5]], np.float64)
    scores = np.array([0.9, 0.8, 0.1])
    keep, count = np.zeros(3, np.int64), np.zeros(1, np.int64)
    ious = np.zeros((3, 3))
    logits, target = np.zeros((2, 3)), np.array([0, 3])
    loss = np.zeros((2, 3))
    strided = np.zeros((3, 8))[:, ::2]
    read_only = out.copy()
    read_only.flags.writeable = False
    shared = np.zeros(64, np.float32)
    fake = [FakeDeviceArray(7, 0) for _ in range(5)]
    fwd = mmdispatch.roi_align_forward_impl
    capsule = _benchkit.noop_roi_align_forward_kernel()
    python_kernel = mmdispatch.register_impl("bbox_overlaps_impl", "metal",
                                             lambda *args: None)
    metal = [FakeDeviceArray(8, 0) for _ in range(3)]
    bad_rois = np.array([[0, np.nan, 0, 3, 3]], np.float32)

    def register_and_remove():
        mmdispatch.register_impl("nms_impl", "opencl", lambda *a: None).remove()

    def c_capsule_kernel():
        with mmdispatch.register_impl("roi_align_forward_impl", "cpu", capsule,
                                      backend="leakcheck"):
            with mmdispatch.use_backend("cpu", "leakcheck"):
                fwd(x, rois, out, empty, empty, *scalars)

    return [
        ("roi_align_forward_impl", lambda: fwd(x, rois, out, empty, empty, *scalars), None),
        ("nms_impl", lambda: mmdispatch.nms_impl(boxes, scores, None, keep, count, 0.5, 0), None),
        ("bbox_overlaps_impl", lambda: mmdispatch.bbox_overlaps_impl(boxes, boxes, ious, 0,
                                                                     False, 0), None),
        ("sigmoid_focal_loss_forward_impl",
         lambda: mmdispatch.sigmoid_focal_loss_forward_impl(logits, target, None, loss, 2.0,
                                                            0.25), None),
        ("dlpack arrays", lambda: fwd(DLPackOnly(x), DLPackOnly(rois), DLPackOnly(out), empty,
                                      empty, *scalars), None),
        ("ops.roi_align", lambda: ops.roi_align(x, rois, 2, 1.0, 2), None),
        ("ops.nms", lambda: ops.nms(boxes, scores, 0.5), None),
        ("ops.sigmoid_focal_loss", lambda: ops.sigmoid_focal_loss(logits, target), None),
        ("python kernel", lambda: mmdispatch.bbox_overlaps_impl(*metal, 0, False, 0), None),
        ("C kernel capsule, registered and removed", c_capsule_kernel, None),
        ("register + remove", register_and_remove, None),
        ("bad dtype", lambda: fwd(x.astype(np.int32), rois, out, empty, empty, *scalars),
         TypeError),
        ("not an array", lambda: fwd([1.0], rois, out, empty, empty, *scalars), TypeError),
        ("strided input", lambda: mmdispatch.bbox_overlaps_impl(strided, boxes[:, :],
                                                                 np.zeros((3, 3)), 0, False, 0),
         ValueError),
        ("read-only output", lambda: fwd(x, rois, read_only, empty, empty, *scalars),
         ValueError),
        ("overlapping output",
         lambda: fwd(x, shared[:5].reshape(1, 5), shared[4:12].reshape(1, 2, 2, 2), empty,
                     empty, *scalars), ValueError),
        ("bad scalar", lambda: fwd(x, rois, out, empty, empty, 2, 2, "1.0", 2, 1, True),
         TypeError),
        ("bad roi", lambda: fwd(x, bad_rois, out, empty, empty, *scalars), ValueError),
        ("device mismatch",
         lambda: fwd(x, rois, FakeDeviceArray(2, 0), empty, empty, *scalars),
         mmdispatch.DeviceMismatchError),
        ("kernel not found", lambda: fwd(*fake, *scalars), mmdispatch.KernelNotFoundError),
        ("ops error", lambda: ops.roi_align(x, rois, 0), ValueError),
    ], python_kernel


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--max-growth-kib", type=int, default=4096,
                        help="allowed RSS growth after the warm-up")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    start_kib = rss_kib()
    table, handle = calls()
    for name, fn, error in table:  # each call does what it should, once
        try:
            fn()
            assert error is None, f"{name}: expected {error.__name__}"
        except AssertionError:
            raise
        except Exception as exc:
            assert error is not None and isinstance(exc, error), f"{name}: {exc!r}"
    n = len(table)
    warm_up = max(args.calls // 10, n)
    samples = []
    started = time.perf_counter()
    for i in range(args.calls):
        name, fn, error = table[i % n]
        if error is None:
            fn()
        else:
            try:
                fn()
            except error:
                pass
        if i + 1 == warm_up or (i + 1 > warm_up and (i + 1 - warm_up) % warm_up == 0):
            gc.collect()
            samples.append((i + 1, rss_kib()))
    elapsed = time.perf_counter() - started
    handle.remove()
    warm_kib = samples[0][1]
    end_kib = samples[-1][1]
    growth = end_kib - warm_kib
    per_call = growth * 1024 / max(args.calls - warm_up, 1)
    print(f"leakcheck: {args.calls} calls ({n} kinds, {sum(e is not None for *_, e in table)} "
          f"of them errors) in {elapsed:.1f} s, {elapsed / args.calls * 1e6:.2f} us per call")
    print(f"RSS at start {start_kib} KiB, after warm-up ({warm_up} calls) {warm_kib} KiB, "
          f"at end {end_kib} KiB: growth after warm-up {growth} KiB "
          f"({per_call:.3f} bytes per call)")
    print("RSS samples (calls: KiB): " + ", ".join(f"{c}: {k}" for c, k in samples))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(calls=args.calls, kinds=n, seconds=elapsed, start_kib=start_kib,
                           warm_kib=warm_kib, end_kib=end_kib, growth_kib=growth,
                           samples=samples), f)
    ok = growth <= args.max_growth_kib
    print("OK" if ok else f"FAIL: growth {growth} KiB > {args.max_growth_kib} KiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
