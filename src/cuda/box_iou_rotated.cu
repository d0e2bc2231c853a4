/* box_iou_rotated on CUDA: one thread per output element, the exact
 * polygon of mmdispatch/ops/box_iou_rotated.h in double whatever the
 * storage type (float16 and bfloat16 included). Launches on ctx->stream,
 * on ctx->device_id. */
#include "mmdispatch/cuda/common.cuh"
#include "mmdispatch/ops/box_iou_rotated.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

template <typename T> __device__ inline mmd_rbox load_box(const T *boxes, int64_t i) {
    const T *b = boxes + 5 * i;
    return mmd_rbox{(double)to_compute(b[0]), (double)to_compute(b[1]), (double)to_compute(b[2]),
                    (double)to_compute(b[3]), (double)to_compute(b[4])};
}

template <typename T>
__global__ void overlaps_kernel(const T *boxes1, const T *boxes2, T *ious, int64_t rows,
                                int64_t cols, int64_t mode, int aligned, bool clockwise) {
    typedef typename Compute<T>::type A;
    const int64_t total = aligned ? rows : rows * cols;
    MMD_GRID_STRIDE_LOOP(index, total) {
        const int64_t i = aligned ? index : index / cols;
        const int64_t j = aligned ? index : index % cols;
        const double overlap = mmd_rbox_overlap(load_box(boxes1, i), load_box(boxes2, j), mode,
                                                clockwise);
        ious[index] = from_compute<T>((A)overlap);
    }
}

int box_iou_rotated_cuda(const mmd_tensor *boxes1, const mmd_tensor *boxes2,
                         const mmd_tensor *ious, int64_t mode, int aligned, int clockwise,
                         const mmd_context *ctx) {
    int s = mmd_box_iou_rotated_check(boxes1, boxes2, ious, mode, aligned,
                                      MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t total = mmd_numel(ious);
    if (total == 0) return MMD_OK;
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(boxes1->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            overlaps_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
                (const T *)boxes1->data, (const T *)boxes2->data, (T *)ious->data,
                boxes1->shape[0], boxes2->shape[0], mode, aligned, clockwise != 0);
            return launch_status("box_iou_rotated launch");
        });
    });
}

}  // namespace

MMD_REGISTRATIONS(cuda, box_iou_rotated) {
    MMD_REGISTER_DEVICE_IMPL(box_iou_rotated_impl, CUDA, DEFAULT, box_iou_rotated_cuda);
    /* one thread per output element: deterministic as it is */
    MMD_REGISTER_DEVICE_IMPL(box_iou_rotated_impl, CUDA, DETERMINISTIC, box_iou_rotated_cuda);
}
