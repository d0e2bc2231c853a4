/* box_iou_rotated on CPU: rows of the (N, M) result (or pairs, when
 * aligned) are split over the worker pool; each pair's intersection is
 * the exact polygon of mmdispatch/ops/box_iou_rotated.h, in double, with
 * each box's corners computed once per row or block of columns. */
#include "mmdispatch/ops/box_iou_rotated.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "heap_array.h"

namespace {

/* boxes2 are made ready (mmd_rbox_prepare) kBlockBoxes at a time, so the
 * table stays in cache and its size bounded */
constexpr int64_t kBlockBoxes = 1024;

template <typename T>
int box_iou_rotated(const mmd_tensor *boxes1, const mmd_tensor *boxes2, const mmd_tensor *ious,
                    int64_t mode, int aligned, bool clockwise) {
    const int64_t rows = boxes1->shape[0], cols = boxes2->shape[0];
    const T *a = (const T *)boxes1->data, *b = (const T *)boxes2->data;
    T *out = (T *)ious->data;
    if (aligned) {
        return mmd_parallel_for(rows, mmd_even_chunk(rows), mmd_worth_threads(rows, 16 * rows),
                                [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i)
                out[i] = (T)mmd_rbox_overlap(mmd_rbox_shape_at(a, i, clockwise), mmd_rbox_shape_at(b, i, clockwise),
                                             mode);
            return (int)MMD_OK;
        });
    }
    HeapArray<mmd_rbox_shape> block(cols < kBlockBoxes ? cols : kBlockBoxes);
    if (!block) return mmd_error(MMD_ERR_MEMORY, "out of memory for %lld boxes", (long long)cols);
    for (int64_t first = 0; first < cols; first += kBlockBoxes) {
        const int64_t width = cols - first < kBlockBoxes ? cols - first : kBlockBoxes;
        for (int64_t j = 0; j < width; ++j) block[j] = mmd_rbox_shape_at(b, first + j, clockwise);
        /* a pair costs a few hundred steps when the boxes meet */
        const int s = mmd_parallel_for(rows, mmd_even_chunk(rows),
                                       mmd_worth_threads(rows, 16 * rows * width),
                                       [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
                const mmd_rbox_shape box = mmd_rbox_shape_at(a, i, clockwise);
                T *row = out + i * cols + first;
                for (int64_t j = 0; j < width; ++j)
                    row[j] = (T)mmd_rbox_overlap(box, block[j], mode);
            }
            return (int)MMD_OK;
        });
        if (s) return s;
    }
    return MMD_OK;
}

int box_iou_rotated_cpu(const mmd_tensor *boxes1, const mmd_tensor *boxes2,
                        const mmd_tensor *ious, int64_t mode, int aligned, int clockwise,
                        const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_box_iou_rotated_check(boxes1, boxes2, ious, mode, aligned, MMD_FLOAT32_64);
    if (s) return s;
    if (boxes1->dtype == MMD_FLOAT32)
        return box_iou_rotated<float>(boxes1, boxes2, ious, mode, aligned, clockwise != 0);
    return box_iou_rotated<double>(boxes1, boxes2, ious, mode, aligned, clockwise != 0);
}

}  // namespace

MMD_REGISTRATIONS(cpu, box_iou_rotated) {
    MMD_REGISTER_DEVICE_IMPL(box_iou_rotated_impl, CPU, DEFAULT, box_iou_rotated_cpu);
}
