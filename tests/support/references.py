"""Slow reference pieces that several op test files share."""
import math

import numpy as np


def mmcv_bilinear_terms(height, width, y, x):
    """MMCV's bilinear interpolation (roi_align's, roi_align_rotated's) of
    one sample of an H x W map: [(row, col, weight)]; [] outside
    [-1, H] x [-1, W] (NaN included) or for an empty map."""
    if not (-1.0 <= y <= height and -1.0 <= x <= width) or height == 0 or width == 0:
        return []
    y, x = max(y, 0.0), max(x, 0.0)
    y0, x0 = int(math.floor(y)), int(math.floor(x))
    if y0 >= height - 1:
        y0 = y1 = height - 1
        y = float(y0)
    else:
        y1 = y0 + 1
    if x0 >= width - 1:
        x0 = x1 = width - 1
        x = float(x0)
    else:
        x1 = x0 + 1
    ly, lx = y - y0, x - x0
    hy, hx = 1 - ly, 1 - lx
    return [(y0, x0, hy * hx), (y0, x1, hy * lx), (y1, x0, ly * hx), (y1, x1, ly * lx)]


def ref_overlap(a, b, mode, offset, dtype):
    """IoU / IoF of two boxes with numpy scalars of `dtype`, in the kernels'
    order of operations: NaN when any coordinate is NaN, 0 when the union
    (iou) or the area of a (iof) is <= 0."""
    t = np.dtype(dtype).type
    a = [t(v) for v in a]
    b = [t(v) for v in b]
    if any(math.isnan(float(v)) for v in a + b):
        return t(np.nan)
    off = t(offset)
    with np.errstate(all="ignore"):
        w = min(a[2], b[2]) - max(a[0], b[0]) + off
        h = min(a[3], b[3]) - max(a[1], b[1]) + off
        inter = (w if w > 0 else t(0)) * (h if h > 0 else t(0))
        area_a = (a[2] - a[0] + off) * (a[3] - a[1] + off)
        area_b = (b[2] - b[0] + off) * (b[3] - b[1] + off)
        base = area_a if mode == "iof" else area_a + area_b - inter
        return t(0) if base <= 0 else inter / base


def ref_iou(a, b, offset, dtype):
    return ref_overlap(a, b, "iou", offset, dtype)


def ref_order(scores):
    """Descending score, NaN after everything (-inf included), ties by index."""
    def key(i):
        s = float(scores[i])
        return (math.isnan(s), 0.0 if math.isnan(s) else -s, i)
    return sorted(range(len(scores)), key=key)
