"""Pairwise box overlaps (MMCV's bbox_overlaps), dispatched through
bbox_overlaps_impl.

- "iou": intersection / union; "iof": intersection / area of the box from
  bboxes1. `offset` (0 or 1) is added to widths and heights.
- aligned=False gives (N, M) for every pair, aligned=True gives (N,) for
  bboxes1[i] vs bboxes2[i] (N must equal M).
- A union or area <= 0 (degenerate boxes) gives 0, never NaN or inf; NaN
  coordinates give NaN.
"""
import numpy as np

from mmdispatch import _core
from mmdispatch.ops._arrays import (allocate, check_ndim, choice, contiguous, like, namespace,
                                    native)
from mmdispatch.ops._fastpath import box_pairs_output

_MODES = {"iou": 0, "iof": 1}


_impl = _core.bbox_overlaps_impl


def bbox_overlaps(bboxes1, bboxes2, mode="iou", aligned=False, offset=0):
    """Overlaps of (N, 4) bboxes1 with (M, 4) bboxes2, in their dtype."""
    # The common call (what box_pairs_output takes: plain float numpy boxes,
    # aligned a bool) without the general path's conversions.
    mode_code = _MODES.get(mode) if type(mode) is str else None
    if mode_code is not None:
        ious = box_pairs_output(bboxes1, bboxes2, aligned)
        if ious is not None:
            _impl(bboxes1, bboxes2, ious, mode_code, aligned, offset)
            return ious
    op = "bbox_overlaps"
    mode_code = choice(op, "mode", mode, _MODES)
    original = bboxes1
    bboxes1 = contiguous(native(op, "bboxes1", bboxes1))
    bboxes2 = contiguous(native(op, "bboxes2", bboxes2))
    check_ndim(op, "bboxes1", bboxes1, 2, "(N, 4)")
    check_ndim(op, "bboxes2", bboxes2, 2, "(M, 4)")
    if not isinstance(aligned, (bool, np.bool_)):
        raise TypeError(f"{op}: aligned must be a bool, got {aligned!r}")
    shape = (bboxes1.shape[0],) if aligned else (bboxes1.shape[0], bboxes2.shape[0])
    xp, device = namespace(op, bboxes1)
    with device:
        ious = allocate(op, "ious", xp, shape, bboxes1.dtype)
    _core.bbox_overlaps_impl(bboxes1, bboxes2, ious, mode_code, aligned, offset)
    return like(original, ious)
