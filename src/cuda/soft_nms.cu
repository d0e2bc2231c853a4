/* soft_nms / batched_soft_nms on CUDA (the definition is in
 * mmdispatch/ops/soft_nms.h). Each step depends on the one before, but
 * only within a class: a selected box decays only its class. So
 *  - batched (idxs given): the boxes are sorted by (class, index) (CUB's
 *    stable radix sort) and each class is a block's, with the definition's
 *    first step kept: the best box of all is found first, and every class
 *    but its class drops its boxes below min_score before it starts. A
 *    block runs its class step by step (a block-wide choice of the next box:
 *    highest score key, then lowest index, the same whatever the timing;
 *    then one pass that decays the class's remaining boxes, drops those
 *    below min_score and offers each thread's best for the next choice),
 *    writing the class's selections in order. The definition's output
 *    interleaves the classes by taking the class whose next box comes first;
 *    when every class's selections are in that order themselves (always so
 *    for scores >= 0, where a decay never raises a score), that is the
 *    order of all selections by (score key descending, index ascending),
 *    which two stable radix sorts give. When some class's are not (a decay
 *    raised a negative score), the one-block kernel below redoes the call.
 *  - one class (no idxs), or that fallback: one block does the whole call,
 *    the same steps over every box.
 * The scores decay in the compute type (float for 16-bit boxes) with the
 * CPU kernel's arithmetic: the naive and linear methods give the CPU's
 * bits, the gaussian one may differ in the last bits (the device's exp).
 * Scratch: about 100 bytes per box. Only the count of kept boxes is read
 * back, by the caller. */
#include "mmdispatch/cuda/nms.cuh"
#include "mmdispatch/ops/soft_nms.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

constexpr int kSoftThreads = 512;   /* the one-block kernel */
constexpr int kClassThreads = 128;  /* a class's block */
constexpr int kClassBlocks = 256;   /* blocks taking the classes in turn */

/* (key, id) of the better candidate: the higher key, then the lower id;
 * id -1 is no candidate. */
template <typename K> __device__ inline void offer(K &key, int64_t &id, K k, int64_t i) {
    if (i >= 0 && (id < 0 || k > key || (k == key && i < id))) {
        key = k;
        id = i;
    }
}

/* The block's best (key, id) of every thread's candidate (id -1: none),
 * for every thread; blockDim.x a multiple of 32, at most 1024. Two
 * barriers; `shared_*` hold 32 entries. */
template <typename K>
__device__ int64_t block_best(K key, int64_t id, K *shared_key, int64_t *shared_id,
                              int64_t *result) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    for (int delta = 16; delta > 0; delta /= 2)
        offer(key, id, __shfl_down_sync(0xffffffffu, key, delta),
              __shfl_down_sync(0xffffffffu, id, delta));
    if (lane == 0) {
        shared_key[warp] = key;
        shared_id[warp] = id;
    }
    __syncthreads();
    if (warp == 0) {
        key = lane < warps ? shared_key[lane] : 0;
        id = lane < warps ? shared_id[lane] : -1;
        for (int delta = 16; delta > 0; delta /= 2)
            offer(key, id, __shfl_down_sync(0xffffffffu, key, delta),
                  __shfl_down_sync(0xffffffffu, id, delta));
        if (lane == 0) *result = id;
    }
    __syncthreads();
    return *result;
}

/* A remaining box k (its box `box`) after the selected box a (area area_a)
 * is chosen: decayed when it is of a's class, dropped below min_score, else
 * offered for the next choice. */
template <typename T, typename A, typename K>
__device__ inline void decay_remaining(int64_t k, const T *box, bool same_class, const A *a,
                                       A area_a, const MmdSoftNmsDecay<A> &decay,
                                       double min_score, A *score, unsigned char *alive, K &key,
                                       int64_t &best) {
    A sk = score[k];
    if (same_class) {
        A b[4];
        for (int c = 0; c < 4; ++c) b[c] = to_compute(box[c]);
        sk = decay.decayed(sk, a, area_a, b, mmd_box_area(b, decay.offset));
    }
    if ((double)sk < min_score) {
        alive[k] = 0;
        return;
    }
    score[k] = sk;
    offer(key, best, mmd_score_key(sk), k);
}

/* The whole call in one block (no idxs, or batched calls whose classes'
 * selections are out of order: run only when *redo is set, if redo is
 * given). */
template <typename T, typename A>
__global__ void soft_nms_kernel(const T *boxes, const T *scores, const int64_t *idxs, int64_t n,
                                MmdSoftNmsDecay<A> decay, double min_score, A *score,
                                unsigned char *alive, T *dets, int64_t *keep, int64_t *num_kept,
                                const int *redo) {
    typedef typename KeyOf<A>::type K;
    __shared__ K warp_key[32];
    __shared__ int64_t warp_id[32];
    __shared__ int64_t selected;
    if (redo && !*redo) return;
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
        const int64_t s = block_best(key, index, warp_key, warp_id, &selected);
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
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
            if (j != s && alive[j])
                decay_remaining(j, boxes + 4 * j, (idxs ? idxs[j] : 0) == cls_a, a, area_a,
                                decay, min_score, score, alive, key, index);
        ++count;
    }
    if (threadIdx.x == 0) *num_kept = count;
}

/* Sort keys of the classes (signed order as unsigned) and the identity. */
static __global__ void class_keys_kernel(const int64_t *idxs, int64_t n, uint64_t *keys,
                                         int64_t *ids) {
    MMD_GRID_STRIDE_LOOP(i, n) {
        keys[i] = (uint64_t)idxs[i] ^ (1ull << 63);
        ids[i] = i;
    }
}

/* *first = the best box of all (one block). */
template <typename T, typename A>
__global__ void first_kernel(const T *scores, int64_t n, int64_t *first) {
    typedef typename KeyOf<A>::type K;
    __shared__ K warp_key[32];
    __shared__ int64_t warp_id[32];
    __shared__ int64_t best;
    K key = 0;
    int64_t index = -1;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
        offer(key, index, mmd_score_key(to_compute(scores[j])), j);
    const int64_t found = block_best(key, index, warp_key, warp_id, &best);
    if (threadIdx.x == 0) *first = found;
}

/* The first position of each class in the sorted order, listed in any
 * order (each class's block finds where the class ends). */
static __global__ void starts_kernel(const uint64_t *classes, int64_t n, int64_t *starts,
                                     unsigned long long *num_classes) {
    MMD_GRID_STRIDE_LOOP(k, n) {
        if (k == 0 || classes[k] != classes[k - 1])
            starts[atomicAdd(num_classes, 1ull)] = k;
    }
}

/* Each class's soft-NMS by a block, over sorted positions: writes the
 * class's selections from its first position on (input index in `chosen`,
 * score in `chosen_score`, `valid` set), adds their count to *num_kept,
 * and sets *redo when they are out of the output order. */
template <typename T, typename A>
__global__ void class_kernel(const T *boxes, const T *scores, const int64_t *idxs,
                             const uint64_t *classes, const int64_t *order, int64_t n,
                             const int64_t *starts, const unsigned long long *num_classes,
                             const int64_t *first, MmdSoftNmsDecay<A> decay, double min_score,
                             A *score, unsigned char *alive, int64_t *chosen, A *chosen_score,
                             unsigned char *valid, int64_t *num_kept, int *redo) {
    typedef typename KeyOf<A>::type K;
    __shared__ K warp_key[32];
    __shared__ int64_t warp_id[32];
    __shared__ int64_t selected;
    __shared__ unsigned long long end_shared;
    const uint64_t first_class = (uint64_t)idxs[*first] ^ (1ull << 63);
    const int64_t count_classes = (int64_t)*num_classes;
    for (int64_t c = blockIdx.x; c < count_classes; c += gridDim.x) {
        const int64_t start = starts[c];
        const uint64_t cls = classes[start];
        /* where the class ends: the first position of another class */
        if (threadIdx.x == 0) end_shared = (unsigned long long)n;
        __syncthreads();
        for (int64_t base = start; base < n; base += blockDim.x) {
            const int64_t k = base + threadIdx.x;
            const int other = k < n && classes[k] != cls;
            if (other) atomicMin(&end_shared, (unsigned long long)k);
            if (__syncthreads_or(other)) break;
        }
        const int64_t end = (int64_t)end_shared;
        /* the definition's first step: the class of the first box keeps
         * every box until its decay; the others meet min_score now */
        K key = 0;
        int64_t best = -1;
        for (int64_t k = start + threadIdx.x; k < end; k += blockDim.x) {
            const A s = to_compute(scores[order[k]]);
            score[k] = s;
            valid[k] = 0;
            alive[k] = cls == first_class || !((double)s < min_score);
            if (alive[k]) offer(key, best, mmd_score_key(s), k);   /* positions: index order */
        }
        int64_t count = 0;
        for (;;) {
            const int64_t s = block_best(key, best, warp_key, warp_id, &selected);
            if (s < 0) break;
            const int64_t box = order[s];
            A a[4];
            for (int q = 0; q < 4; ++q) a[q] = to_compute(boxes[4 * box + q]);
            const A area_a = mmd_box_area(a, decay.offset);
            if (threadIdx.x == 0) {
                chosen[start + count] = box;
                chosen_score[start + count] = score[s];
                valid[start + count] = 1;
                alive[s] = 0;   /* the pass below skips s; read again after a barrier */
            }
            key = 0;
            best = -1;
            for (int64_t k = start + threadIdx.x; k < end; k += blockDim.x)
                if (k != s && alive[k])
                    decay_remaining(k, boxes + 4 * order[k], true, a, area_a, decay, min_score,
                                    score, alive, key, best);
            ++count;
        }
        /* selections out of (key descending, index ascending) order */
        for (int64_t i = start + 1 + threadIdx.x; i < start + count; i += blockDim.x) {
            const K before = mmd_score_key(chosen_score[i - 1]), now = mmd_score_key(chosen_score[i]);
            if (before < now || (before == now && chosen[i - 1] > chosen[i])) *redo = 1;
        }
        if (threadIdx.x == 0) atomicAdd((unsigned long long *)num_kept, (unsigned long long)count);
        __syncthreads();   /* the shared words are the next class's */
    }
}

/* Sort keys of the selections: by input index (others last), then (the
 * second sort, stable) by score key. */
static __global__ void index_keys_kernel(const int64_t *chosen, const unsigned char *valid,
                                         int64_t n, uint64_t *keys, int64_t *positions) {
    MMD_GRID_STRIDE_LOOP(k, n) {
        keys[k] = valid[k] ? (uint64_t)chosen[k] : ~0ull;
        positions[k] = k;
    }
}

template <typename A, typename K>
__global__ void score_keys_kernel(const A *chosen_score, const unsigned char *valid,
                                  const int64_t *positions, int64_t n, K *keys) {
    MMD_GRID_STRIDE_LOOP(i, n) {
        const int64_t k = positions[i];
        keys[i] = valid[k] ? mmd_score_key(chosen_score[k]) : (K)0;
    }
}

/* dets and keep from the selections in output order (the first *num_kept
 * of `positions`); skipped when the one-block kernel redoes the call. */
template <typename T, typename A>
__global__ void write_kernel(const T *boxes, const int64_t *chosen, const A *chosen_score,
                             const int64_t *positions, const int64_t *num_kept, const int *redo,
                             T *dets, int64_t *keep) {
    if (*redo) return;
    MMD_GRID_STRIDE_LOOP(i, *num_kept) {
        const int64_t k = positions[i], box = chosen[k];
        for (int c = 0; c < 4; ++c) dets[5 * i + c] = boxes[4 * box + c];
        dets[5 * i + 4] = from_compute<T>(chosen_score[k]);
        keep[i] = box;
    }
}

/* The batched pipeline (see the top of the file) on `stream`. */
template <typename T, typename A>
int batched(const T *boxes, const T *scores, const int64_t *idxs, int64_t n,
            const MmdSoftNmsDecay<A> &decay, double min_score, T *dets, int64_t *keep,
            int64_t *num_kept, cudaStream_t stream) {
    typedef typename KeyOf<A>::type K;
    StreamBuffer keys(stream), keys_out(stream), ids(stream), order(stream), starts(stream);
    StreamBuffer words(stream), score(stream), alive(stream), chosen(stream);
    StreamBuffer chosen_score(stream), valid(stream), positions(stream), positions_out(stream);
    StreamBuffer score_keys(stream), score_keys_out(stream), scratch(stream);
    int s = allocate(keys, n * sizeof(uint64_t), "sort keys", n);
    if (!s) s = allocate(keys_out, n * sizeof(uint64_t), "sort keys", n);
    if (!s) s = allocate(ids, n * sizeof(int64_t), "sort order", n);
    if (!s) s = allocate(order, n * sizeof(int64_t), "sort order", n);
    if (!s) s = allocate(starts, n * sizeof(int64_t), "classes", n);
    if (!s) s = allocate(words, 4 * sizeof(int64_t), "classes", n);
    if (!s) s = allocate(score, n * sizeof(A), "decayed scores", n);
    if (!s) s = allocate(alive, n, "decayed scores", n);
    if (!s) s = allocate(chosen, n * sizeof(int64_t), "selections", n);
    if (!s) s = allocate(chosen_score, n * sizeof(A), "selections", n);
    if (!s) s = allocate(valid, n, "selections", n);
    if (!s) s = allocate(positions, n * sizeof(int64_t), "selections", n);
    if (!s) s = allocate(positions_out, n * sizeof(int64_t), "selections", n);
    if (!s) s = allocate(score_keys, n * sizeof(K), "selections", n);
    if (!s) s = allocate(score_keys_out, n * sizeof(K), "selections", n);
    if (s) return s;
    size_t bytes_index = 0, bytes_score = 0;
    cudaError_t err = sort_pairs<uint64_t>(nullptr, &bytes_index, nullptr, nullptr, nullptr,
                                           nullptr, n, false, stream);
    if (err == cudaSuccess)
        err = sort_pairs<K>(nullptr, &bytes_score, nullptr, nullptr, nullptr, nullptr, n, true,
                            stream);
    if (err != cudaSuccess) return cuda_error(err, "soft_nms");
    size_t scratch_bytes = bytes_index > bytes_score ? bytes_index : bytes_score;
    s = allocate(scratch, scratch_bytes, "sort scratch", n);
    if (s) return s;
    /* words: the class count, the first box, the redo flag */
    unsigned long long *num_classes = words.as<unsigned long long>();
    int64_t *first = words.as<int64_t>() + 1;
    int *redo = (int *)(words.as<int64_t>() + 2);
    err = cudaMemsetAsync(words.as<void>(), 0, 4 * sizeof(int64_t), stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(num_kept, 0, sizeof *num_kept, stream);
    if (err != cudaSuccess) return cuda_error(err, "soft_nms");

    class_keys_kernel<<<blocks_for(n), kThreads, 0, stream>>>(idxs, n, keys.as<uint64_t>(),
                                                              ids.as<int64_t>());
    size_t bytes = scratch_bytes;
    err = sort_pairs(scratch.as<void>(), &bytes, keys.as<uint64_t>(), keys_out.as<uint64_t>(),
                     ids.as<int64_t>(), order.as<int64_t>(), n, false, stream);
    if (err != cudaSuccess) return cuda_error(err, "soft_nms");
    first_kernel<T, A><<<1, kSoftThreads, 0, stream>>>(scores, n, first);
    starts_kernel<<<blocks_for(n), kThreads, 0, stream>>>(keys_out.as<uint64_t>(), n,
                                                          starts.as<int64_t>(), num_classes);
    const unsigned grid = (unsigned)(n < kClassBlocks ? n : kClassBlocks);
    class_kernel<T, A><<<grid, kClassThreads, 0, stream>>>(
        boxes, scores, idxs, keys_out.as<uint64_t>(), order.as<int64_t>(), n,
        starts.as<int64_t>(), num_classes, first, decay, min_score, score.as<A>(),
        alive.as<unsigned char>(), chosen.as<int64_t>(), chosen_score.as<A>(),
        valid.as<unsigned char>(), num_kept, redo);
    /* the output order: by input index, then (stable) by score key */
    index_keys_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        chosen.as<int64_t>(), valid.as<unsigned char>(), n, keys.as<uint64_t>(),
        positions.as<int64_t>());
    bytes = scratch_bytes;
    err = sort_pairs(scratch.as<void>(), &bytes, keys.as<uint64_t>(), keys_out.as<uint64_t>(),
                     positions.as<int64_t>(), positions_out.as<int64_t>(), n, false, stream);
    if (err != cudaSuccess) return cuda_error(err, "soft_nms");
    score_keys_kernel<A, K><<<blocks_for(n), kThreads, 0, stream>>>(
        chosen_score.as<A>(), valid.as<unsigned char>(), positions_out.as<int64_t>(), n,
        score_keys.as<K>());
    bytes = scratch_bytes;
    err = sort_pairs(scratch.as<void>(), &bytes, score_keys.as<K>(), score_keys_out.as<K>(),
                     positions_out.as<int64_t>(), positions.as<int64_t>(), n, true, stream);
    if (err != cudaSuccess) return cuda_error(err, "soft_nms");
    write_kernel<T, A><<<blocks_for(n), kThreads, 0, stream>>>(
        boxes, chosen.as<int64_t>(), chosen_score.as<A>(), positions.as<int64_t>(), num_kept,
        redo, dets, keep);
    /* out of order somewhere: the whole call in one block */
    soft_nms_kernel<T, A><<<1, kSoftThreads, 0, stream>>>(
        boxes, scores, idxs, n, decay, min_score, score.as<A>(), alive.as<unsigned char>(), dets,
        keep, num_kept, redo);
    return launch_status("soft_nms");
}

int soft_nms_cuda(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                  const mmd_tensor *dets, const mmd_tensor *keep, const mmd_tensor *num_kept,
                  double iou_threshold, double sigma, double min_score, int64_t method,
                  int64_t offset, const mmd_context *ctx) {
    int s = mmd_soft_nms_check(boxes, scores, idxs, dets, keep, num_kept, iou_threshold, sigma,
                               min_score, method, offset, MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t n = boxes->shape[0];
    if (idxs && n > INT32_MAX)
        return mmd_error(MMD_ERR_VALUE, "CUDA batched soft_nms takes at most %lld boxes, got %lld",
                         (long long)INT32_MAX, (long long)n);
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(boxes->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            int64_t *count = (int64_t *)num_kept->data;
            if (n == 0) {
                cudaMemsetAsync(count, 0, sizeof *count, stream);
                return launch_status("soft_nms");
            }
            const MmdSoftNmsDecay<A> decay = {
                (int)method, mmd_threshold_at_or_above<A>(iou_threshold), (A)sigma, (A)offset};
            const T *b = (const T *)boxes->data, *sc = (const T *)scores->data;
            if (idxs)
                return batched<T, A>(b, sc, (const int64_t *)idxs->data, n, decay, min_score,
                                     (T *)dets->data, (int64_t *)keep->data, count, stream);
            StreamBuffer score(stream), alive(stream);
            int s = allocate(score, n * sizeof(A), "decayed scores", n);
            if (!s) s = allocate(alive, n, "decayed scores", n);
            if (s) return s;
            /* a warp at least, a thread per box up to the block's size */
            const int threads = (int)(n >= kSoftThreads ? kSoftThreads : (n + 31) / 32 * 32);
            soft_nms_kernel<T, A><<<1, threads, 0, stream>>>(
                b, sc, nullptr, n, decay, min_score, score.as<A>(), alive.as<unsigned char>(),
                (T *)dets->data, (int64_t *)keep->data, count, nullptr);
            return launch_status("soft_nms");
        });
    });
}

}  // namespace

MMD_REGISTRATIONS(cuda, soft_nms) {
    MMD_REGISTER_DEVICE_IMPL(soft_nms_impl, CUDA, DEFAULT, soft_nms_cuda);
    /* fixed choices at each step and stable sorts: deterministic as it is */
    MMD_REGISTER_DEVICE_IMPL(soft_nms_impl, CUDA, DETERMINISTIC, soft_nms_cuda);
}
