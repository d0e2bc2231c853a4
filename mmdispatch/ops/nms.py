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
import numpy as np

from mmdispatch import _core
from mmdispatch.ops._arrays import (allocate, check_ndim, contiguous, index_array, like,
                                    namespace, native)
from mmdispatch.ops._fastpath import nms_outputs


def _nms(op, boxes, scores, idxs, iou_threshold, offset):
    original = boxes
    boxes = contiguous(native(op, "boxes", boxes))
    scores = contiguous(native(op, "scores", scores))
    check_ndim(op, "boxes", boxes, 2, "(N, 4)")
    check_ndim(op, "scores", scores, 1, "(N,)")
    if idxs is not None:
        idxs = index_array(op, "idxs", idxs)
        check_ndim(op, "idxs", idxs, 1, "(N,)")
    xp, device = namespace(op, boxes)
    with device:
        keep = allocate(op, "keep", xp, (boxes.shape[0],), np.int64)
        num_kept = xp.zeros((1,), dtype=np.int64)
    _core.nms_impl(boxes, scores, idxs, keep, num_kept, iou_threshold, offset)
    return like(original, keep[:int(num_kept[0])])


_nms_impl = _core.nms_impl


def nms(boxes, scores, iou_threshold, offset=0):
    """Indices (int64) of the boxes kept, by descending score.

    boxes: (N, 4) float array; scores: (N,) of the same dtype and device."""
    # The common call (what nms_outputs takes: plain float numpy arrays of
    # matching shapes) without the general path's conversions.
    fast = nms_outputs(boxes, scores)
    if fast is not None:
        keep, num_kept = fast
        _nms_impl(boxes, scores, None, keep, num_kept, iou_threshold, offset)
        return keep[:num_kept[0]]
    return _nms("nms", boxes, scores, None, iou_threshold, offset)


def batched_nms(boxes, scores, idxs, iou_threshold, offset=0):
    """nms within each class: boxes whose idxs (an (N,) integer array)
    differ never suppress each other, whatever their coordinates. Returns
    the kept indices (int64) by descending score, as nms does."""
    return _nms("batched_nms", boxes, scores, idxs, iou_threshold, offset)
