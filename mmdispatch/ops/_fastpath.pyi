"""Type stubs of mmdispatch.ops._fastpath, the compiled helpers of the ops'
fast paths."""
from typing import Any

import numpy as np

def pooled_output(
    input: object, rois: object, output_size: object
) -> tuple[np.ndarray[Any, Any], int, int, np.ndarray[Any, Any]] | None:
    """``(output, out_h, out_w, empty)`` for the common call of a roi pooling
    op, else None."""

def index_like(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A new, uninitialised int64 array of ``array``'s shape: the argmax
    output that goes with a pooled_output output."""

def nms_outputs(
    boxes: object, scores: object
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None:
    """``(keep, num_kept)`` for the common call of nms, else None."""

def box_pairs_output(
    bboxes1: object, bboxes2: object, aligned: object
) -> np.ndarray[Any, Any] | None:
    """The ious output for the common call of bbox_overlaps, else None."""
