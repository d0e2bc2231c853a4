/* nms / batched_nms: host-side checks shared by the CPU kernel
 * (src/cpu/nms.c) and the CUDA kernel (src/cuda/nms.cu).
 *
 * Boxes are visited by descending score (ties: lower index first; NaN
 * scores after every number); a box is kept unless a kept box of the same
 * class (idxs, when given) overlaps it with IoU > iou_threshold. keep[0:n]
 * receives the kept indices in visiting order and num_kept[0] = n. */
#ifndef MMDISPATCH_OPS_NMS_H
#define MMDISPATCH_OPS_NMS_H

#include "mmdispatch/checks.h"
#include "mmdispatch/ops/boxes.h"

#ifdef __cplusplus
extern "C" {
#endif

int mmd_nms_check(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                  const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
                  int64_t offset, unsigned float_mask);

#ifdef __cplusplus
}
#endif
#endif
