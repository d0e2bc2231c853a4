/* soft_nms / batched_soft_nms (Bodla et al. 2017, MMCV's semantics): the
 * argument checks and the decay, shared by the CPU kernel
 * (src/cpu/soft_nms.cpp) and the CUDA kernel (src/cuda/soft_nms.cu).
 *
 * Every box starts with its score and is "remaining". Until none remains:
 *   1. the remaining box with the highest score is selected (ties: lower
 *      index first; NaN scores below every number): it is output next, with
 *      its score as it is now, and no longer remains;
 *   2. each remaining box of its class (idxs, when given) has its score
 *      multiplied by weight(IoU with the selected box):
 *        method 0, naive:    0 when IoU >= iou_threshold, else 1 (hard nms);
 *        method 1, linear:   1 - IoU when IoU >= iou_threshold, else 1;
 *        method 2, gaussian: exp(-IoU^2 / sigma) (iou_threshold unused);
 *      a NaN IoU (a NaN coordinate) leaves the score as it is;
 *   3. every remaining box (of any class) whose score is now < min_score
 *      stops remaining. So only the first box selected is never held to
 *      min_score, as in MMCV.
 * Scores decay in the compute type (the boxes' dtype, float for 16-bit ones
 * on CUDA), in selection order. dets[k] = the k-th selected box's
 * coordinates and score, keep[k] its index, num_kept[0] the count. With
 * scores >= 0 the output is by non-increasing final score (a decay moves a
 * negative score up, towards 0). */
#ifndef MMDISPATCH_OPS_SOFT_NMS_H
#define MMDISPATCH_OPS_SOFT_NMS_H

#include "mmdispatch/ops/nms.h"

enum { MMD_SOFT_NMS_NAIVE = 0, MMD_SOFT_NMS_LINEAR = 1, MMD_SOFT_NMS_GAUSSIAN = 2 };

inline int mmd_soft_nms_check(const mmd_tensor *boxes, const mmd_tensor *scores,
                              const mmd_tensor *idxs, const mmd_tensor *dets,
                              const mmd_tensor *keep, const mmd_tensor *num_kept,
                              double iou_threshold, double sigma, double min_score,
                              int64_t method, int64_t offset, unsigned float_mask) {
    if (iou_threshold != iou_threshold)
        return mmd_error(MMD_ERR_VALUE, "iou_threshold must not be NaN");
    if (min_score != min_score) return mmd_error(MMD_ERR_VALUE, "min_score must not be NaN");
    if (method < MMD_SOFT_NMS_NAIVE || method > MMD_SOFT_NMS_GAUSSIAN)
        return mmd_error(MMD_ERR_VALUE,
                         "method must be 0 (naive), 1 (linear) or 2 (gaussian), got %lld",
                         (long long)method);
    /* the kernels divide by sigma in the compute type: double for float64
     * boxes, float for the others (1e-46 is 0 there) */
    const double sigma_computed = boxes->dtype == MMD_FLOAT64 ? sigma : (double)(float)sigma;
    if (method == MMD_SOFT_NMS_GAUSSIAN && !(sigma_computed > 0))
        return mmd_error(MMD_ERR_VALUE,
                         "sigma must be > 0 for the gaussian method (in the boxes' compute "
                         "type, %s), got %g",
                         boxes->dtype == MMD_FLOAT64 ? "float64" : "float32", sigma);
    if (offset != 0 && offset != 1)
        return mmd_error(MMD_ERR_VALUE, "offset must be 0 or 1, got %lld", (long long)offset);
    int s = mmd_nms_check_arrays(boxes, 4, scores, idxs, keep, num_kept, float_mask);
    if (s) return s;
    const int64_t det_shape[2] = {boxes->shape[0], 5};
    return mmd_check_like(dets, "dets", 2, det_shape, boxes, "boxes");
}

/* The least T t >= threshold: for every x of type T, x >= threshold
 * exactly when x >= t. */
template <typename T> inline T mmd_threshold_at_or_above(double threshold) {
    T t = (T)threshold;
    if ((double)t < threshold) t = nextafter(t, (T)INFINITY);
    return t;
}

/* A score after a selected box whose IoU with its box is `iou` decays it
 * (Method a MMD_SOFT_NMS_* constant): the product with the weight, where a
 * weight of 1 (no overlap, or IoU below the threshold) leaves the score's
 * bits as they are. */
template <int Method, typename T>
MMD_HOSTDEV inline T mmd_soft_nms_decay(T score, T iou, T threshold, T sigma) {
    if (Method == MMD_SOFT_NMS_GAUSSIAN)
        return iou == iou ? score * exp(-(iou * iou) / sigma) : score;
    const T hit = Method == MMD_SOFT_NMS_LINEAR ? (T)1 - iou : (T)0;
    return score * (iou >= threshold ? hit : (T)1);   /* NaN: no hit */
}

/* The decay parameters in the compute type T. */
template <typename T> struct MmdSoftNmsDecay {
    int method;
    T threshold;   /* mmd_threshold_at_or_above(iou_threshold) */
    T sigma, offset;

    /* score of box b after the selected box a decays it */
    MMD_HOSTDEV T decayed(T score, const T *a, T area_a, const T *b, T area_b) const {
        const T iou = mmd_box_iou(a, area_a, b, area_b, offset);
        if (method == MMD_SOFT_NMS_GAUSSIAN)
            return mmd_soft_nms_decay<MMD_SOFT_NMS_GAUSSIAN>(score, iou, threshold, sigma);
        if (method == MMD_SOFT_NMS_LINEAR)
            return mmd_soft_nms_decay<MMD_SOFT_NMS_LINEAR>(score, iou, threshold, sigma);
        return mmd_soft_nms_decay<MMD_SOFT_NMS_NAIVE>(score, iou, threshold, sigma);
    }
};

#endif
