/* box_iou_rotated on CUDA: the exact polygon of
 * mmdispatch/ops/box_iou_rotated.h in double whatever the storage type
 * (float16 and bfloat16 included): a thread per pair when aligned, else the
 * table in tiles (table_kernel). Launches on ctx->stream, on
 * ctx->device_id. */
#include "mmdispatch/cuda/common.cuh"
#include "mmdispatch/ops/box_iou_rotated.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

/* box i made ready for the polygon (its corners, diagonal and area) */
template <typename T>
__device__ inline mmd_rbox_shape shape_at(const T *boxes, int64_t i, bool clockwise) {
    const T *b = boxes + 5 * i;
    return mmd_rbox_prepare(mmd_rbox{(double)to_compute(b[0]), (double)to_compute(b[1]),
                                     (double)to_compute(b[2]), (double)to_compute(b[3]),
                                     (double)to_compute(b[4])},
                            clockwise);
}

/* aligned: one thread per pair */
template <typename T>
__global__ void pairs_kernel(const T *boxes1, const T *boxes2, T *ious, int64_t pairs,
                             int64_t mode, bool clockwise) {
    typedef typename Compute<T>::type A;
    MMD_GRID_STRIDE_LOOP(i, pairs) {
        const double overlap = mmd_rbox_overlap(shape_at(boxes1, i, clockwise),
                                                shape_at(boxes2, i, clockwise), mode);
        ious[i] = from_compute<T>((A)overlap);
    }
}

/* The (rows, cols) table in tiles of up to kTile x kTile boxes: the block
 * makes the tile's row and column boxes ready (corners, diagonal, area)
 * once, in shared memory, then its threads take the tile's pairs in
 * row-major order. So each box's corners are computed once per tile
 * instead of for every pair, writes are coalesced, and a narrow table (a
 * few ground-truth boxes against many anchors) keeps every thread busy.
 * Row tiles beyond the grid's height are taken in turn. */
constexpr int kTile = 64;
constexpr int kTableThreads = 256;

template <typename T>
__global__ void table_kernel(const T *boxes1, const T *boxes2, T *ious, int64_t rows,
                             int64_t cols, int64_t mode, bool clockwise) {
    typedef typename Compute<T>::type A;
    __shared__ mmd_rbox_shape row_boxes[kTile], col_boxes[kTile];
    const int64_t col_first = blockIdx.x * (int64_t)kTile;
    const int width = (int)min((int64_t)kTile, cols - col_first);
    if (threadIdx.x < width)
        col_boxes[threadIdx.x] = shape_at(boxes2, col_first + threadIdx.x, clockwise);
    for (int64_t row_first = blockIdx.y * (int64_t)kTile; row_first < rows;
         row_first += (int64_t)gridDim.y * kTile) {
        const int height = (int)min((int64_t)kTile, rows - row_first);
        __syncthreads();   /* the previous tile's rows are read */
        if (threadIdx.x < height)
            row_boxes[threadIdx.x] = shape_at(boxes1, row_first + threadIdx.x, clockwise);
        __syncthreads();
        T *tile = ious + row_first * cols + col_first;
        for (int pair = threadIdx.x; pair < height * width; pair += kTableThreads) {
            const int r = pair / width, c = pair % width;
            tile[r * cols + c] = from_compute<T>((A)mmd_rbox_overlap(row_boxes[r], col_boxes[c],
                                                                     mode));
        }
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
            const T *b1 = (const T *)boxes1->data, *b2 = (const T *)boxes2->data;
            if (aligned) {
                pairs_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
                    b1, b2, (T *)ious->data, total, mode, clockwise != 0);
            } else {
                const int64_t rows = boxes1->shape[0], cols = boxes2->shape[0];
                const int64_t row_tiles = (rows + kTile - 1) / kTile;
                const int64_t col_tiles = (cols + kTile - 1) / kTile;
                if (col_tiles > INT32_MAX)
                    return mmd_error(MMD_ERR_VALUE, "CUDA box_iou_rotated takes at most %lld "
                                     "boxes2, got %lld", (long long)INT32_MAX * kTile,
                                     (long long)cols);
                const dim3 grid((unsigned)col_tiles,
                                (unsigned)(row_tiles < MMD_CUDA_MAX_GRID_Y ? row_tiles
                                                                          : MMD_CUDA_MAX_GRID_Y));
                table_kernel<T><<<grid, kTableThreads, 0, stream>>>(
                    b1, b2, (T *)ious->data, rows, cols, mode, clockwise != 0);
            }
            return launch_status("box_iou_rotated launch");
        });
    });
}

}  // namespace

MMD_REGISTRATIONS(cuda, box_iou_rotated) {
    MMD_REGISTER_DEVICE_IMPL(box_iou_rotated_impl, CUDA, DEFAULT, box_iou_rotated_cuda);
    /* each output element computed by one thread: deterministic as it is */
    MMD_REGISTER_DEVICE_IMPL(box_iou_rotated_impl, CUDA, DETERMINISTIC, box_iou_rotated_cuda);
}
