"""Overlaps of rotated boxes (MMCV's box_iou_rotated), dispatched through
box_iou_rotated_impl.

- A box is (cx, cy, w, h, angle in radians). clockwise=True (MMCV's
  default): a positive angle turns the box clockwise in image coordinates
  (x right, y down); clockwise=False: counter-clockwise (the same as
  negating every angle).
- The intersection is the convex polygon of one box clipped by the other,
  in double precision whatever the dtype, never larger than either box (a
  box met by itself gives 1): its rounding, about 1e-16 of the boxes'
  extent, matters only for boxes thinner than about 1e-12 of their length.
- "iou": intersection / union; "iof": intersection / area of the box from
  boxes1. aligned=False gives (N, M), aligned=True (N,) for boxes1[i] vs
  boxes2[i] (N must equal M).
- A union or area <= 0 (zero-size boxes) gives 0; a pair with a value that
  is not finite, a negative width or height, or an area w * h past
  double's range (float64 sides past about 1e154), gives NaN.
- Not differentiable (as in MMCV).
"""
import numpy as np

from mmdispatch import _core
from mmdispatch.ops._arrays import choice, explain
from mmdispatch.ops.bbox_overlaps import _MODES

__all__ = ["box_iou_rotated"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("box_iou_rotated_impl",)


def _flag(op, name, value):
    if value is not True and value is not False and not isinstance(value, np.bool_):
        raise TypeError(f"{op}: {name} must be a bool, got {value!r}")
    return bool(value)


def box_iou_rotated(boxes1, boxes2, mode="iou", aligned=False, clockwise=True):
    """Overlaps of (N, 5) boxes1 with (M, 5) boxes2, in their dtype."""
    op = "box_iou_rotated"
    mode_code = choice(op, "mode", mode, _MODES)
    aligned, clockwise = _flag(op, "aligned", aligned), _flag(op, "clockwise", clockwise)
    try:
        return _core.box_iou_rotated_impl(boxes1, boxes2, None, mode_code, aligned, clockwise)
    except (TypeError, ValueError) as exc:
        explain(op, exc, (("boxes1", boxes1, 2, "(N, 5)"), ("boxes2", boxes2, 2, "(M, 5)")))
