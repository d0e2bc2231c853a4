"""python -m mmdispatch {info,demo}"""
import argparse
import sys

import numpy as np

import mmdispatch


def registry_matrix():
    """Text table: one row per op, one column per device/backend slot that
    any op fills, each cell naming who registered the active kernel."""
    rows = [r for r in mmdispatch.registry_table() if r["active"]]
    columns = sorted({(r["device"], r["backend"]) for r in rows})
    ops = sorted(mmdispatch.op_signatures())
    cell = {(r["op"], r["device"], r["backend"]): f"{r['kind']} {r['origin']}" for r in rows}
    header = ["op"] + [f"{d}/{b}" for d, b in columns]
    body = [[op] + [cell.get((op, d, b), "-") for d, b in columns] for op in ops]
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*line) for line in [header] + body)


def info():
    print(f"mmdispatch {mmdispatch.__version__}")
    print("build:")
    for key, value in mmdispatch.build_info().items():
        print(f"  {key}: {value}")
    print("devices at run time:")
    for dev in mmdispatch.devices():
        print(f"  {dev['device']}: {dev['status']}")
    print("backends:", ", ".join(mmdispatch.backends()))
    print("registry (active kernel per op and device/backend):")
    print(registry_matrix())


def demo_data(dtype=np.float32):
    """A seeded feature map and 64 rois, some partly outside the map."""
    rng = np.random.default_rng(0)
    feature = rng.standard_normal((2, 16, 32, 48)).astype(dtype)
    centres = rng.uniform([0, 0], [48 * 4, 32 * 4], size=(64, 2))
    sizes = rng.uniform(8, 96, size=(64, 2))
    boxes = np.concatenate([centres - sizes / 2, centres + sizes / 2], axis=1)
    batch = rng.integers(0, 2, size=(64, 1))
    rois = np.concatenate([batch, boxes], axis=1).astype(dtype)
    return feature, rois


def demo():
    from mmdispatch.ops import roi_align_backward, roi_align_forward

    print(registry_matrix())
    print()
    ok = True
    mmcv_input = np.array([[[[1, 2, 5, 6], [3, 4, 7, 8], [9, 10, 13, 14], [11, 12, 15, 16]]]],
                          dtype=np.float64)
    mmcv_rois = np.array([[0, 0, 0, 3, 3]], dtype=np.float64)
    out, _, _ = roi_align_forward(mmcv_input, mmcv_rois, (2, 2), 1.0, 2, "avg", True)
    grad = roi_align_backward(np.ones_like(out), mmcv_rois, None, None, mmcv_input.shape, 1.0, 2)
    expected_out = np.array([[1.9375, 4.75], [7.5625, 10.375]])
    expected_grad = np.array([0.47265625, 0.4296875, 0.4296875, 0.04296875])
    good = np.allclose(out[0, 0], expected_out) and np.allclose(grad[0, 0, 0], expected_grad)
    ok &= good
    print(f"cpu    MMCV published roi_align values: {'match' if good else 'MISMATCH'}")

    feature, rois = demo_data()
    results = {}
    for backend in ("reference", "default"):
        with mmdispatch.use_backend("cpu", backend):
            for mode in ("avg", "max"):
                results[backend, mode] = roi_align_forward(feature, rois, (7, 7), 0.25, 2, mode)
    for mode in ("avg", "max"):
        diff = float(np.max(np.abs(results["default", mode][0] - results["reference", mode][0])))
        good = diff <= 1e-5
        ok &= good
        print(f"cpu    roi_align {mode}: default vs reference backend, "
              f"{rois.shape[0]} rois, max |diff| = {diff:.2e} {'ok' if good else 'FAIL'}")

    cuda = next((d for d in mmdispatch.devices() if d["device"] == "cuda"), None)
    cupy = None
    if cuda is None or not cuda["available"]:
        print(f"cuda   skipped: {cuda['status'] if cuda else 'no CUDA device module'}")
    else:
        try:
            import cupy
        except ImportError:
            print("cuda   skipped: CUDA kernels are registered but CuPy is not installed")
    if cupy is not None:
        for mode in ("avg", "max"):
            out_gpu = roi_align_forward(cupy.asarray(feature), cupy.asarray(rois), (7, 7), 0.25, 2,
                                        mode)[0]
            diff = float(np.max(np.abs(cupy.asnumpy(out_gpu) - results["default", mode][0])))
            good = diff <= 1e-4
            ok &= good
            print(f"cuda:0 roi_align {mode}: CUDA vs CPU, max |diff| = {diff:.2e} "
                  f"{'ok' if good else 'FAIL'}")
    print("demo:", "all checks passed" if ok else "CHECKS FAILED")
    return 0 if ok else 1


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mmdispatch")
    parser.add_argument("command", choices=["info", "demo"], nargs="?", default="info")
    args = parser.parse_args(argv)
    if args.command == "info":
        info()
        return 0
    return demo()


if __name__ == "__main__":
    sys.exit(main())
