/* nms_rotated / batched_nms_rotated: the argument checks shared by the CPU
 * kernel (src/cpu/nms_rotated.cpp) and the CUDA kernel
 * (src/cuda/nms_rotated.cu).
 *
 * Boxes are (cx, cy, w, h, angle) as box_iou_rotated takes them, visited by
 * descending score (ties: lower index first; NaN scores after every
 * number); a box is kept unless a kept box of the same class (idxs, when
 * given) has IoU > iou_threshold with it, the IoU being box_iou_rotated's
 * of (kept box, box) in the boxes' dtype (mmdispatch/ops/box_iou_rotated.h),
 * so the decisions are exactly those of box_iou_rotated's values. */
#ifndef MMDISPATCH_OPS_NMS_ROTATED_H
#define MMDISPATCH_OPS_NMS_ROTATED_H

#include "mmdispatch/ops/box_iou_rotated.h"
#include "mmdispatch/ops/nms.h"

inline int mmd_nms_rotated_check(const mmd_tensor *boxes, const mmd_tensor *scores,
                                 const mmd_tensor *idxs, const mmd_tensor *keep,
                                 const mmd_tensor *num_kept, double iou_threshold,
                                 unsigned float_mask) {
    if (iou_threshold != iou_threshold)
        return mmd_error(MMD_ERR_VALUE, "iou_threshold must not be NaN");
    return mmd_nms_check_arrays(boxes, 5, scores, idxs, keep, num_kept, float_mask);
}

/* Whether box a's IoU with box b, as box_iou_rotated computes it, is
 * certainly at most `threshold` (> 0, of type T) without its polygon: the
 * IoU is at most min(area) / max(area). With r bounding every vertex
 * coordinate (taken relative to a's centre), the computed intersection
 * passes the smaller area by less than 2^-40 r^2 when every side is at
 * least 2^-30 r (area >= 2^-30 r * diagonal) and r lies within 2^+-400:
 * a smaller side can vanish in the rounding of its corners' coordinates,
 * and then the clipped polygon is not the intersection at all; outside
 * that range the areas may be subnormal. Such pairs take the polygon. The
 * test leaves the 2^-40 r^2 and another relative 2^-40 of margin. A pair
 * whose IoU is not defined (NaN) may be answered here too: it suppresses
 * nothing either way. */
template <typename T>
MMD_HOSTDEV inline bool mmd_rotated_below_by_areas(const mmd_rbox_shape &a,
                                                   const mmd_rbox_shape &b, T threshold) {
    const double lo = a.area < b.area ? a.area : b.area, hi = a.area < b.area ? b.area : a.area;
    const double r = a.diagonal + b.diagonal + fabs(b.cx - a.cx) + fabs(b.cy - a.cy);
    const bool bounded = r >= 0x1p-400 && r <= 0x1p400 && a.area >= 0x1p-30 * r * a.diagonal &&
                         b.area >= 0x1p-30 * r * b.diagonal;
    const double slack = 0x1p-40 * r * r;
    return threshold > 0 && bounded &&
           lo + slack < (double)threshold * (1 - 0x1p-40) * (hi - slack);
}

/* Whether kept box a suppresses box b: box_iou_rotated's IoU of (a, b),
 * rounded to the boxes' type T, above the threshold (rounded down to T,
 * so that the comparison is the one of the values box_iou_rotated gives). */
template <typename T>
MMD_HOSTDEV inline bool mmd_rotated_suppresses(const mmd_rbox_shape &a, const mmd_rbox_shape &b,
                                               T threshold) {
    return !mmd_rotated_below_by_areas(a, b, threshold) &&
           (T)mmd_rbox_overlap(a, b, 0) > threshold;
}

#endif
