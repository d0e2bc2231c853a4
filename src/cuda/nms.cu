/* nms / batched_nms on CUDA: the pipeline of mmdispatch/cuda/nms.cuh with
 * this mask kernel. The IoU math is the CPU kernel's, so both keep the same
 * boxes. float16 and bfloat16 boxes compute in float32. */
#include "mmdispatch/cuda/nms.cuh"
#include "mmdispatch/ops/nms.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

template <typename A>
__global__ void mask_kernel(const A *boxes, const int64_t *classes, int64_t n,
                            int64_t col_blocks, A threshold, A offset,
                            unsigned long long *mask) {
    const int64_t row_block = blockIdx.y, col_block = blockIdx.x;
    if (col_block < row_block) return;  // only later boxes can be suppressed
    __shared__ A col_boxes[kBlockBoxes * 4];
    __shared__ A col_areas[kBlockBoxes];
    __shared__ int64_t col_classes[kBlockBoxes];
    const int64_t col_start = col_block * kBlockBoxes;
    const int col_size = (int)min((int64_t)kBlockBoxes, n - col_start);
    if (threadIdx.x < col_size) {
        const A *b = boxes + 4 * (col_start + threadIdx.x);
        for (int c = 0; c < 4; ++c) col_boxes[4 * threadIdx.x + c] = b[c];
        col_areas[threadIdx.x] = mmd_box_area(b, offset);
        col_classes[threadIdx.x] = classes[col_start + threadIdx.x];
    }
    __syncthreads();
    const int64_t i = row_block * kBlockBoxes + threadIdx.x;
    if (i >= n) return;
    const A *box = boxes + 4 * i;
    const A area = mmd_box_area(box, offset);
    const int64_t cls = classes[i];
    unsigned long long bits = 0;
    for (int j = row_block == col_block ? threadIdx.x + 1 : 0; j < col_size; ++j)
        if (col_classes[j] == cls &&
            mmd_box_iou(box, area, col_boxes + 4 * j, col_areas[j], offset) > threshold)
            bits |= 1ull << j;
    mask[i * col_blocks + col_block] = bits;
}

/* Launches mask_kernel for nms_on_device. */
struct Mask {
    template <typename A>
    static void launch(dim3 grid, cudaStream_t stream, const A *sorted, const int64_t *classes,
                       int64_t n, int64_t col_blocks, A threshold, int64_t extra,
                       unsigned long long *mask) {
        mask_kernel<A><<<grid, kBlockBoxes, 0, stream>>>(sorted, classes, n, col_blocks,
                                                         threshold, (A)extra, mask);
    }
};

int nms_cuda(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
             const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
             int64_t offset, const mmd_context *ctx) {
    int s = mmd_nms_check(boxes, scores, idxs, keep, num_kept, iou_threshold, offset,
                          MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    return nms_on_device<4, Mask>(ctx, boxes, scores, idxs, keep, num_kept, iou_threshold,
                                  offset, "nms");
}

}  // namespace

MMD_REGISTRATIONS(cuda, nms) {
    MMD_REGISTER_DEVICE_IMPL(nms_impl, CUDA, DEFAULT, nms_cuda);
    /* a stable sort and an ordered reduction: deterministic as it is */
    MMD_REGISTER_DEVICE_IMPL(nms_impl, CUDA, DETERMINISTIC, nms_cuda);
}
