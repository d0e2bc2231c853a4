"""Pairwise box overlaps (MMCV's bbox_overlaps), dispatched through
bbox_overlaps_impl.

- "iou": intersection / union; "iof": intersection / area of the box from
  bboxes1. `offset` (0 or 1) is added to widths and heights.
- aligned=False gives (N, M) for every pair, aligned=True gives (N,) for
  bboxes1[i] vs bboxes2[i] (N must equal M).
- A union or area <= 0 (degenerate boxes) gives 0, never NaN or inf; NaN
  coordinates give NaN. Areas are computed in the boxes' dtype, as MMCV
  computes them: an area past its range (float32 sides past about 1.8e19)
  is inf, and the pair's IoU NaN where the intersection is inf too (inf -
  inf in the union), as in MMCV.
"""
import numpy as np

from mmdispatch import _core
from mmdispatch.ops._arrays import choice, explain

__all__ = ["bbox_overlaps"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("bbox_overlaps_impl",)

_MODES = {"iou": 0, "iof": 1}
_impl = _core.bbox_overlaps_impl


def bbox_overlaps(bboxes1, bboxes2, mode="iou", aligned=False, offset=0):
    """Overlaps of (N, 4) bboxes1 with (M, 4) bboxes2, in their dtype."""
    op = "bbox_overlaps"
    mode_code = _MODES.get(mode) if type(mode) is str else None
    if mode_code is None:
        mode_code = choice(op, "mode", mode, _MODES)
    if aligned is not True and aligned is not False and not isinstance(aligned, np.bool_):
        raise TypeError(f"{op}: aligned must be a bool, got {aligned!r}")
    try:
        return _impl(bboxes1, bboxes2, None, mode_code, aligned, offset)
    except (TypeError, ValueError) as exc:
        explain(op, exc, (("bboxes1", bboxes1, 2, "(N, 4)"), ("bboxes2", bboxes2, 2, "(M, 4)")))
