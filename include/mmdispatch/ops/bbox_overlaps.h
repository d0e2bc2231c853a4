/* bbox_overlaps: host-side checks shared by the CPU kernel
 * (src/cpu/bbox_overlaps.c) and the CUDA kernel (src/cuda/bbox_overlaps.cu).
 * ious[i, j] (or ious[i] when aligned) is intersection / union ("iou") or
 * intersection / area of bboxes1[i] ("iof"); a zero base gives 0. */
#ifndef MMDISPATCH_OPS_BBOX_OVERLAPS_H
#define MMDISPATCH_OPS_BBOX_OVERLAPS_H

#include "mmdispatch/checks.h"
#include "mmdispatch/ops/boxes.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { MMD_OVERLAP_IOU = 0, MMD_OVERLAP_IOF = 1 };

int mmd_bbox_overlaps_check(const mmd_tensor *bboxes1, const mmd_tensor *bboxes2,
                            const mmd_tensor *ious, int64_t mode, int aligned, int64_t offset,
                            unsigned float_mask);

#ifdef __cplusplus
}
#endif
#endif
