/* bbox_overlaps on CPU: rows of the (N, M) result (or pairs, when aligned) are split over
 * OpenMP threads. The typed kernels (after #else, with T / TFN naming the type and the name
 * suffix) are instantiated for float and double through mmdispatch/typed.h. */
#ifndef MMD_REAL

#include "mmdispatch/ops/bbox_overlaps.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"

#define MMD_TYPED_FILE "bbox_overlaps.c"
#include "mmdispatch/typed.h"

int mmd_bbox_overlaps_check(const mmd_tensor *bboxes1, const mmd_tensor *bboxes2,
                            const mmd_tensor *ious, int64_t mode, int aligned, int64_t offset,
                            unsigned float_mask) {
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

static int bbox_overlaps_cpu(const mmd_tensor *bboxes1, const mmd_tensor *bboxes2,
                             const mmd_tensor *ious, int64_t mode, int aligned, int64_t offset,
                             const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_bbox_overlaps_check(bboxes1, bboxes2, ious, mode, aligned, offset,
                                    MMD_FLOAT32_64);
    if (s) return s;
    if (bboxes1->dtype == MMD_FLOAT32)
        bbox_overlaps_f32(bboxes1, bboxes2, ious, mode, aligned, offset);
    else
        bbox_overlaps_f64(bboxes1, bboxes2, ious, mode, aligned, offset);
    return MMD_OK;
}

#include "mmdispatch_generated.h"

MMD_REGISTRATIONS(cpu, bbox_overlaps) {
    MMD_REGISTER_DEVICE_IMPL(bbox_overlaps_impl, CPU, DEFAULT, bbox_overlaps_cpu);
}

#else /* typed kernel, instantiated above for float and double */
#define T MMD_REAL
#define TFN MMD_FN

/* The loop over rows of bboxes1. */
struct TFN(overlaps_loop) {
    const T *a, *b;
    T *out;
    int64_t cols;
    int iof, aligned;
    T offset;
};

static int TFN(overlap_rows)(const void *loop, int64_t begin, int64_t end) {
    const struct TFN(overlaps_loop) *l = (const struct TFN(overlaps_loop) *)loop;
    const T *a = l->a, *b = l->b;
    for (int64_t i = begin; i < end; ++i) {
        if (l->aligned) {
            l->out[i] = TFN(mmd_box_overlap)(a + 4 * i, b + 4 * i, l->iof, l->offset);
            continue;
        }
        for (int64_t j = 0; j < l->cols; ++j)
            l->out[i * l->cols + j] = TFN(mmd_box_overlap)(a + 4 * i, b + 4 * j, l->iof,
                                                           l->offset);
    }
    return MMD_OK;
}

static void TFN(bbox_overlaps)(const mmd_tensor *bboxes1, const mmd_tensor *bboxes2,
                               const mmd_tensor *ious, int64_t mode, int aligned,
                               int64_t offset) {
    const int64_t rows = bboxes1->shape[0], cols = bboxes2->shape[0];
    const struct TFN(overlaps_loop) loop = {
        (const T *)bboxes1->data, (const T *)bboxes2->data, (T *)ious->data, cols,
        mode == MMD_OVERLAP_IOF, aligned, (T)offset};
    mmd_parallel_for(rows, mmd_even_chunk(rows),
                     mmd_worth_threads(rows, aligned ? rows : rows * cols), TFN(overlap_rows),
                     &loop);
}

#undef T
#undef TFN
#endif
