/* bbox_overlaps on CUDA: one thread per output element; float16 and
 * bfloat16 boxes compute in float32. Launches on ctx->stream, on
 * ctx->device_id. */
#include "mmdispatch/cuda/common.cuh"
#include "mmdispatch/ops/bbox_overlaps.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

template <typename T, typename A>
__device__ inline void load_box(const T *boxes, int64_t i, A out[4]) {
    for (int k = 0; k < 4; ++k) out[k] = to_compute(boxes[4 * i + k]);
}

template <typename T>
__global__ void overlaps_kernel(const T *bboxes1, const T *bboxes2, T *ious, int64_t rows,
                                int64_t cols, int64_t mode, int aligned,
                                typename Compute<T>::type offset) {
    typedef typename Compute<T>::type A;
    const int64_t total = aligned ? rows : rows * cols;
    MMD_GRID_STRIDE_LOOP(index, total) {
        const int64_t i = aligned ? index : index / cols;
        const int64_t j = aligned ? index : index % cols;
        A a[4], b[4];
        load_box(bboxes1, i, a);
        load_box(bboxes2, j, b);
        ious[index] = from_compute<T>(mmd_box_overlap(a, b, mode == MMD_OVERLAP_IOF, offset));
    }
}

int bbox_overlaps_cuda(const mmd_tensor *bboxes1, const mmd_tensor *bboxes2,
                       const mmd_tensor *ious, int64_t mode, int aligned, int64_t offset,
                       const mmd_context *ctx) {
    int s = mmd_bbox_overlaps_check(bboxes1, bboxes2, ious, mode, aligned, offset,
                                    MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t total = mmd_numel(ious);
    if (total == 0) return MMD_OK;
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(bboxes1->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            overlaps_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
                (const T *)bboxes1->data, (const T *)bboxes2->data, (T *)ious->data,
                bboxes1->shape[0], bboxes2->shape[0], mode, aligned,
                (typename Compute<T>::type)offset);
            return launch_status("bbox_overlaps launch");
        });
    });
}

}  // namespace

MMD_REGISTRATIONS(cuda, bbox_overlaps) {
    MMD_REGISTER_DEVICE_IMPL(bbox_overlaps_impl, CUDA, DEFAULT, bbox_overlaps_cuda);
    /* one thread per output element: deterministic as it is */
    MMD_REGISTER_DEVICE_IMPL(bbox_overlaps_impl, CUDA, DETERMINISTIC, bbox_overlaps_cuda);
}
