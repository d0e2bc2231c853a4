"""User-facing ops: validate, allocate outputs like the input, dispatch."""
from mmdispatch.ops.roi_align import roi_align, roi_align_backward, roi_align_forward

__all__ = ["roi_align", "roi_align_backward", "roi_align_forward"]
