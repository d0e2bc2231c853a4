"""Non-maximum suppression (MMCV / torchvision semantics), dispatched
through nms_impl.

- Boxes are [x1, y1, x2, y2]; `offset` (0 or 1, MMCV's) is added to widths
  and heights.
- Boxes are visited by descending score; equal scores keep their input
  order (lower index first). A box is dropped when a box kept before it
  (of the same class, for batched_nms) has IoU > iou_threshold with it,
  strictly. A zero union counts as IoU 0.
- NaN scores rank below every number (-inf included), so such boxes come
  last and are kept unless suppressed. A box with a NaN coordinate has NaN
  IoU with every box: it neither suppresses nor is suppressed.
- The result is int64 indices into the input, in visiting order. On CUDA it
  stays on the device; only the count of kept boxes is read back.
"""
from mmdispatch import _core
from mmdispatch.ops._arrays import explain, index_array

__all__ = ["batched_nms", "nms"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("nms_impl",)

_nms_impl = _core.nms_impl


def _nms(op, boxes, scores, idxs, iou_threshold, offset):
    try:
        return _nms_impl(boxes, scores, idxs, None, None, iou_threshold, offset)
    except (TypeError, ValueError) as exc:
        explain(op, exc, [("boxes", boxes, 2, "(N, 4)"), ("scores", scores, 1, "(N,)")]
                + ([] if idxs is None else [("idxs", idxs, 1, "(N,)")]))


def nms(boxes, scores, iou_threshold, offset=0):
    """Indices (int64) of the boxes kept, by descending score.

    boxes: (N, 4) float array; scores: (N,) of the same dtype and device."""
    return _nms("nms", boxes, scores, None, iou_threshold, offset)


def batched_nms(boxes, scores, idxs, iou_threshold, offset=0):
    """nms within each class: boxes whose idxs (an (N,) integer array)
    differ never suppress each other, whatever their coordinates. Returns
    the kept indices (int64) by descending score, as nms does."""
    return _nms("batched_nms", boxes, scores, index_array("batched_nms", "idxs", idxs),
                iou_threshold, offset)
