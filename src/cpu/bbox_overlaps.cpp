/* bbox_overlaps on CPU: rows of the (N, M) result (or pairs, when aligned)
 * are split over the worker pool. */
#include "mmdispatch/ops/bbox_overlaps.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

template <typename T>
void bbox_overlaps(const mmd_tensor *bboxes1, const mmd_tensor *bboxes2, const mmd_tensor *ious,
                   int64_t mode, int aligned, int64_t offset) {
    const int64_t rows = bboxes1->shape[0], cols = bboxes2->shape[0];
    const T *a = (const T *)bboxes1->data, *b = (const T *)bboxes2->data;
    T *out = (T *)ious->data;
    const int iof = mode == MMD_OVERLAP_IOF;
    const T off = (T)offset;
    mmd_parallel_for(rows, mmd_even_chunk(rows),
                     mmd_worth_threads(rows, aligned ? rows : rows * cols),
                     [&](int64_t begin, int64_t end) {
                         for (int64_t i = begin; i < end; ++i) {
                             if (aligned) {
                                 out[i] = mmd_box_overlap(a + 4 * i, b + 4 * i, iof, off);
                                 continue;
                             }
                             for (int64_t j = 0; j < cols; ++j)
                                 out[i * cols + j] = mmd_box_overlap(a + 4 * i, b + 4 * j, iof,
                                                                     off);
                         }
                         return (int)MMD_OK;
                     });
}

int bbox_overlaps_cpu(const mmd_tensor *bboxes1, const mmd_tensor *bboxes2,
                      const mmd_tensor *ious, int64_t mode, int aligned, int64_t offset,
                      const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_bbox_overlaps_check(bboxes1, bboxes2, ious, mode, aligned, offset,
                                    MMD_FLOAT32_64);
    if (s) return s;
    if (bboxes1->dtype == MMD_FLOAT32)
        bbox_overlaps<float>(bboxes1, bboxes2, ious, mode, aligned, offset);
    else
        bbox_overlaps<double>(bboxes1, bboxes2, ious, mode, aligned, offset);
    return MMD_OK;
}

}  // namespace

MMD_REGISTRATIONS(cpu, bbox_overlaps) {
    MMD_REGISTER_DEVICE_IMPL(bbox_overlaps_impl, CPU, DEFAULT, bbox_overlaps_cpu);
}
