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

static void TFN(bbox_overlaps)(const mmd_tensor *bboxes1, const mmd_tensor *bboxes2,
                               const mmd_tensor *ious, int64_t mode, int aligned,
                               int64_t offset) {
    const int64_t rows = bboxes1->shape[0], cols = bboxes2->shape[0];
    const T *a = (const T *)bboxes1->data, *b = (const T *)bboxes2->data;
    T *out = (T *)ious->data;
    const T off = (T)offset;
    const int iof = mode == MMD_OVERLAP_IOF;
    const int64_t work = aligned ? rows : rows * cols;
#pragma omp parallel for schedule(static) if (mmd_worth_threads(rows, work))
    for (int64_t i = 0; i < rows; ++i) {
        if (aligned) {
            out[i] = TFN(mmd_box_overlap)(a + 4 * i, b + 4 * i, iof, off);
            continue;
        }
        for (int64_t j = 0; j < cols; ++j)
            out[i * cols + j] = TFN(mmd_box_overlap)(a + 4 * i, b + 4 * j, iof, off);
    }
}

#undef T
#undef TFN
#endif
