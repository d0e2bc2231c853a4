/* Box math shared by nms and bbox_overlaps on every device (C++ templates,
 * compiled by g++ for the CPU kernels and by nvcc for the CUDA ones): boxes
 * are [x1, y1, x2, y2]; `offset` (0 or 1, as in MMCV) is added to widths and
 * heights, so offset=1 treats coordinates as inclusive pixel indices. T is
 * the compute type, float or double. */
#ifndef MMDISPATCH_OPS_BOXES_H
#define MMDISPATCH_OPS_BOXES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "mmdispatch/tensor.h"

/* Sort key of a score: keys compare (as unsigned ints) like the scores, -0
 * equals +0, and NaN sorts below every number, -inf included. nms orders
 * boxes by key, descending, ties by lower index. */
MMD_HOSTDEV inline uint32_t mmd_score_key(float v) {
    if (v != v) return 0;
    if (v == 0) v = 0;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

MMD_HOSTDEV inline uint64_t mmd_score_key(double v) {
    if (v != v) return 0;
    if (v == 0) v = 0;
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
}

/* Length of the overlap of [lo_a, hi_a] and [lo_b, hi_b], at least 0; NaN
 * in b gives NaN (NaN in a reaches every result through a's area). */
template <typename T>
MMD_HOSTDEV inline T mmd_overlap_1d(T lo_a, T hi_a, T lo_b, T hi_b, T offset) {
    const T lo = lo_a > lo_b ? lo_a : lo_b;
    const T hi = hi_a < hi_b ? hi_a : hi_b;
    const T w = hi - lo + offset;
    return w <= 0 ? (T)0 : w;
}

template <typename T> MMD_HOSTDEV inline T mmd_box_area(const T *b, T offset) {
    return (b[2] - b[0] + offset) * (b[3] - b[1] + offset);
}

template <typename T> MMD_HOSTDEV inline T mmd_box_intersection(const T *a, const T *b, T offset) {
    return mmd_overlap_1d(a[0], a[2], b[0], b[2], offset) *
           mmd_overlap_1d(a[1], a[3], b[1], b[3], offset);
}

/* overlap / base, where a base (union or area) <= 0 gives 0, not NaN or
 * inf; NaN coordinates still give NaN: a NaN overlap (NaN in either box)
 * wins over a base <= 0, which iof's base (the area of `a` alone) can be
 * while `b` holds the NaN. */
template <typename T> MMD_HOSTDEV inline T mmd_box_ratio(T overlap, T base) {
    return base <= 0 ? (overlap == overlap ? (T)0 : overlap) : overlap / base;
}

/* IoU of a and b given their areas. */
template <typename T>
MMD_HOSTDEV inline T mmd_box_iou(const T *a, T area_a, const T *b, T area_b, T offset) {
    const T inter = mmd_box_intersection(a, b, offset);
    return mmd_box_ratio(inter, area_a + area_b - inter);
}

/* bbox_overlaps of a and b: IoU, or (iof != 0) intersection / area of a. */
template <typename T>
MMD_HOSTDEV inline T mmd_box_overlap(const T *a, const T *b, int iof, T offset) {
    const T inter = mmd_box_intersection(a, b, offset);
    const T area_a = mmd_box_area(a, offset);
    return mmd_box_ratio(inter, iof ? area_a : area_a + mmd_box_area(b, offset) - inter);
}

/* The largest T t <= threshold: for every x of type T, x > threshold
 * exactly when x > t, so the (double) IoU threshold can be compared in the
 * compute type without changing any decision. */
template <typename T> inline T mmd_threshold_below(double threshold) {
    T t = (T)threshold;
    if ((double)t > threshold) t = nextafter(t, (T)-INFINITY);
    return t;
}

#endif
