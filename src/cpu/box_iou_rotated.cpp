/* box_iou_rotated on CPU: rows of the (N, M) result (or pairs, when
 * aligned) are split over the worker pool; each pair's intersection is
 * the exact polygon of mmdispatch/ops/box_iou_rotated.h, in double. */
#include "mmdispatch/ops/box_iou_rotated.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

template <typename T> mmd_rbox box_at(const T *boxes, int64_t i) {
    const T *b = boxes + 5 * i;
    return mmd_rbox{(double)b[0], (double)b[1], (double)b[2], (double)b[3], (double)b[4]};
}

template <typename T>
void box_iou_rotated(const mmd_tensor *boxes1, const mmd_tensor *boxes2, const mmd_tensor *ious,
                     int64_t mode, int aligned, bool clockwise) {
    const int64_t rows = boxes1->shape[0], cols = boxes2->shape[0];
    const T *a = (const T *)boxes1->data, *b = (const T *)boxes2->data;
    T *out = (T *)ious->data;
    /* a pair costs a few hundred steps when the boxes meet */
    mmd_parallel_for(rows, mmd_even_chunk(rows),
                     mmd_worth_threads(rows, 16 * (aligned ? rows : rows * cols)),
                     [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const mmd_rbox box = box_at(a, i);
            if (aligned) {
                out[i] = (T)mmd_rbox_overlap(box, box_at(b, i), mode, clockwise);
                continue;
            }
            for (int64_t j = 0; j < cols; ++j)
                out[i * cols + j] = (T)mmd_rbox_overlap(box, box_at(b, j), mode, clockwise);
        }
        return (int)MMD_OK;
    });
}

int box_iou_rotated_cpu(const mmd_tensor *boxes1, const mmd_tensor *boxes2,
                        const mmd_tensor *ious, int64_t mode, int aligned, int clockwise,
                        const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_box_iou_rotated_check(boxes1, boxes2, ious, mode, aligned, MMD_FLOAT32_64);
    if (s) return s;
    if (boxes1->dtype == MMD_FLOAT32)
        box_iou_rotated<float>(boxes1, boxes2, ious, mode, aligned, clockwise != 0);
    else
        box_iou_rotated<double>(boxes1, boxes2, ious, mode, aligned, clockwise != 0);
    return MMD_OK;
}

}  // namespace

MMD_REGISTRATIONS(cpu, box_iou_rotated) {
    MMD_REGISTER_DEVICE_IMPL(box_iou_rotated_impl, CPU, DEFAULT, box_iou_rotated_cpu);
}
