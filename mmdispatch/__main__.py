"""mmdispatch {info,demo,bench} (also python -m mmdispatch)."""
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
    print("CPU matrix products:", mmdispatch._core.gemm_provider(),
          f"(register tiles of our own: {mmdispatch._core.cpu_tiles()})")
    print("float32 matmul precision (CUDA cuBLAS products; mmdispatch.torch follows torch's):",
          mmdispatch.get_float32_matmul_precision())
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


def published_checks():
    """(name, good) for MMCV's published values of every op, on the CPU."""
    from mmdispatch import ops

    mmcv_input = np.array([[[[1, 2, 5, 6], [3, 4, 7, 8], [9, 10, 13, 14], [11, 12, 15, 16]]]],
                          dtype=np.float64)
    mmcv_rois = np.array([[0, 0, 0, 3, 3]], dtype=np.float64)
    out, _, _ = ops.roi_align_forward(mmcv_input, mmcv_rois, (2, 2), 1.0, 2, "avg", True)
    grad = ops.roi_align_backward(np.ones_like(out), mmcv_rois, None, None, mmcv_input.shape,
                                  1.0, 2)
    yield "roi_align", (np.allclose(out[0, 0], [[1.9375, 4.75], [7.5625, 10.375]])
                        and np.allclose(grad[0, 0, 0], [0.47265625, 0.4296875, 0.4296875,
                                                        0.04296875]))
    boxes = np.array([[6, 3, 8, 7], [3, 6, 9, 11], [3, 7, 10, 12], [1, 4, 13, 7]], np.float32)
    scores = np.array([0.6, 0.9, 0.7, 0.2], np.float32)
    yield "nms", ops.nms(boxes, scores, 0.3).tolist() == [1, 0, 3]
    ious = ops.bbox_overlaps(np.array([[1, 1, 3, 4], [2, 2, 3, 4], [7, 7, 8, 8]], np.float32),
                             np.array([[0, 2, 2, 5], [2, 1, 3, 3]], np.float32), offset=1)
    yield "bbox_overlaps", np.allclose(ious, [[0.33333334, 0.5], [0.2, 0.5], [0, 0]])
    loss = ops.sigmoid_focal_loss(np.array([[1, 0], [0, 1]], np.float32), np.array([0, 1]))
    yield "sigmoid_focal_loss", bool(np.isclose(loss, 0.13562961))
    loss = ops.softmax_focal_loss(np.array([[1, 0], [0, 1]], np.float32), np.array([0, 1]))
    yield "softmax_focal_loss", bool(np.isclose(loss, 0.00566451))
    # DeformConv2dPack's case: offsets from a 2x2 convolution (8 channels) of the map
    x = np.array([[[[1.0, 2, 3], [0, 1, 2], [3, 5, 2]]]])
    offset_weight = np.array([[0.1, 0.4, 0.6, 0.1], [0.3, 0.2, 0.1, 0.3], [0.5, 0.5, 0.2, 0.8],
                              [0.8, 0.3, 0.9, 0.1], [0.3, 0.1, 0.2, 0.5], [0.3, 0.7, 0.5, 0.3],
                              [0.6, 0.2, 0.5, 0.3], [0.4, 0.1, 0.8, 0.4]]).reshape(8, 2, 2)
    offset_bias = np.array([0.7, 0.1, 0.8, 0.5, 0.6, 0.5, 0.4, 0.7])
    offset = np.stack([np.stack([offset_bias + (offset_weight * x[0, 0, i:i + 2, j:j + 2])
                                 .sum((1, 2)) for j in range(2)], -1) for i in range(2)], -2)
    weight = np.array([0.4, 0.2, 0.1, 0.9]).reshape(1, 1, 2, 2)
    out = ops.deform_conv2d(x, offset[None], weight)
    grad_weight = ops.deform_conv2d_backward(np.ones_like(out), x, offset[None], weight)[3]
    yield "deform_conv2d", (np.allclose(out, [[[[1.65, 0], [0, 0]]]])
                            and np.allclose(grad_weight, [[[[3.62, 0], [0.40, 0.18]]]]))


def run_ops(feature, rois, scores, logits, targets, cupy=None):
    """Every op on the demo data (numpy, or CuPy arrays when cupy is given),
    results as numpy arrays."""
    from mmdispatch import ops

    to_host = (lambda a: a) if cupy is None else cupy.asnumpy
    xp = np if cupy is None else cupy
    boxes = rois[:, 1:]
    # deformable convolution: offsets and a mask made from the map itself
    offset = 0.5 * xp.concatenate([feature, feature[:, :2]], axis=1)
    mask = xp.abs(feature[:, :9])
    weight = 0.01 * feature[:, :, :3, :3]   # 2 output channels
    # the boxes turned by an angle made from their scores: (cx, cy, w, h, angle)
    rotated = xp.concatenate([(boxes[:, :2] + boxes[:, 2:]) / 2, boxes[:, 2:] - boxes[:, :2],
                              (6 * scores - 3)[:, None]], axis=1)
    return {
        "roi_align avg": to_host(ops.roi_align(feature, rois, 7, 0.25, 2, "avg")),
        "roi_align max": to_host(ops.roi_align(feature, rois, 7, 0.25, 2, "max")),
        "roi_pool": to_host(ops.roi_pool(feature, rois, 7, 0.25)),
        "nms": to_host(ops.nms(boxes, scores, 0.5)),
        "bbox_overlaps": to_host(ops.bbox_overlaps(boxes, boxes)),
        "sigmoid_focal_loss": to_host(ops.sigmoid_focal_loss(logits, targets, reduction="none")),
        # the background class (16) is an ignored row for the softmax loss
        "softmax_focal_loss": to_host(ops.softmax_focal_loss(
            logits, xp.where(targets == 16, -1, targets), reduction="none")),
        # torchvision's form: one-hot targets (background rows all 0)
        "binary_focal_loss": to_host(ops.binary_focal_loss(
            logits, (targets[:, None] == xp.arange(logits.shape[1])).astype(logits.dtype))),
        "deform_conv2d": to_host(ops.deform_conv2d(feature, offset, weight, None, 1, 1, 1, mask)),
        "multi_scale_deformable_attn": to_host(ops.multi_scale_deformable_attn(
            *attention_inputs(feature, xp))),
        "box_iou_rotated": to_host(ops.box_iou_rotated(rotated, rotated)),
        "nms_rotated": to_host(ops.nms_rotated(rotated, scores, 0.5)),
    }


def attention_inputs(feature, xp):
    """Deformable attention over the map as one level: its channels as two
    heads, 16 queries of 4 points spread over (and a little beyond) it."""
    n, c, h, w = feature.shape
    heads = 2 if c % 2 == 0 else 1
    value = xp.ascontiguousarray(feature.reshape(n, c, h * w).transpose(0, 2, 1)
                                 .reshape(n, h * w, heads, c // heads))
    samples = (n, 16, heads, 1, 4)
    spread = xp.arange(2 * int(np.prod(samples)), dtype=feature.dtype) * 0.37 % 1.1 - 0.05
    locations = spread.reshape(samples + (2,))
    weights = xp.full(samples, 0.25, dtype=feature.dtype)
    return (value, xp.asarray(np.array([[h, w]])), xp.asarray(np.array([0])), locations,
            weights)


def demo():
    from mmdispatch.ops import roi_align

    print(registry_matrix())
    print()
    ok = True
    for name, good in published_checks():
        ok &= good
        print(f"cpu    MMCV published {name} values: {'match' if good else 'MISMATCH'}")

    feature, rois = demo_data()
    rng = np.random.default_rng(1)
    scores = rng.random(rois.shape[0]).astype(feature.dtype)
    logits = (4 * rng.standard_normal((rois.shape[0], 16))).astype(feature.dtype)
    targets = rng.integers(0, 17, size=rois.shape[0])
    results = {}
    for backend in ("reference", "default"):
        with mmdispatch.use_backend("cpu", backend):
            for mode in ("avg", "max"):
                results[backend, mode] = roi_align(feature, rois, (7, 7), 0.25, 2, mode)
    for mode in ("avg", "max"):
        diff = float(np.max(np.abs(results["default", mode] - results["reference", mode])))
        good = diff <= 1e-5
        ok &= good
        print(f"cpu    roi_align {mode}: default vs reference backend, "
              f"{rois.shape[0]} rois, max |diff| = {diff:.2e} {'ok' if good else 'FAIL'}")
    cpu = run_ops(feature, rois, scores, logits, targets)
    print(f"cpu    every op on {rois.shape[0]} rois / boxes: nms kept {cpu['nms'].size}, "
          f"focal loss sum {cpu['sigmoid_focal_loss'].sum():.4f}")
    # two kernels, one loss: torchvision's form of one-hot targets is MMCV's
    # of their class indices
    one_hot = cpu["binary_focal_loss"] - cpu["sigmoid_focal_loss"]
    diff = float(np.max(np.abs(one_hot) / np.maximum(np.abs(cpu["sigmoid_focal_loss"]), 1)))
    good = diff <= 1e-5
    ok &= good
    print(f"cpu    binary_focal_loss of one-hot targets vs sigmoid_focal_loss of their "
          f"indices, max relative diff = {diff:.2e} {'ok' if good else 'FAIL'}")

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
        gpu = run_ops(*(cupy.asarray(a) for a in (feature, rois, scores, logits, targets)),
                      cupy=cupy)
        for name, expected in cpu.items():
            if name.startswith("nms"):
                good = np.array_equal(gpu[name], expected)
                detail = f"{gpu[name].size} kept, {'same' if good else 'DIFFERENT'} indices"
            else:
                diff = float(np.max(np.abs(gpu[name] - expected), initial=0))
                good = diff <= 1e-4
                detail = f"max |diff| = {diff:.2e}"
            ok &= good
            print(f"cuda:0 {name}: CUDA vs CPU, {detail} {'ok' if good else 'FAIL'}")
    print("demo:", "all checks passed" if ok else "CHECKS FAILED")
    return 0 if ok else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from mmdispatch.bench import main as bench

        return bench(argv[1:])
    parser = argparse.ArgumentParser(
        prog="mmdispatch", description="mmdispatch's command line (also python -m mmdispatch).",
        epilog="`mmdispatch bench --help` lists the benchmark's options.")
    parser.add_argument("command", choices=["info", "demo", "bench"], nargs="?", default="info",
                        help="info (the default): the build, the devices and the registry "
                             "table; demo: roi_align through the dispatcher on every available "
                             "device, with checks; bench: the benchmarks")
    args = parser.parse_args(argv)
    if args.command == "info":
        info()
        return 0
    return demo()


if __name__ == "__main__":
    sys.exit(main())
