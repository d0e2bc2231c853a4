/* roi_pool on CUDA (math shared with the CPU kernels through
 * mmdispatch/ops/roi_pool.h). Forward: a thread per output element, or,
 * where the bins read the map's cells many times over, the map's channels
 * in chunks of 32 (mmdispatch/cuda/chunks.cuh: a warp per bin, a lane per
 * channel).
 * Backward (`default`): one thread per grad_output element, adding into
 * grad_input with atomics; (`deterministic`): a warp per (image, channel)
 * plane of grad_input, adding the rois in order, so the sums are the same
 * on every run. float16 and bfloat16 compute in float32 (rois, maxima and
 * gradients are read as float; the backward adds in the storage type, as
 * torchvision's does). Launches on ctx->stream, on ctx->device_id.
 *
 * Bad rois and argmax entries never cause an out-of-bounds access. By
 * default the kernels validate what they read: a bad roi's bins are NaN
 * with argmax -1 in forward and add nothing in backward, an argmax entry
 * outside [-1, H * W) adds nothing, and the first bad item is reported as a
 * deferred error. In strict mode a check kernel validates everything first
 * and the call raises, writing nothing. */
#include <limits.h>

#include "mmdispatch/cuda/chunks.cuh"
#include "mmdispatch/ops/roi_pool.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

/* Error code of an argmax entry outside [-1, H * W); roi errors use the
 * MMD_ROI_* codes. */
enum { kBadArgmax = 0x80 };

/* The geometry of roi k, in the compute type A of storage type T. */
template <typename T, typename A = typename Compute<T>::type>
__device__ inline int roi_geometry(const T *rois, int64_t k, int64_t batch, A scale,
                                   int convention, int64_t pooled_h, int64_t pooled_w,
                                   mmd_pool_geometry<A> *g) {
    A roi[5];
    for (int i = 0; i < 5; ++i) roi[i] = to_compute(rois[5 * k + i]);
    return mmd_roi_pool_geometry(roi, batch, scale, pooled_h, pooled_w, convention, g);
}

template <typename T> using Geometry = mmd_pool_geometry<typename Compute<T>::type>;

/* Items [0, num_rois) are rois, the next `num_argmax` are argmax entries;
 * roi errors have lower item numbers, so they are reported first. */
template <typename T>
__global__ void check_kernel(const T *rois, int64_t num_rois, int64_t batch,
                             typename Compute<T>::type scale, int convention,
                             int64_t pooled_h, int64_t pooled_w, const int64_t *argmax,
                             int64_t num_argmax, int64_t plane_size, ErrorSink sink) {
    MMD_GRID_STRIDE_LOOP(item, num_rois + num_argmax) {
        if (item < num_rois) {
            Geometry<T> g;
            int code = roi_geometry(rois, item, batch, scale, convention, pooled_h, pooled_w,
                                    &g);
            if (code != MMD_ROI_OK) sink.report(item, code);
        } else {
            const int64_t a = argmax[item - num_rois];
            if (a < -1 || a >= plane_size) sink.report(item, kBadArgmax);
        }
    }
}

/* Deferred messages; the call's args are (batch size, number of rois, H * W). */
int format_error(const mmd_deferred_call *call, int64_t item, int code) {
    if (code != kBadArgmax) return mmd_roi_error(code, item, call->args[0]);
    return mmd_error(MMD_ERR_VALUE,
                     "argmax holds a value outside [-1, %lld) at flat index %lld; entries must "
                     "be -1 or in [0, %lld) (H * W of grad_input)",
                     (long long)call->args[2], (long long)(item - call->args[1]),
                     (long long)call->args[2]);
}

/* In strict mode, validates the rois (and argmax entries) on the device
 * before anything is written (one sync); then records the call and fills
 * `sink` for the kernels' own reports. With nothing to compute (`work`
 * false), the check kernel reports into the sink instead, so bad input is
 * an error whatever the output's size, as on the CPU. */
template <typename T>
int check_inputs(const mmd_context *ctx, const mmd_tensor *rois, int64_t batch,
                 typename Compute<T>::type scale, int convention,
                 int64_t pooled_h, int64_t pooled_w, const int64_t *argmax, int64_t num_argmax,
                 int64_t plane_size, cudaStream_t stream, bool work, ErrorSink *sink) {
    const int64_t num_rois = rois->shape[0];
    auto launch_check = [&](ErrorSink check) {
        check_kernel<T><<<blocks_for(num_rois + num_argmax), kThreads, 0, stream>>>(
            (const T *)rois->data, num_rois, batch, scale, convention, pooled_h, pooled_w, argmax,
            num_argmax, plane_size, check);
    };
    int s = MMD_OK;
    if (strict(ctx) && num_rois + num_argmax > 0)
        s = check_on_device(stream, "roi_pool input check", launch_check,
                            [&](int64_t item, int code) {
                                if (code != kBadArgmax) return mmd_roi_error(code, item, batch);
                                const int64_t index = item - num_rois;
                                int64_t value = 0;
                                cudaError_t err = cudaMemcpy(&value, argmax + index,
                                                             sizeof value,
                                                             cudaMemcpyDeviceToHost);
                                if (err != cudaSuccess)
                                    return cuda_error(err, "roi_pool argmax read");
                                return mmd_roi_pool_argmax_error(index, value, plane_size);
                            });
    if (!s) s = begin_deferred(ctx, format_error, batch, num_rois, plane_size, sink);
    if (!s && !work && !strict(ctx) && num_rois + num_argmax > 0) {
        launch_check(*sink);
        s = launch_status("roi_pool input check");
    }
    return s;
}

/* The maximum of a bin's cells and its index in the plane (h * width + x),
 * as the CPU kernel takes it: the first cell that is not NaN, then each
 * greater one; NaN where every cell is NaN, 0 for an empty bin (index -1).
 * A cell's index is worked out only where it is taken, and NaN is tracked
 * without a branch (ncu on the H200, 2026-11-27: forward_kernel
 * issue-bound at 1.48 ms with a 64-bit index per cell, where torchvision's
 * took 0.85 ms bound by memory). */
template <typename A> struct BinMax {
    A best = 0;
    int64_t index = -1;
    bool saw_nan = false;

    /* Scans bin (ph, pw) of roi geometry g over a map whose cell (h, x) is
     * at plane[(h * width + x) * step]: rows, then a row's cells through a
     * pointer with an int count (int64 for rows past it). */
    template <typename T, typename G>
    __device__ void scan(const T *plane, int step, const G &g, int64_t ph, int64_t pw,
                         int64_t height, int64_t width) {
        int64_t h0, h1, w0, w1;
        mmd_roi_pool_bin(g.start_h, g.bin_h, g.mmcv, ph, height, &h0, &h1);
        mmd_roi_pool_bin(g.start_w, g.bin_w, g.mmcv, pw, width, &w0, &w1);
        const auto cells_of_rows = [&](auto cells) {
            const T *row = plane + (h0 * width + w0) * step;
            for (int64_t h = h0; h < h1; ++h, row += width * step) {
                const T *cell = row;
#pragma unroll 4   /* loads in flight together */
                for (decltype(cells) j = 0; j < cells; ++j, cell += step) {
                    const A v = to_compute(*cell);
                    saw_nan |= v != v;
                    if (v > best || (index < 0 && v == v)) {
                        best = v;
                        index = h * width + w0 + j;
                    }
                }
            }
        };
        if (w1 - w0 <= INT_MAX)
            cells_of_rows((int)(w1 - w0));
        else
            cells_of_rows(w1 - w0);
    }
    __device__ A value() const { return index >= 0 ? best : (saw_nan ? (A)NAN : (A)0); }
};

/* Forward: a thread per output element (PooledElement's order). A thread
 * per bin and 8 channels, the bin's cells found once for the 8, took
 * 2.72 ms on the bench's workload where torchvision's thread per element
 * took 1.13 ms (ncu, H100, 2026-11-26): it kept an eighth as many loads in
 * flight. torchvision's order (rois outermost) moved about 2.6 GB from
 * DRAM there, 15 times the map and output. */
template <typename T, typename I>
__global__ void forward_kernel(const T *input, const T *rois, T *output, int64_t *argmax,
                               int64_t total, int64_t num_rois, int64_t channels,
                               int64_t height, int64_t width, int64_t pooled_h,
                               int64_t pooled_w, int64_t batch, typename Compute<T>::type scale,
                               int convention, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    MMD_GRID_STRIDE_LOOP(index, total) {
        const PooledElement<I> e(index, num_rois, channels, pooled_h, pooled_w);
        Geometry<T> g;
        const int code = roi_geometry(rois, e.k, batch, scale, convention, pooled_h, pooled_w,
                                      &g);
        if (code != MMD_ROI_OK) {
            if (e.first) sink.report(e.k, code);
            output[e.at] = from_compute<T>((A)NAN);
            argmax[e.at] = -1;
            continue;
        }
        BinMax<A> m;
        m.scan(input + (g.batch * channels + e.c) * height * width, 1, g, e.ph, e.pw, height,
               width);
        output[e.at] = from_compute<T>(m.value());
        argmax[e.at] = m.index;
    }
}

/* The chunked forward, where chunks_pay: per chunk of kLanes channels (its
 * map in (batch, height, width, kLanes) scratch, a group of chunks a
 * launch: chunks.cuh), a block per (chunk, roi), a warp
 * per bin, a lane per channel: each cell of a bin is one coalesced load of
 * the chunk's channels, and the bin's bounds are worked out once for them
 * (forward_kernel's warps are 32 bins of different bounds, each load a
 * sector of its own, the warp as long as its largest bin). The bins' maxima
 * and argmaxes collect in shared memory and leave as the chunk's contiguous
 * blocks of output and argmax. Each lane scans its bin as forward_kernel's
 * thread does (BinMax): the same values and argmax. */
template <typename T>
__global__ void __launch_bounds__(kThreads)
    forward_chunk_kernel(const T *chunk, const T *rois, T *output, int64_t *argmax,
                         int64_t num_rois, int64_t channels, int64_t group_c0,
                         int64_t group_count, int64_t height, int64_t width, int64_t pooled_h,
                         int64_t pooled_w, int64_t batch, typename Compute<T>::type scale,
                         int convention, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    extern __shared__ unsigned char shared_bytes[];
    const int64_t bins = pooled_h * pooled_w;
    int64_t *indices = reinterpret_cast<int64_t *>(shared_bytes);   /* [kLanes][bins] */
    A *maxima = reinterpret_cast<A *>(indices + kLanes * bins);      /* [kLanes][bins] */
    const int lane = threadIdx.x % kLanes, warp = threadIdx.x / kLanes;
    const int warps = blockDim.x / kLanes;
    for_each_roi_of_chunks(num_rois, group_c0, group_count, [&](int64_t k, const Chunk &part) {
        const int64_t c0 = part.c0, count = part.count;
        Geometry<T> g;
        const int code = roi_geometry(rois, k, batch, scale, convention, pooled_h, pooled_w,
                                      &g);
        const bool good = code == MMD_ROI_OK;
        if (!good && c0 == 0 && threadIdx.x == 0) sink.report(k, code);   /* once a call */
        if (good)
            for (int64_t b = warp; b < bins; b += warps) {
                const int64_t ph = bin_row(b, pooled_w), pw = b - ph * pooled_w;
                BinMax<A> m;
                m.scan(chunk + (part.index * batch + g.batch) * height * width * kLanes + lane,
                       kLanes, g, ph, pw, height, width);
                maxima[lane * bins + b] = m.value();
                indices[lane * bins + b] = m.index;
            }
        __syncthreads();
        const int64_t first = (k * channels + c0) * bins;   /* the chunk's, contiguous */
        for (int64_t i = threadIdx.x; i < count * bins; i += blockDim.x) {
            output[first + i] = from_compute<T>(good ? maxima[i] : (A)NAN);
            argmax[first + i] = good ? indices[i] : -1;
        }
        __syncthreads();
    });
}

/* Shared memory a bin takes in forward_chunk_kernel: a chunk's maxima (in
 * the compute type) and argmaxes. */
inline size_t chunk_bin_bytes(size_t compute_size) {
    return kLanes * (compute_size + sizeof(int64_t));
}

/* Whether a forward takes the chunked kernel (chunks_pay): a bin is
 * assumed to read 3 x 3 cells (the rois are on the device; the bench's
 * bins read about 7 x 7, an FPN level's 1 to 4 cells a side). */
inline bool chunks_pay_for(int64_t num_rois, const mmd_tensor *input, int64_t bins,
                           size_t compute_size) {
    return chunks_pay(num_rois, input->shape[1], input->shape[0], input->shape[2],
                      input->shape[3], bins, 9.0, chunk_bin_bytes(compute_size));
}

/* Default backward: a thread per grad_output element (PooledElement's
 * order), an atomic add at its argmax. Roi-major order spread the adds in
 * flight over every plane of grad_input (the bench's is 124 MB, L2 50 MB). */
template <typename T, typename I>
__global__ void backward_kernel(const T *grad_output, const T *rois, const int64_t *argmax,
                                T *grad_input, int64_t total, int64_t num_rois,
                                int64_t channels, int64_t plane_size, int64_t pooled_h,
                                int64_t pooled_w, int64_t batch,
                                typename Compute<T>::type scale, int convention,
                                ErrorSink sink) {
    MMD_GRID_STRIDE_LOOP(index, total) {
        const PooledElement<I> e(index, num_rois, channels, pooled_h, pooled_w);
        Geometry<T> g;
        const int code = roi_geometry(rois, e.k, batch, scale, convention, pooled_h, pooled_w,
                                      &g);
        if (code != MMD_ROI_OK) {
            if (e.first) sink.report(e.k, code);
            continue;
        }
        const int64_t a = argmax[e.at];
        if (a < -1 || a >= plane_size) {
            sink.report(num_rois + e.at, kBadArgmax);
            continue;
        }
        if (a < 0) continue;
        atomicAdd(grad_input + (g.batch * channels + e.c) * plane_size + a, grad_output[e.at]);
    }
}

/* The deterministic backward: warp b owns plane b = (n, c) of grad_input
 * and visits the rois in order; a roi on image n adds its bins' gradients
 * at their argmax, 32 bins at a time, bins naming the same element summed
 * in bin order by the first of them (__match_any_sync), so every element is
 * a sum in a fixed order. A warp's adds are one chain, so it reads ahead:
 * the geometry of 32 rois at once (a lane each, then a ballot of those on
 * image n), and the argmax entries and gradients of kAhead chunks of 32
 * bins before adding the first of them (each chunk's loads waited for its
 * own, then its adds, where every warp has only its plane's work: 512
 * warps on the bench's workload). The same adds in the same order. */
constexpr int kAhead = 8;

template <typename T>
__global__ void deterministic_backward_kernel(const T *grad_output, const T *rois,
                                              const int64_t *argmax, T *grad_input,
                                              int64_t num_rois, int64_t channels,
                                              int64_t plane_size, int64_t pooled_h,
                                              int64_t pooled_w, int64_t batch,
                                              typename Compute<T>::type scale, int convention,
                                              ErrorSink sink) {
    typedef typename Compute<T>::type A;
    constexpr unsigned kAll = 0xffffffffu;
    const int64_t n = blockIdx.x / channels, c = blockIdx.x % channels;
    const int lane = threadIdx.x;
    const int64_t bins = pooled_h * pooled_w, chunks = (bins + 31) / 32;
    T *plane = grad_input + (int64_t)blockIdx.x * plane_size;
    for (int64_t k0 = 0; k0 < num_rois; k0 += 32) {
        bool on_plane = false;   /* roi k0 + lane is good and on image n */
        if (k0 + lane < num_rois) {
            Geometry<T> g;
            const int code = roi_geometry(rois, k0 + lane, batch, scale, convention, pooled_h,
                                          pooled_w, &g);
            if (code != MMD_ROI_OK) {
                if (blockIdx.x == 0) sink.report(k0 + lane, code);
            } else {
                on_plane = g.batch == n;
            }
        }
        unsigned left = __ballot_sync(kAll, on_plane);   /* the rois still to add, in order */
        int64_t chunk = 0;                              /* the next chunk of the first of them */
        while (left) {
            int64_t element[kAhead];
            A grad[kAhead];
            int count = 0;
#pragma unroll
            for (int i = 0; i < kAhead; ++i) {   /* the loads of the next kAhead chunks */
                element[i] = -1;
                grad[i] = 0;
                if (!left) continue;
                const int64_t base = ((k0 + __ffs((int)left) - 1) * channels + c) * bins;
                const int64_t b = chunk * 32 + lane;
                if (b < bins) {
                    const int64_t a = argmax[base + b];
                    if (a < -1 || a >= plane_size)
                        sink.report(num_rois + base + b, kBadArgmax);
                    else
                        element[i] = a;
                    grad[i] = to_compute(grad_output[base + b]);
                }
                ++count;
                if (++chunk == chunks) {
                    chunk = 0;
                    left &= left - 1;
                }
            }
#pragma unroll
            for (int i = 0; i < kAhead; ++i)
                if (i < count) warp_ordered_add(plane, element[i], grad[i]);
        }
    }
}

int roi_pool_forward_cuda(const mmd_tensor *input, const mmd_tensor *rois,
                          const mmd_tensor *output, const mmd_tensor *argmax,
                          int64_t pooled_height, int64_t pooled_width, double spatial_scale,
                          int64_t convention, const mmd_context *ctx) {
    int s = mmd_roi_pool_forward_check(input, rois, output, argmax, pooled_height, pooled_width,
                                       spatial_scale, convention, MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t batch = input->shape[0], total = mmd_numel(output);
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(input->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            ErrorSink sink;
            int s = check_inputs<T>(ctx, rois, batch, (A)spatial_scale, (int)convention,
                                    pooled_height, pooled_width, nullptr, 0, 0, stream,
                                    total > 0, &sink);
            if (s || total == 0) return s;
            const int64_t num_rois = rois->shape[0], bins = pooled_height * pooled_width;
            Chunks plan(batch, input->shape[1], input->shape[2], input->shape[3], num_rois,
                        sizeof(T));
            StreamBuffer chunk(stream);
            if (chunks_pay_for(num_rois, input, bins, sizeof(A)) &&
                plan.allocate(&chunk)) {
                const size_t shared = (size_t)bins * chunk_bin_bytes(sizeof(A));
                return plan.each([&](int64_t c0, int64_t count) {
                    const int s = plan.transpose((const T *)input->data, chunk.as<T>(), c0,
                                                 count, "roi_pool transpose launch", stream);
                    if (s) return s;
                    forward_chunk_kernel<T><<<plan.roi_blocks, kThreads, shared, stream>>>(
                        chunk.as<T>(), (const T *)rois->data, (T *)output->data,
                        (int64_t *)argmax->data, num_rois, plan.channels, c0, count,
                        input->shape[2], input->shape[3], pooled_height, pooled_width, batch,
                        (A)spatial_scale, (int)convention, sink);
                    return launch_status("roi_pool forward launch");
                });
            }
            auto kernel = total <= INT32_MAX ? forward_kernel<T, int32_t>
                                             : forward_kernel<T, int64_t>;
            kernel<<<blocks_for(total), kThreads, 0, stream>>>(
                (const T *)input->data, (const T *)rois->data, (T *)output->data,
                (int64_t *)argmax->data, total, rois->shape[0], input->shape[1],
                input->shape[2], input->shape[3], pooled_height, pooled_width, batch,
                (A)spatial_scale, (int)convention, sink);
            return launch_status("roi_pool forward launch");
        });
    });
}

int backward_cuda(const mmd_tensor *grad_output, const mmd_tensor *rois,
                  const mmd_tensor *argmax, const mmd_tensor *grad_input, int64_t pooled_height,
                  int64_t pooled_width, double spatial_scale, int64_t convention,
                  bool deterministic, const mmd_context *ctx) {
    int s = mmd_roi_pool_backward_check(grad_output, rois, argmax, grad_input, pooled_height,
                                        pooled_width, spatial_scale, convention,
                                        MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t batch = grad_input->shape[0], total = mmd_numel(grad_output);
    const int64_t plane_size = grad_input->shape[2] * grad_input->shape[3];
    const int64_t planes = grad_input->shape[0] * grad_input->shape[1];
    const bool work = total > 0 && mmd_numel(grad_input) > 0;
    if (deterministic && planes > INT32_MAX)
        return mmd_error(MMD_ERR_VALUE, "the deterministic backend takes at most %d (image, "
                         "channel) planes, got %lld", INT32_MAX, (long long)planes);
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(grad_input->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            const int64_t *am = (const int64_t *)argmax->data;
            ErrorSink sink;
            int s = check_inputs<T>(ctx, rois, batch, (A)spatial_scale, (int)convention,
                                    pooled_height, pooled_width, am, total, plane_size, stream,
                                    work, &sink);
            if (s || !work) return s;
            auto kernel = total <= INT32_MAX ? backward_kernel<T, int32_t>
                                             : backward_kernel<T, int64_t>;
            if (deterministic)
                deterministic_backward_kernel<T><<<(unsigned)planes, 32, 0, stream>>>(
                    (const T *)grad_output->data, (const T *)rois->data, am,
                    (T *)grad_input->data, rois->shape[0], grad_input->shape[1], plane_size,
                    pooled_height, pooled_width, batch, (A)spatial_scale, (int)convention,
                    sink);
            else
                kernel<<<blocks_for(total), kThreads, 0, stream>>>(
                    (const T *)grad_output->data, (const T *)rois->data, am,
                    (T *)grad_input->data, total, rois->shape[0], grad_input->shape[1],
                    plane_size, pooled_height, pooled_width, batch, (A)spatial_scale,
                    (int)convention, sink);
            return launch_status("roi_pool backward launch");
        });
    });
}

int roi_pool_backward_cuda(const mmd_tensor *grad_output, const mmd_tensor *rois,
                           const mmd_tensor *argmax, const mmd_tensor *grad_input,
                           int64_t pooled_height, int64_t pooled_width, double spatial_scale,
                           int64_t convention, const mmd_context *ctx) {
    return backward_cuda(grad_output, rois, argmax, grad_input, pooled_height, pooled_width,
                         spatial_scale, convention, false, ctx);
}

int roi_pool_backward_cuda_deterministic(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                         const mmd_tensor *argmax, const mmd_tensor *grad_input,
                                         int64_t pooled_height, int64_t pooled_width,
                                         double spatial_scale, int64_t convention,
                                         const mmd_context *ctx) {
    return backward_cuda(grad_output, rois, argmax, grad_input, pooled_height, pooled_width,
                         spatial_scale, convention, true, ctx);
}

}  // namespace

MMD_REGISTRATIONS(cuda, roi_pool) {
    MMD_REGISTER_DEVICE_IMPL(roi_pool_forward_impl, CUDA, DEFAULT, roi_pool_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(roi_pool_backward_impl, CUDA, DEFAULT, roi_pool_backward_cuda);
    /* the forward is deterministic as it is (one thread per output element) */
    MMD_REGISTER_DEVICE_IMPL(roi_pool_forward_impl, CUDA, DETERMINISTIC, roi_pool_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(roi_pool_backward_impl, CUDA, DETERMINISTIC,
                             roi_pool_backward_cuda_deterministic);
}
