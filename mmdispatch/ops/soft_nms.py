"""Soft non-maximum suppression (Bodla et al., "Soft-NMS", 2017; MMCV's
soft_nms, whose kernel is CPU-only there), dispatched through
soft_nms_impl, on CPU and CUDA.

- Boxes are [x1, y1, x2, y2]; `offset` (0 or 1, MMCV's) is added to widths
  and heights, as in nms.
- Until no box remains, the remaining box with the highest score is
  selected (ties: lower index first; NaN scores after every number) and
  output with its score as it is then. Every remaining box (of its class,
  for batched_soft_nms) has its score multiplied by a weight of its IoU
  with the selected box:
  - "naive": 0 when IoU >= iou_threshold, else 1 (hard nms, with >=);
  - "linear": 1 - IoU when IoU >= iou_threshold, else 1;
  - "gaussian": exp(-IoU**2 / sigma), whatever the IoU (iou_threshold is
    not used; sigma must be > 0 in the boxes' compute type: float32 for
    all but float64 boxes).
  A NaN IoU (a NaN coordinate) leaves the score as it is. Then every
  remaining box, of any class, whose score is below min_score is dropped.
  As in MMCV, the first box selected is kept even when its own score is
  below min_score.
- Scores decay in the boxes' dtype (float32 for float16/bfloat16 boxes on
  CUDA), one selected box after another.
- Returns (dets, inds): dets (k, 5) [x1, y1, x2, y2, score after decay] of
  the boxes' dtype, inds (k,) int64 indices into the input, in selection
  order, which for scores >= 0 is by non-increasing final score (a decay
  moves a negative score up, towards 0). On CUDA they stay on the
  device; only the count of kept boxes is read back.
"""
from mmdispatch import _core
from mmdispatch.ops._arrays import choice, explain, index_array

__all__ = ["batched_soft_nms", "soft_nms"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("soft_nms_impl",)

METHODS = {"naive": 0, "linear": 1, "gaussian": 2}


def _soft_nms(op, boxes, scores, idxs, iou_threshold, sigma, min_score, method, offset):
    code = choice(op, "method", method, METHODS)
    try:
        return _core.soft_nms_impl(boxes, scores, idxs, None, None, None, iou_threshold, sigma,
                                   min_score, code, offset)
    except (TypeError, ValueError) as exc:
        explain(op, exc, [("boxes", boxes, 2, "(N, 4)"), ("scores", scores, 1, "(N,)")]
                + ([] if idxs is None else [("idxs", idxs, 1, "(N,)")]))


def soft_nms(boxes, scores, iou_threshold=0.3, sigma=0.5, min_score=1e-3, method="linear",
             offset=0):
    """(dets, inds) of soft-NMS over all boxes (MMCV's signature and
    defaults). boxes: (N, 4) float array; scores: (N,) of the same dtype
    and device; method "naive", "linear" or "gaussian"."""
    return _soft_nms("soft_nms", boxes, scores, None, iou_threshold, sigma, min_score, method,
                     offset)


def batched_soft_nms(boxes, scores, idxs, iou_threshold=0.3, sigma=0.5, min_score=1e-3,
                     method="linear", offset=0):
    """soft_nms within each class: a selected box decays only the boxes
    whose idxs (an (N,) integer array) equal its own; min_score applies to
    every class. Returns (dets, inds) as soft_nms does."""
    return _soft_nms("batched_soft_nms", boxes, scores,
                     index_array("batched_soft_nms", "idxs", idxs), iou_threshold, sigma,
                     min_score, method, offset)
