"""User-facing ops: validate, allocate outputs like the input, dispatch."""
from mmdispatch.ops.bbox_overlaps import bbox_overlaps
from mmdispatch.ops.nms import batched_nms, nms
from mmdispatch.ops.roi_align import roi_align, roi_align_backward, roi_align_forward
from mmdispatch.ops.roi_pool import roi_pool, roi_pool_backward, roi_pool_forward
from mmdispatch.ops.sigmoid_focal_loss import (sigmoid_focal_loss, sigmoid_focal_loss_backward,
                                               sigmoid_focal_loss_forward)

__all__ = ["batched_nms", "bbox_overlaps", "nms", "roi_align", "roi_align_backward",
           "roi_align_forward", "roi_pool", "roi_pool_backward", "roi_pool_forward",
           "sigmoid_focal_loss", "sigmoid_focal_loss_backward", "sigmoid_focal_loss_forward"]
