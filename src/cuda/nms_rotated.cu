/* nms_rotated / batched_nms_rotated on CUDA: the pipeline of
 * mmdispatch/cuda/nms.cuh with this mask kernel, whose suppression test is
 * the CPU kernel's (mmdispatch/ops/nms_rotated.h: box_iou_rotated's exact
 * polygon in double), so both keep the same boxes unless an IoU lies
 * within the last bit of the threshold (CUDA's sin and cos may differ from
 * the host's there). float16 and bfloat16 boxes are gathered in float32. */
#include "mmdispatch/cuda/nms.cuh"
#include "mmdispatch/ops/nms_rotated.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

template <typename A>
__global__ void mask_kernel(const A *boxes, const int64_t *classes, int64_t n,
                            int64_t col_blocks, A threshold, bool clockwise,
                            unsigned long long *mask) {
    const int64_t row_block = blockIdx.y, col_block = blockIdx.x;
    if (col_block < row_block) return;  // only later boxes can be suppressed
    __shared__ mmd_rbox_shape col_boxes[kBlockBoxes];
    __shared__ int64_t col_classes[kBlockBoxes];
    const int64_t col_start = col_block * kBlockBoxes;
    const int col_size = (int)min((int64_t)kBlockBoxes, n - col_start);
    if (threadIdx.x < col_size) {
        col_boxes[threadIdx.x] = mmd_rbox_shape_at(boxes, col_start + threadIdx.x, clockwise);
        col_classes[threadIdx.x] = classes[col_start + threadIdx.x];
    }
    __syncthreads();
    const int64_t i = row_block * kBlockBoxes + threadIdx.x;
    if (i >= n) return;
    const mmd_rbox_shape box = mmd_rbox_shape_at(boxes, i, clockwise);
    const int64_t cls = classes[i];
    unsigned long long bits = 0;
    for (int j = row_block == col_block ? threadIdx.x + 1 : 0; j < col_size; ++j)
        if (col_classes[j] == cls &&
            mmd_rotated_suppresses(box, col_boxes[j], threshold))
            bits |= 1ull << j;
    mask[i * col_blocks + col_block] = bits;
}

/* Launches mask_kernel for nms_on_device. */
struct Mask {
    template <typename A>
    static void launch(dim3 grid, cudaStream_t stream, const A *sorted, const int64_t *classes,
                       int64_t n, int64_t col_blocks, A threshold, bool extra,
                       unsigned long long *mask) {
        mask_kernel<A><<<grid, kBlockBoxes, 0, stream>>>(sorted, classes, n, col_blocks,
                                                         threshold, extra, mask);
    }
};

int nms_rotated_cuda(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                     const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
                     int clockwise, const mmd_context *ctx) {
    int s = mmd_nms_rotated_check(boxes, scores, idxs, keep, num_kept, iou_threshold,
                                  MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    return nms_on_device<5, Mask>(ctx, boxes, scores, idxs, keep, num_kept, iou_threshold,
                                  clockwise != 0, "nms_rotated");
}

}  // namespace

MMD_REGISTRATIONS(cuda, nms_rotated) {
    MMD_REGISTER_DEVICE_IMPL(nms_rotated_impl, CUDA, DEFAULT, nms_rotated_cuda);
    /* a stable sort and an ordered reduction: deterministic as it is */
    MMD_REGISTER_DEVICE_IMPL(nms_rotated_impl, CUDA, DETERMINISTIC, nms_rotated_cuda);
}
