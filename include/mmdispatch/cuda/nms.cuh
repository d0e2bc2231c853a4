/* The parts of an nms on CUDA that do not depend on the box type (nms.cu,
 * nms_rotated.cu), entirely on the device (only the count of kept boxes is
 * read back, by the caller):
 *   1. score keys (mmdispatch/ops/boxes.h) sorted descending with CUB's
 *      stable radix sort, so ties keep the lower index first, as on CPU;
 *   2. boxes (and classes) gathered in that order;
 *   3. (the op's own mask kernel) a 64-wide bitmask per box: bit j of
 *      mask[i][b] says box i (in sorted order) suppresses box 64 * b + j,
 *      computed for all pairs in parallel;
 *   4. one block walks the 64-box blocks in order: a warp resolves the block
 *      with register shuffles (a step per kept box) and loads the next
 *      block's rows, then all threads fold the kept boxes' masks into the
 *      later blocks' `removed` words (in shared memory up to 385,024
 *      boxes), the loads of a (column, kept box) pair each spread over the
 *      threads.
 * Memory: n * ceil(n / 64) * 8 bytes of mask. */
#ifndef MMDISPATCH_CUDA_NMS_CUH
#define MMDISPATCH_CUDA_NMS_CUH

#include <cub/device/device_radix_sort.cuh>

#include "mmdispatch/cuda/common.cuh"
#include "mmdispatch/ops/boxes.h"

namespace mmd_cuda {

constexpr int kBlockBoxes = 64;
constexpr int kReduceThreads = 256;
constexpr int64_t kMaxBoxes = (int64_t)kBlockBoxes * 65535;  // gridDim.y limit of step 3

/* Sort key type of a compute type. */
template <typename A> struct KeyOf { typedef uint32_t type; };
template <> struct KeyOf<double> { typedef uint64_t type; };

template <typename T, typename K>
__global__ void keys_kernel(const T *scores, int64_t n, K *keys, int64_t *indices) {
    MMD_GRID_STRIDE_LOOP(i, n) {
        keys[i] = mmd_score_key(to_compute(scores[i]));
        indices[i] = i;
    }
}

/* Boxes of `Width` values (and their classes) in sorted order. */
template <int Width, typename T, typename A>
__global__ void gather_kernel(const T *boxes, const int64_t *idxs, const int64_t *order,
                              int64_t n, A *sorted_boxes, int64_t *sorted_classes) {
    MMD_GRID_STRIDE_LOOP(k, n) {
        const int64_t i = order[k];
        for (int c = 0; c < Width; ++c)
            sorted_boxes[Width * k + c] = to_compute(boxes[Width * i + c]);
        sorted_classes[k] = idxs ? idxs[i] : 0;
    }
}

/* Whether step 4 keeps the `removed` words in shared memory, else in
 * global memory. Without an opt-in a block has 48 KB of shared memory,
 * its static arrays (kept_rows and kept_count: 528 bytes on sm_90)
 * included: 6,016 words (47 KB, 385,024 boxes) leave 1 KB for them. The
 * CUDA emulator's build lowers the limit, so that its tests take both
 * ways. */
#ifndef MMD_CUDA_NMS_SHARED_WORDS
#define MMD_CUDA_NMS_SHARED_WORDS 6016
#endif
static_assert(MMD_CUDA_NMS_SHARED_WORDS * 8 + kBlockBoxes * 8 + 16 <= 48 * 1024,
              "reduce_kernel's static and dynamic shared memory within 48 KB");
__host__ __device__ inline bool removed_in_shared(int64_t col_blocks) {
    return col_blocks <= MMD_CUDA_NMS_SHARED_WORDS;
}

/* Step 4. `removed`: col_blocks zeroed words of global memory, used only
 * where they do not fit in shared memory (removed_in_shared). */
static __global__ void reduce_kernel(const unsigned long long *mask, const int64_t *order,
                                     int64_t n, int64_t col_blocks,
                                     unsigned long long *removed_global, int64_t *keep,
                                     int64_t *num_kept) {
    extern __shared__ unsigned long long removed_shared[];
    __shared__ int64_t kept_rows[kBlockBoxes];   /* this block's kept boxes, in order */
    __shared__ int kept_count;
    const bool in_shared = removed_in_shared(col_blocks);
    unsigned long long *removed = in_shared ? removed_shared : removed_global;
    if (in_shared)
        for (int64_t c = threadIdx.x; c < col_blocks; c += blockDim.x) removed_shared[c] = 0;
    const unsigned lane = threadIdx.x % 32;
    /* lane l of warp 0 holds the in-block masks of rows l and l + 32 of
     * the block it resolves; the next block's are loaded while this one's
     * kept boxes are folded (they do not depend on the fold) */
    unsigned long long row_lo = 0, row_hi = 0;
    auto load_rows = [&](int64_t b) {
        const int64_t start = b * kBlockBoxes;
        const int size = (int)min((int64_t)kBlockBoxes, n - start);
        row_lo = lane < size ? mask[(start + lane) * col_blocks + b] : 0;
        row_hi = lane + 32 < size ? mask[(start + lane + 32) * col_blocks + b] : 0;
    };
    if (threadIdx.x < 32) load_rows(0);
    __syncthreads();
    int64_t count = 0;
    for (int64_t b = 0; b < col_blocks; ++b) {
        const int64_t start = b * kBlockBoxes;
        const int size = (int)min((int64_t)kBlockBoxes, n - start);
        if (threadIdx.x < 32) {
            /* every lane runs the same steps, one per kept box: the first
             * box not yet removed is kept and removes what its row says
             * (bits past the block's end count as removed) */
            unsigned long long word = removed[b] | (size < 64 ? ~0ull << size : 0ull), kept = 0;
            while (~word) {
                const int t = __ffsll((long long)~word) - 1;
                const unsigned long long row =
                    __shfl_sync(0xffffffffu, t < 32 ? row_lo : row_hi, t % 32);
                kept |= 1ull << t;
                word |= row | (1ull << t);
            }
            for (int t = lane; t < size; t += 32)
                if ((kept >> t) & 1ull) {
                    const int rank = __popcll(kept & ((1ull << t) - 1));
                    keep[count + rank] = order[start + t];
                    kept_rows[rank] = start + t;
                }
            if (lane == 0) kept_count = __popcll(kept);
            if (b + 1 < col_blocks) load_rows(b + 1);
        }
        __syncthreads();
        /* the kept boxes' masks folded into the later blocks' `removed`
         * words: the (column, kept box) loads spread over the threads,
         * `slices` threads to a column when the columns are few */
        const int kept_here = kept_count;
        const int64_t columns = col_blocks - b - 1;
        if (kept_here > 0 && columns > 0) {
            int64_t slices = 4 * (int64_t)blockDim.x / columns;
            slices = slices < 1 ? 1 : (slices > kept_here ? kept_here : slices);
            for (int64_t item = threadIdx.x; item < columns * slices; item += blockDim.x) {
                const int64_t c = b + 1 + item / slices;
                unsigned long long acc = 0;
#pragma unroll 4
                for (int j = (int)(item % slices); j < kept_here; j += (int)slices)
                    acc |= mask[kept_rows[j] * col_blocks + c];
                if (acc) atomicOr(removed + c, acc);
            }
        }
        count += kept_here;
        __syncthreads();
    }
    if (threadIdx.x == 0) *num_kept = count;
}

/* Sorts pairs with CUB into (keys_out, values_out), ascending or not;
 * with a null scratch, only sets *bytes to the scratch it needs. */
template <typename K>
cudaError_t sort_pairs(void *scratch, size_t *bytes, const K *keys_in, K *keys_out,
                       const int64_t *values_in, int64_t *values_out, int64_t n, bool descending,
                       cudaStream_t stream) {
    if (descending)
        return cub::DeviceRadixSort::SortPairsDescending(scratch, *bytes, keys_in, keys_out,
                                                         values_in, values_out, (int)n, 0,
                                                         (int)sizeof(K) * 8, stream);
    return cub::DeviceRadixSort::SortPairs(scratch, *bytes, keys_in, keys_out, values_in,
                                           values_out, (int)n, 0, (int)sizeof(K) * 8, stream);
}

inline int allocate(StreamBuffer &buffer, size_t bytes, const char *what, int64_t n) {
    cudaError_t err = buffer.allocate(bytes);
    if (err == cudaSuccess) return MMD_OK;
    cudaGetLastError();  // consumed here, so no later check reports it again
    if (err == cudaErrorMemoryAllocation)
        return mmd_error(MMD_ERR_MEMORY, "out of GPU memory: %.1f MiB for the %s of %lld boxes",
                         (double)bytes / 1048576.0, what, (long long)n);
    return cuda_error(err, what);
}

/* The whole of an nms on `stream`: sort, gather (boxes of Width values in
 * compute type A), then launch_mask(sorted boxes, sorted classes, n,
 * col_blocks, mask) fills the suppression mask, then the ordered
 * reduction. `what` names the op in errors. */
template <int Width, typename T, typename LaunchMask>
int nms_pipeline(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                 const mmd_tensor *keep, const mmd_tensor *num_kept, const char *what,
                 cudaStream_t stream, LaunchMask launch_mask) {
    typedef typename Compute<T>::type A;
    typedef typename KeyOf<A>::type K;
    const int64_t n = boxes->shape[0];
    int64_t *count_out = (int64_t *)num_kept->data;
    if (n == 0) {
        cudaMemsetAsync(count_out, 0, sizeof *count_out, stream);
        return launch_status(what);
    }
    if (n > kMaxBoxes)
        return mmd_error(MMD_ERR_VALUE, "CUDA %s takes at most %lld boxes, got %lld", what,
                         (long long)kMaxBoxes, (long long)n);
    const int64_t col_blocks = (n + kBlockBoxes - 1) / kBlockBoxes;
    StreamBuffer keys_in(stream), keys_out(stream), index_in(stream), order(stream);
    StreamBuffer sorted(stream), classes(stream), mask(stream), removed(stream), scratch(stream);
    int s = allocate(keys_in, n * sizeof(K), "sort keys", n);
    if (!s) s = allocate(keys_out, n * sizeof(K), "sort keys", n);
    if (!s) s = allocate(index_in, n * sizeof(int64_t), "sort order", n);
    if (!s) s = allocate(order, n * sizeof(int64_t), "sort order", n);
    if (!s) s = allocate(sorted, Width * n * sizeof(A), "sorted boxes", n);
    if (!s) s = allocate(classes, n * sizeof(int64_t), "sorted classes", n);
    if (!s) s = allocate(mask, (size_t)n * col_blocks * sizeof(unsigned long long),
                         "suppression mask", n);
    const bool shared_words = removed_in_shared(col_blocks);
    if (!s && !shared_words)
        s = allocate(removed, col_blocks * sizeof(unsigned long long), "suppression mask", n);
    if (s) return s;

    keys_kernel<T, K><<<blocks_for(n), kThreads, 0, stream>>>(
        (const T *)scores->data, n, keys_in.as<K>(), index_in.as<int64_t>());
    size_t scratch_bytes = 0;
    cudaError_t err = sort_pairs(nullptr, &scratch_bytes, keys_in.as<K>(), keys_out.as<K>(),
                                 index_in.as<int64_t>(), order.as<int64_t>(), n, true, stream);
    if (err != cudaSuccess) return cuda_error(err, what);
    s = allocate(scratch, scratch_bytes, "sort scratch", n);
    if (s) return s;
    err = sort_pairs(scratch.as<void>(), &scratch_bytes, keys_in.as<K>(), keys_out.as<K>(),
                     index_in.as<int64_t>(), order.as<int64_t>(), n, true, stream);
    if (err != cudaSuccess) return cuda_error(err, what);
    gather_kernel<Width, T, A><<<blocks_for(n), kThreads, 0, stream>>>(
        (const T *)boxes->data, idxs ? (const int64_t *)idxs->data : nullptr,
        order.as<int64_t>(), n, sorted.as<A>(), classes.as<int64_t>());
    launch_mask(sorted.as<A>(), classes.as<int64_t>(), n, col_blocks,
                mask.as<unsigned long long>());
    if (!shared_words) {
        err = cudaMemsetAsync(removed.as<void>(), 0, col_blocks * sizeof(unsigned long long),
                              stream);
        if (err != cudaSuccess) return cuda_error(err, what);
    }
    reduce_kernel<<<1, kReduceThreads,
                    shared_words ? col_blocks * sizeof(unsigned long long) : 0, stream>>>(
        mask.as<unsigned long long>(), order.as<int64_t>(), n, col_blocks,
        removed.as<unsigned long long>(), (int64_t *)keep->data, count_out);
    return launch_status(what);
}

/* An nms on ctx's device for any storage type: nms_pipeline with the
 * op's mask kernel, launched by Mask::launch<A>(grid, stream, sorted
 * boxes, sorted classes, n, col_blocks, threshold in A (rounded down),
 * extra, mask) for the compute type A. */
template <int Width, typename Mask, typename Extra>
int nms_on_device(const mmd_context *ctx, const mmd_tensor *boxes, const mmd_tensor *scores,
                  const mmd_tensor *idxs, const mmd_tensor *keep, const mmd_tensor *num_kept,
                  double iou_threshold, Extra extra, const char *what) {
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(boxes->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            return nms_pipeline<Width, T>(
                boxes, scores, idxs, keep, num_kept, what, stream,
                [&](const A *sorted, const int64_t *classes, int64_t n, int64_t col_blocks,
                    unsigned long long *mask) {
                    Mask::template launch<A>(dim3((unsigned)col_blocks, (unsigned)col_blocks),
                                             stream, sorted, classes, n, col_blocks,
                                             mmd_threshold_below<A>(iou_threshold), extra,
                                             mask);
                });
        });
    });
}

}  // namespace mmd_cuda

#endif
