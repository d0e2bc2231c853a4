/* Box math shared by nms and bbox_overlaps on every device: boxes are
 * [x1, y1, x2, y2]; `offset` (0 or 1, as in MMCV) is added to widths and
 * heights, so offset=1 treats coordinates as inclusive pixel indices. */
#ifndef MMDISPATCH_OPS_BOXES_H
#define MMDISPATCH_OPS_BOXES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "mmdispatch/tensor.h"

/* Sort key of a score: keys compare (as unsigned ints) like the scores, -0
 * equals +0, and NaN sorts below every number, -inf included. nms orders
 * boxes by key, descending, ties by lower index. */
MMD_HOSTDEV static inline uint32_t mmd_score_key_f32(float v) {
    if (v != v) return 0;
    if (v == 0) v = 0;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

MMD_HOSTDEV static inline uint64_t mmd_score_key_f64(double v) {
    if (v != v) return 0;
    if (v == 0) v = 0;
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
}

#define MMD_TYPED_FILE "mmdispatch/ops/boxes_math.inc"
#include "mmdispatch/typed.h"

#ifdef __cplusplus
/* The same math overloaded by type, for CUDA templates. */
#define MMD_BOX_OVERLOADS(A, sfx)                                                           \
    MMD_HOSTDEV inline A mmd_overlap_1d(A lo_a, A hi_a, A lo_b, A hi_b, A offset) {         \
        return mmd_overlap_1d_##sfx(lo_a, hi_a, lo_b, hi_b, offset);                        \
    }                                                                                       \
    MMD_HOSTDEV inline A mmd_box_area(const A *b, A offset) {                               \
        return mmd_box_area_##sfx(b, offset);                                               \
    }                                                                                       \
    MMD_HOSTDEV inline A mmd_box_intersection(const A *a, const A *b, A offset) {           \
        return mmd_box_intersection_##sfx(a, b, offset);                                    \
    }                                                                                       \
    MMD_HOSTDEV inline A mmd_box_ratio(A overlap, A base) {                                 \
        return mmd_box_ratio_##sfx(overlap, base);                                          \
    }                                                                                       \
    MMD_HOSTDEV inline A mmd_box_iou(const A *a, A area_a, const A *b, A area_b, A offset) { \
        return mmd_box_iou_##sfx(a, area_a, b, area_b, offset);                             \
    }                                                                                       \
    MMD_HOSTDEV inline A mmd_box_overlap(const A *a, const A *b, int iof, A offset) {       \
        return mmd_box_overlap_##sfx(a, b, iof, offset);                                    \
    }                                                                                       \
    MMD_HOSTDEV inline auto mmd_score_key(A v) { return mmd_score_key_##sfx(v); }
MMD_BOX_OVERLOADS(float, f32)
MMD_BOX_OVERLOADS(double, f64)
#undef MMD_BOX_OVERLOADS
#endif

#endif
