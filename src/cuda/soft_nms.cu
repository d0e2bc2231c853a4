/* soft_nms / batched_soft_nms on CUDA (the definition is in
 * mmdispatch/ops/soft_nms.h). Each step depends on the one before, so one
 * block does the whole call: its threads share the boxes, and a step is one
 * block-wide choice of the next box (highest score key, then lowest index:
 * the same box whatever the timing) and one pass that decays the remaining
 * boxes, drops those below min_score and offers each thread's best for the
 * next choice. The scores decay in the compute type (float for 16-bit
 * boxes) with the CPU kernel's arithmetic: the naive and linear methods
 * give the CPU's bits, the gaussian one may differ in the last bits (the
 * device's exp). Scratch: a score and a flag per box. Only the count of
 * kept boxes is read back, by the caller. */
#include "mmdispatch/cuda/nms.cuh"
#include "mmdispatch/ops/soft_nms.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

constexpr int kSoftThreads = 512;

/* (key, index) of the better candidate: the higher key, then the lower
 * index; index -1 is no candidate. */
template <typename K> __device__ inline void offer(K &key, int64_t &index, K k, int64_t i) {
    if (i >= 0 && (index < 0 || k > key || (k == key && i < index))) {
        key = k;
        index = i;
    }
}

template <typename T, typename A>
__global__ void soft_nms_kernel(const T *boxes, const T *scores, const int64_t *idxs, int64_t n,
                                MmdSoftNmsDecay<A> decay, double min_score, A *score,
                                unsigned char *alive, T *dets, int64_t *keep,
                                int64_t *num_kept) {
    typedef typename KeyOf<A>::type K;
    __shared__ K warp_key[kSoftThreads / 32];
    __shared__ int64_t warp_index[kSoftThreads / 32];
    __shared__ int64_t selected;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warps = (blockDim.x + 31) / 32;
    K key = 0;
    int64_t index = -1;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        const A s = to_compute(scores[j]);
        score[j] = s;
        alive[j] = 1;
        offer(key, index, mmd_score_key(s), j);
    }
    int64_t count = 0;
    for (;;) {
        for (int delta = 16; delta > 0; delta /= 2)
            offer(key, index, __shfl_down_sync(0xffffffffu, key, delta),
                  __shfl_down_sync(0xffffffffu, index, delta));
        if (lane == 0) {
            warp_key[warp] = key;
            warp_index[warp] = index;
        }
        __syncthreads();
        if (warp == 0) {
            key = lane < warps ? warp_key[lane] : 0;
            index = lane < warps ? warp_index[lane] : -1;
            for (int delta = 16; delta > 0; delta /= 2)
                offer(key, index, __shfl_down_sync(0xffffffffu, key, delta),
                      __shfl_down_sync(0xffffffffu, index, delta));
            if (lane == 0) selected = index;
        }
        __syncthreads();
        const int64_t s = selected;
        if (s < 0) break;
        A a[4];
        for (int c = 0; c < 4; ++c) a[c] = to_compute(boxes[4 * s + c]);
        const A area_a = mmd_box_area(a, decay.offset);
        const int64_t cls_a = idxs ? idxs[s] : 0;
        if (threadIdx.x == 0) {
            for (int c = 0; c < 4; ++c) dets[5 * count + c] = boxes[4 * s + c];
            dets[5 * count + 4] = from_compute<T>(score[s]);
            keep[count] = s;
            alive[s] = 0;   /* the pass below skips s; read again after a barrier */
        }
        key = 0;
        index = -1;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            if (j == s || !alive[j]) continue;
            A sj = score[j];
            if ((idxs ? idxs[j] : 0) == cls_a) {
                A b[4];
                for (int c = 0; c < 4; ++c) b[c] = to_compute(boxes[4 * j + c]);
                sj = decay.decayed(sj, a, area_a, b, mmd_box_area(b, decay.offset));
            }
            if ((double)sj < min_score) {
                alive[j] = 0;
                continue;
            }
            score[j] = sj;
            offer(key, index, mmd_score_key(sj), j);
        }
        ++count;
    }
    if (threadIdx.x == 0) *num_kept = count;
}

int soft_nms_cuda(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                  const mmd_tensor *dets, const mmd_tensor *keep, const mmd_tensor *num_kept,
                  double iou_threshold, double sigma, double min_score, int64_t method,
                  int64_t offset, const mmd_context *ctx) {
    int s = mmd_soft_nms_check(boxes, scores, idxs, dets, keep, num_kept, iou_threshold, sigma,
                               min_score, method, offset, MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(boxes->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            const int64_t n = boxes->shape[0];
            StreamBuffer score(stream), alive(stream);
            int s = allocate(score, n * sizeof(A), "decayed scores", n);
            if (!s) s = allocate(alive, n, "decayed scores", n);
            if (s) return s;
            /* a warp at least, a thread per box up to the block's size */
            const int threads = (int)(n >= kSoftThreads ? kSoftThreads : (n + 31) / 32 * 32);
            const MmdSoftNmsDecay<A> decay = {
                (int)method, mmd_threshold_at_or_above<A>(iou_threshold), (A)sigma, (A)offset};
            soft_nms_kernel<T, A><<<1, threads > 0 ? threads : 32, 0, stream>>>(
                (const T *)boxes->data, (const T *)scores->data,
                idxs ? (const int64_t *)idxs->data : nullptr, n, decay, min_score,
                score.as<A>(), alive.as<unsigned char>(), (T *)dets->data,
                (int64_t *)keep->data, (int64_t *)num_kept->data);
            return launch_status("soft_nms");
        });
    });
}

}  // namespace

MMD_REGISTRATIONS(cuda, soft_nms) {
    MMD_REGISTER_DEVICE_IMPL(soft_nms_impl, CUDA, DEFAULT, soft_nms_cuda);
    /* one block, a fixed choice at each step: deterministic as it is */
    MMD_REGISTER_DEVICE_IMPL(soft_nms_impl, CUDA, DETERMINISTIC, soft_nms_cuda);
}
