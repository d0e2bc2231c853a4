"""Slow reference pieces that several op test files share."""
import math


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
