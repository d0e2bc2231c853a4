/* nms / batched_nms: the argument checks shared by the CPU kernel
 * (src/cpu/nms.cpp) and the CUDA kernel (src/cuda/nms.cu).
 *
 * Boxes are visited by descending score (ties: lower index first; NaN
 * scores after every number); a box is kept unless a kept box of the same
 * class (idxs, when given) overlaps it with IoU > iou_threshold. keep[0:n]
 * receives the kept indices in visiting order and num_kept[0] = n. */
#ifndef MMDISPATCH_OPS_NMS_H
#define MMDISPATCH_OPS_NMS_H

#include "mmdispatch/checks.h"
#include "mmdispatch/ops/boxes.h"

/* The arrays' checks, boxes (N, width). */
inline int mmd_nms_check_arrays(const mmd_tensor *boxes, int64_t width, const mmd_tensor *scores,
                                const mmd_tensor *idxs, const mmd_tensor *keep,
                                const mmd_tensor *num_kept, unsigned float_mask) {
    const int64_t box_shape[2] = {MMD_ANY_DIM, width};
    int s = mmd_check_shape(boxes, "boxes", 2, box_shape);
    if (!s) s = mmd_check_dtype(boxes, "boxes", float_mask);
    if (!s) s = mmd_check_contiguous(boxes, "boxes");
    if (s) return s;
    const int64_t n[1] = {boxes->shape[0]}, one[1] = {1};
    s = mmd_check_shape(scores, "scores", 1, n);
    if (!s) s = mmd_check_same_dtype(scores, "scores", boxes, "boxes");
    if (!s) s = mmd_check_contiguous(scores, "scores");
    if (!s && idxs) s = mmd_check_shape(idxs, "idxs", 1, n);
    if (!s && idxs) s = mmd_check_dtype(idxs, "idxs", MMD_DTYPE_BIT(MMD_INT64));
    if (!s && idxs) s = mmd_check_contiguous(idxs, "idxs");
    if (!s) s = mmd_check_shape(keep, "keep", 1, n);
    if (!s) s = mmd_check_dtype(keep, "keep", MMD_DTYPE_BIT(MMD_INT64));
    if (!s) s = mmd_check_contiguous(keep, "keep");
    if (!s) s = mmd_check_shape(num_kept, "num_kept", 1, one);
    if (!s) s = mmd_check_dtype(num_kept, "num_kept", MMD_DTYPE_BIT(MMD_INT64));
    return s;
}

/* Shape/dtype/scalar checks; `float_mask` is the device's supported dtypes. */
inline int mmd_nms_check(const mmd_tensor *boxes, const mmd_tensor *scores,
                         const mmd_tensor *idxs, const mmd_tensor *keep,
                         const mmd_tensor *num_kept, double iou_threshold, int64_t offset,
                         unsigned float_mask) {
    if (iou_threshold != iou_threshold)
        return mmd_error(MMD_ERR_VALUE, "iou_threshold must not be NaN");
    if (offset != 0 && offset != 1)
        return mmd_error(MMD_ERR_VALUE, "offset must be 0 or 1, got %lld", (long long)offset);
    return mmd_nms_check_arrays(boxes, 4, scores, idxs, keep, num_kept, float_mask);
}

#endif
