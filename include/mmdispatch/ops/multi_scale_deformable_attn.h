/* multi_scale_deformable_attn (Deformable DETR's attention, MMCV's
 * semantics): the argument checks and the sampling math shared by the CPU
 * kernels (src/cpu/multi_scale_deformable_attn.cpp) and the CUDA kernels
 * (src/cuda/multi_scale_deformable_attn.cu).
 *
 * value (N, S, M, D): S keys (every level's H_l x W_l cells, level after
 * level, row-major), M heads of D channels. spatial_shapes (L, 2) int64:
 * each level's (H_l, W_l); level_start_index (L,) int64: where each level's
 * keys start (0, H_0 W_0, ...), and S must be the sum of H_l W_l.
 * sampling_locations (N, Q, M, L, P, 2): per query, head, level and point
 * an (x, y) location in [0, 1] of the level; attention_weights (N, Q, M, L,
 * P). The output (N, Q, M * D) is, for query q and head m,
 *     sum over l, p of attention_weights[n, q, m, l, p] *
 *         bilinear(value of level l, head m; y = loc_y * H_l - 0.5, x = loc_x * W_l - 0.5)
 * with bilinear sampling as mmdispatch/bilinear.h defines it (zeros outside
 * the level; grid_sample's align_corners=False). A NaN location reads NaN
 * (its query and head's output is NaN); a location far outside reads 0 and
 * never reads memory. T, the compute type, is float or double. */
#ifndef MMDISPATCH_OPS_MULTI_SCALE_DEFORMABLE_ATTN_H
#define MMDISPATCH_OPS_MULTI_SCALE_DEFORMABLE_ATTN_H

#include "mmdispatch/bilinear.h"
#include "mmdispatch/checks.h"

struct mmd_msda_shape {
    int64_t batch, keys, heads, dims, queries, levels, points;
};

/* The arrays' shapes, dtypes and layouts; `grads` (backward only, else
 * null) are grad_output, grad_value, grad_sampling_locations and
 * grad_attention_weights; `output` is forward's (else null). */
inline int mmd_msda_check(const mmd_tensor *value, const mmd_tensor *spatial_shapes,
                          const mmd_tensor *level_start_index,
                          const mmd_tensor *sampling_locations,
                          const mmd_tensor *attention_weights, const mmd_tensor *output,
                          const mmd_tensor *const *grads, unsigned float_mask,
                          mmd_msda_shape *d) {
    const int64_t any6[6] = {MMD_ANY_DIM, MMD_ANY_DIM, MMD_ANY_DIM,
                             MMD_ANY_DIM, MMD_ANY_DIM, 2};
    const int64_t any_by_2[2] = {MMD_ANY_DIM, 2};
    int s = mmd_check_shape(value, "value", 4, any6);
    if (!s) s = mmd_check_dtype(value, "value", float_mask);
    if (!s) s = mmd_check_contiguous(value, "value");
    if (!s) s = mmd_check_shape(spatial_shapes, "spatial_shapes", 2, any_by_2);
    if (!s) s = mmd_check_dtype(spatial_shapes, "spatial_shapes", MMD_DTYPE_BIT(MMD_INT64));
    if (!s) s = mmd_check_contiguous(spatial_shapes, "spatial_shapes");
    if (!s) s = mmd_check_shape(sampling_locations, "sampling_locations", 6, any6);
    if (s) return s;
    const int64_t *loc = sampling_locations->shape;
    *d = mmd_msda_shape{value->shape[0], value->shape[1], value->shape[2], value->shape[3],
                        loc[1], spatial_shapes->shape[0], loc[4]};
    const int64_t locations[6] = {d->batch, d->queries, d->heads, d->levels, d->points, 2};
    const int64_t weights[5] = {d->batch, d->queries, d->heads, d->levels, d->points};
    const int64_t starts[1] = {d->levels};
    s = mmd_check_like(sampling_locations, "sampling_locations", 6, locations, value, "value");
    if (!s) s = mmd_check_like(attention_weights, "attention_weights", 5, weights, value, "value");
    if (!s) s = mmd_check_shape(level_start_index, "level_start_index", 1, starts);
    if (!s) s = mmd_check_dtype(level_start_index, "level_start_index", MMD_DTYPE_BIT(MMD_INT64));
    if (!s) s = mmd_check_contiguous(level_start_index, "level_start_index");
    const int64_t out_shape[3] = {d->batch, d->queries, d->heads * d->dims};
    if (!s && output) s = mmd_check_like(output, "output", 3, out_shape, value, "value");
    if (!s && grads) {
        s = mmd_check_like(grads[0], "grad_output", 3, out_shape, value, "value");
        if (!s) s = mmd_check_like(grads[1], "grad_value", 4, value->shape, value, "value");
        if (!s) s = mmd_check_like(grads[2], "grad_sampling_locations", 6, locations, value,
                                   "value");
        if (!s) s = mmd_check_like(grads[3], "grad_attention_weights", 5, weights, value,
                                   "value");
    }
    return s;
}

/* What is wrong with the levels (codes for deferred errors too). */
enum {
    MMD_MSDA_LEVELS_OK = 0,
    MMD_MSDA_BAD_SIZE = 1,    /* spatial_shapes[l] has a size < 0 or >= 2**31 */
    MMD_MSDA_BAD_START = 2,   /* level_start_index[l] is not the keys before level l */
    MMD_MSDA_BAD_TOTAL = 3,   /* the levels do not hold exactly value's S keys */
};

/* Level l's (H, W, start) checked against the keys the levels before it
 * hold (`before`), which it then advances; MMD_MSDA_LEVELS_OK or what is
 * wrong. The last level (`last`) must end at `keys`. Host and device. */
MMD_HOSTDEV inline int mmd_msda_level_fault(int64_t h, int64_t w, int64_t start, int64_t keys,
                                            bool last, int64_t *before) {
    if (h < 0 || w < 0 || h > INT32_MAX || w > INT32_MAX) return MMD_MSDA_BAD_SIZE;
    if (start != *before) return MMD_MSDA_BAD_START;
    *before += h * w;   /* < 2**62 + keys: no overflow */
    if (*before > keys || (last && *before != keys)) return MMD_MSDA_BAD_TOTAL;
    return MMD_MSDA_LEVELS_OK;
}

/* The message for level l's fault (host arrays, or a deferred error's
 * code with the values unknown: shapes and starts null). */
inline int mmd_msda_level_error(int fault, int64_t level, const int64_t *shapes,
                                const int64_t *starts, int64_t keys) {
    if (fault == MMD_MSDA_BAD_SIZE) {
        if (!shapes)
            return mmd_error(MMD_ERR_VALUE, "spatial_shapes[%lld]: sizes must be >= 0 and "
                             "< 2**31", (long long)level);
        return mmd_error(MMD_ERR_VALUE, "spatial_shapes[%lld] = (%lld, %lld): sizes must be "
                         ">= 0 and < 2**31", (long long)level, (long long)shapes[2 * level],
                         (long long)shapes[2 * level + 1]);
    }
    if (fault == MMD_MSDA_BAD_START) {
        if (!starts)
            return mmd_error(MMD_ERR_VALUE, "level_start_index[%lld] is not the number of "
                             "keys in the levels before it (spatial_shapes)", (long long)level);
        return mmd_error(MMD_ERR_VALUE, "level_start_index[%lld] = %lld is not the number of "
                         "keys in the levels before it (spatial_shapes)", (long long)level,
                         (long long)starts[level]);
    }
    return mmd_error(MMD_ERR_VALUE, "the levels of spatial_shapes do not hold exactly value's "
                     "%lld keys (its dimension 1 must be the sum of H * W; found at level "
                     "%lld)", (long long)keys, (long long)level);
}

/* The first fault of the levels (MMD_MSDA_LEVELS_OK if none), its level
 * in *level. Host and device (one thread). */
MMD_HOSTDEV inline int mmd_msda_levels_fault(const int64_t *shapes, const int64_t *starts,
                                             int64_t levels, int64_t keys, int64_t *level) {
    int64_t before = 0;
    *level = 0;
    for (int64_t l = 0; l < levels; ++l) {
        const int fault = mmd_msda_level_fault(shapes[2 * l], shapes[2 * l + 1], starts[l], keys,
                                               l == levels - 1, &before);
        if (fault) {
            *level = l;
            return fault;
        }
    }
    return levels == 0 && keys != 0 ? MMD_MSDA_BAD_TOTAL : MMD_MSDA_LEVELS_OK;
}

/* Host check of the levels (arrays the caller can read). */
inline int mmd_msda_check_levels(const int64_t *shapes, const int64_t *starts, int64_t levels,
                                 int64_t keys) {
    int64_t level;
    const int fault = mmd_msda_levels_fault(shapes, starts, levels, keys, &level);
    return fault ? mmd_msda_level_error(fault, level, shapes, starts, keys) : MMD_OK;
}

/* Whether level (h, w) starting at key `start` lies within value's keys:
 * the CUDA kernels, which do not wait for the levels' check, read only
 * such levels. */
MMD_HOSTDEV inline bool mmd_msda_level_inside(int64_t h, int64_t w, int64_t start,
                                              int64_t keys) {
    return h >= 0 && w >= 0 && h <= INT32_MAX && w <= INT32_MAX && start >= 0 &&
           start <= keys && h * w <= keys - start;
}

/* Where a location samples level (h, w): cell units, pixel centres at .5. */
template <typename T>
MMD_HOSTDEV inline void mmd_msda_locate(T loc_x, T loc_y, int64_t h, int64_t w,
                                        mmd_bilinear_sample<T> *s) {
    mmd_bilinear_locate(loc_y * (T)h - (T)0.5, loc_x * (T)w - (T)0.5, h, w, s);
}

#endif
