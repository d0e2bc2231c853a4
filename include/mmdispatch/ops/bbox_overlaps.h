/* bbox_overlaps: the argument checks shared by the CPU kernel
 * (src/cpu/bbox_overlaps.cpp) and the CUDA kernel (src/cuda/bbox_overlaps.cu).
 * ious[i, j] (or ious[i] when aligned) is intersection / union ("iou") or
 * intersection / area of bboxes1[i] ("iof"); a zero base gives 0. */
#ifndef MMDISPATCH_OPS_BBOX_OVERLAPS_H
#define MMDISPATCH_OPS_BBOX_OVERLAPS_H

#include "mmdispatch/checks.h"
#include "mmdispatch/ops/boxes.h"

enum { MMD_OVERLAP_IOU = 0, MMD_OVERLAP_IOF = 1 };

/* Shape/dtype/scalar checks; `float_mask` is the device's supported dtypes. */
inline int mmd_bbox_overlaps_check(const mmd_tensor *bboxes1, const mmd_tensor *bboxes2,
                                   const mmd_tensor *ious, int64_t mode, int aligned,
                                   int64_t offset, unsigned float_mask) {
    if (mode != MMD_OVERLAP_IOU && mode != MMD_OVERLAP_IOF)
        return mmd_error(MMD_ERR_VALUE, "mode must be 0 (iou) or 1 (iof), got %lld",
                         (long long)mode);
    if (offset != 0 && offset != 1)
        return mmd_error(MMD_ERR_VALUE, "offset must be 0 or 1, got %lld", (long long)offset);
    const int64_t box_shape[2] = {MMD_ANY_DIM, 4};
    int s = mmd_check_shape(bboxes1, "bboxes1", 2, box_shape);
    if (!s) s = mmd_check_dtype(bboxes1, "bboxes1", float_mask);
    if (!s) s = mmd_check_contiguous(bboxes1, "bboxes1");
    if (!s) s = mmd_check_shape(bboxes2, "bboxes2", 2, box_shape);
    if (!s) s = mmd_check_same_dtype(bboxes2, "bboxes2", bboxes1, "bboxes1");
    if (!s) s = mmd_check_contiguous(bboxes2, "bboxes2");
    if (s) return s;
    const int64_t rows = bboxes1->shape[0], cols = bboxes2->shape[0];
    if (aligned && rows != cols)
        return mmd_error(MMD_ERR_VALUE,
                         "aligned=True needs as many bboxes1 as bboxes2, got %lld and %lld",
                         (long long)rows, (long long)cols);
    const int64_t shape[2] = {rows, cols};
    s = mmd_check_shape(ious, "ious", aligned ? 1 : 2, shape);
    if (!s) s = mmd_check_same_dtype(ious, "ious", bboxes1, "bboxes1");
    if (!s) s = mmd_check_contiguous(ious, "ious");
    return s;
}

#endif
