"""Non-maximum suppression of rotated boxes (MMCV's nms_rotated),
dispatched through nms_rotated_impl.

- Boxes are (cx, cy, w, h, angle in radians), with box_iou_rotated's
  angle convention (clockwise=True: clockwise in image coordinates).
- Boxes are visited by descending score; equal scores keep their input
  order (lower index first); NaN scores come last. A box is dropped when a
  box kept before it (of the same class, for batched_nms_rotated) has
  IoU > iou_threshold with it, strictly, the IoU being exactly
  box_iou_rotated(kept, box) in the boxes' dtype (float16 and bfloat16 on
  CUDA compare in float32). A box with a NaN value or a negative size has
  NaN IoU with every box: it neither suppresses nor is suppressed.
- The result is int64 indices into the input, in visiting order. On CUDA
  it stays on the device; only the count of kept boxes is read back.
"""
from mmdispatch import _core
from mmdispatch.ops._arrays import explain, index_array
from mmdispatch.ops.box_iou_rotated import _flag

__all__ = ["batched_nms_rotated", "nms_rotated"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("nms_rotated_impl",)


def _nms(op, boxes, scores, idxs, iou_threshold, clockwise):
    clockwise = _flag(op, "clockwise", clockwise)
    try:
        return _core.nms_rotated_impl(boxes, scores, idxs, None, None, iou_threshold, clockwise)
    except (TypeError, ValueError) as exc:
        explain(op, exc, [("boxes", boxes, 2, "(N, 5)"), ("scores", scores, 1, "(N,)")]
                + ([] if idxs is None else [("idxs", idxs, 1, "(N,)")]))


def nms_rotated(boxes, scores, iou_threshold, clockwise=True):
    """Indices (int64) of the rotated boxes kept, by descending score.

    boxes: (N, 5) float array; scores: (N,) of the same dtype and device."""
    return _nms("nms_rotated", boxes, scores, None, iou_threshold, clockwise)


def batched_nms_rotated(boxes, scores, idxs, iou_threshold, clockwise=True):
    """nms_rotated within each class: boxes whose idxs (an (N,) integer
    array) differ never suppress each other."""
    return _nms("batched_nms_rotated", boxes, scores,
                index_array("batched_nms_rotated", "idxs", idxs), iou_threshold, clockwise)
