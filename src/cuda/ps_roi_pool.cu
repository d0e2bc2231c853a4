/* ps_roi_pool on CUDA (torchvision semantics, math shared with the CPU
 * kernels through mmdispatch/ops/ps_roi_pool.h). Forward: one thread per
 * output bin. Backward (`default`): one thread per grad_output element,
 * adding into grad_input with atomics; (`deterministic`): a warp per
 * (image, input channel) plane of grad_input, which receives only one bin
 * of each roi (ps_rois.h) and adds the rois in order (a bin's cells are
 * distinct, so its lanes never collide), so the sums are the same on every
 * run. float16 and bfloat16 compute in float32. Launches on ctx->stream, on
 * ctx->device_id.
 *
 * Bad rois never cause an out-of-bounds access: by default a bad roi's bins
 * are NaN in forward and add nothing in backward, and the roi is reported
 * as a deferred error; in strict mode a check kernel validates every roi
 * first and the call raises, writing nothing. */
#include "mmdispatch/cuda/rois.cuh"
#include "mmdispatch/ops/ps_roi_pool.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

template <typename A> using Geometry = mmd_pool_geometry<A>;

/* The geometry of roi k, in compute type A. */
template <typename T, typename A>
__device__ inline int roi_geometry(const T *rois, int64_t k, int64_t batch, A scale,
                                   int64_t pooled_h, int64_t pooled_w, Geometry<A> *g) {
    A roi[5];
    for (int i = 0; i < 5; ++i) roi[i] = to_compute(rois[5 * k + i]);
    return mmd_ps_roi_pool_geometry(roi, batch, scale, pooled_h, pooled_w, g);
}

/* Roi k's MMD_ROI_* code, for check_rois (mmdispatch/cuda/rois.cuh). */
template <typename T> struct RoiCheck {
    typedef typename Compute<T>::type A;
    const T *rois;
    int64_t batch;
    A scale;
    int64_t pooled_h, pooled_w;

    __device__ int operator()(int64_t k) const {
        Geometry<A> g;
        return roi_geometry(rois, k, batch, scale, pooled_h, pooled_w, &g);
    }
};

/* The cells [h0, h1) x [w0, w1) of bin (ph, pw) of roi geometry g. */
template <typename A>
__device__ inline int64_t bin_cells(const Geometry<A> &g, int64_t ph, int64_t pw, int64_t height,
                                    int64_t width, int64_t *h0, int64_t *h1, int64_t *w0,
                                    int64_t *w1) {
    mmd_ps_roi_pool_bin(g.start_h, g.bin_h, ph, height, h0, h1);
    mmd_ps_roi_pool_bin(g.start_w, g.bin_w, pw, width, w0, w1);
    return (*h1 > *h0 && *w1 > *w0) ? (*h1 - *h0) * (*w1 - *w0) : 0;
}

template <typename T>
__global__ void forward_kernel(const T *input, const T *rois, T *output, int64_t total,
                               int64_t channels, int64_t height, int64_t width, int64_t pooled_h,
                               int64_t pooled_w, int64_t batch, typename Compute<T>::type scale,
                               ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int64_t c_out_count = channels / (pooled_h * pooled_w);
    MMD_GRID_STRIDE_LOOP(index, total) {
        const mmd_ps_bin b(index, c_out_count, pooled_h, pooled_w);
        Geometry<A> g;
        const int code = roi_geometry(rois, b.k, batch, scale, pooled_h, pooled_w, &g);
        if (code != MMD_ROI_OK) {
            if (index % (c_out_count * pooled_h * pooled_w) == 0) sink.report(b.k, code);
            output[index] = from_compute<T>((A)NAN);
            continue;
        }
        int64_t h0, h1, w0, w1;
        const int64_t area = bin_cells(g, b.ph, b.pw, height, width, &h0, &h1, &w0, &w1);
        const int64_t c_in = mmd_ps_channel(b.c_out, b.ph, b.pw, pooled_h, pooled_w);
        const T *plane = input + (g.batch * channels + c_in) * height * width;
        A sum = 0;
        for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w) sum += to_compute(plane[h * width + w]);
        output[index] = from_compute<T>(area ? sum / (A)area : (A)0);
    }
}

template <typename T>
__global__ void backward_kernel(const T *grad_output, const T *rois, T *grad_input,
                                int64_t total, int64_t channels, int64_t height, int64_t width,
                                int64_t pooled_h, int64_t pooled_w, int64_t batch,
                                typename Compute<T>::type scale, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int64_t c_out_count = channels / (pooled_h * pooled_w);
    MMD_GRID_STRIDE_LOOP(index, total) {
        const mmd_ps_bin b(index, c_out_count, pooled_h, pooled_w);
        Geometry<A> g;
        const int code = roi_geometry(rois, b.k, batch, scale, pooled_h, pooled_w, &g);
        if (code != MMD_ROI_OK) {
            if (index % (c_out_count * pooled_h * pooled_w) == 0) sink.report(b.k, code);
            continue;
        }
        int64_t h0, h1, w0, w1;
        const int64_t area = bin_cells(g, b.ph, b.pw, height, width, &h0, &h1, &w0, &w1);
        if (!area) continue;
        const int64_t c_in = mmd_ps_channel(b.c_out, b.ph, b.pw, pooled_h, pooled_w);
        T *plane = grad_input + (g.batch * channels + c_in) * height * width;
        const T grad = from_compute<T>(to_compute(grad_output[index]) / (A)area);
        for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w) atomicAdd(plane + h * width + w, grad);
    }
}

/* The deterministic backward: warp b owns plane b = (n, c_in) of
 * grad_input, which only bin (ph, pw) of output channel c_out feeds; it
 * visits the rois in order, and a roi on image n adds into its bin's cells,
 * each cell by one lane. */
template <typename T>
__global__ void deterministic_backward_kernel(const T *grad_output, const T *rois,
                                              T *grad_input, int64_t num_rois, int64_t channels,
                                              int64_t height, int64_t width, int64_t pooled_h,
                                              int64_t pooled_w, int64_t batch,
                                              typename Compute<T>::type scale, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int64_t n = blockIdx.x / channels, c_in = blockIdx.x % channels;
    const int64_t bins = pooled_h * pooled_w, c_out_count = channels / bins;
    const int64_t c_out = c_in / bins, ph = (c_in % bins) / pooled_w, pw = c_in % pooled_w;
    const int lane = threadIdx.x;
    T *plane = grad_input + (int64_t)blockIdx.x * height * width;
    for (int64_t k = 0; k < num_rois; ++k) {
        Geometry<A> g;
        const int code = roi_geometry(rois, k, batch, scale, pooled_h, pooled_w, &g);
        if (code != MMD_ROI_OK) {
            if (blockIdx.x == 0 && lane == 0) sink.report(k, code);
            continue;
        }
        if (g.batch != n) continue;
        int64_t h0, h1, w0, w1;
        const int64_t area = bin_cells(g, ph, pw, height, width, &h0, &h1, &w0, &w1);
        if (!area) continue;
        const A grad = to_compute(grad_output[(k * c_out_count + c_out) * bins + ph * pooled_w +
                                              pw]) / (A)area;
        const int64_t cols = w1 - w0;
        for (int64_t i = lane; i < area; i += 32) {
            T *cell = plane + (h0 + i / cols) * width + w0 + i % cols;
            *cell = from_compute<T>(to_compute(*cell) + grad);
        }
        __syncwarp();
    }
}

int ps_roi_pool_forward_cuda(const mmd_tensor *input, const mmd_tensor *rois,
                              const mmd_tensor *output, int64_t pooled_height,
                              int64_t pooled_width, double spatial_scale,
                              const mmd_context *ctx) {
    int s = mmd_ps_roi_forward_check(input, rois, output, pooled_height, pooled_width,
                                       spatial_scale, MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t batch = input->shape[0], total = mmd_numel(output);
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(input->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            ErrorSink sink;
            const RoiCheck<T> check{(const T *)rois->data, batch, (A)spatial_scale,
                                    pooled_height, pooled_width};
            int s = check_rois(ctx, "ps_roi_pool roi check", check, rois->shape[0], batch,
                               stream, total > 0, &sink);
            if (s || total == 0) return s;
            forward_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
                (const T *)input->data, (const T *)rois->data, (T *)output->data, total,
                input->shape[1], input->shape[2], input->shape[3], pooled_height, pooled_width,
                batch, (A)spatial_scale, sink);
            return launch_status("ps_roi_pool forward launch");
        });
    });
}

int backward_cuda(const mmd_tensor *grad_output, const mmd_tensor *rois,
                  const mmd_tensor *grad_input, int64_t pooled_height, int64_t pooled_width,
                  double spatial_scale, bool deterministic,
                  const mmd_context *ctx) {
    int s = mmd_ps_roi_backward_check(grad_output, rois, grad_input, pooled_height,
                                      pooled_width, spatial_scale, MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t batch = grad_input->shape[0], total = mmd_numel(grad_output);
    const int64_t planes = grad_input->shape[0] * grad_input->shape[1];
    const bool work = total > 0 && mmd_numel(grad_input) > 0;
    if (deterministic && planes > INT32_MAX)
        return mmd_error(MMD_ERR_VALUE, "the deterministic backend takes at most %d (image, "
                         "channel) planes, got %lld", INT32_MAX, (long long)planes);
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(grad_input->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            ErrorSink sink;
            const RoiCheck<T> check{(const T *)rois->data, batch, (A)spatial_scale,
                                    pooled_height, pooled_width};
            int s = check_rois(ctx, "ps_roi_pool roi check", check, rois->shape[0], batch,
                               stream, work, &sink);
            if (s || !work) return s;
            if (deterministic)
                deterministic_backward_kernel<T><<<(unsigned)planes, 32, 0, stream>>>(
                    (const T *)grad_output->data, (const T *)rois->data, (T *)grad_input->data,
                    rois->shape[0], grad_input->shape[1], grad_input->shape[2],
                    grad_input->shape[3], pooled_height, pooled_width, batch, (A)spatial_scale,
                    sink);
            else
                backward_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
                    (const T *)grad_output->data, (const T *)rois->data, (T *)grad_input->data,
                    total, grad_input->shape[1], grad_input->shape[2], grad_input->shape[3],
                    pooled_height, pooled_width, batch, (A)spatial_scale, sink);
            return launch_status("ps_roi_pool backward launch");
        });
    });
}

int ps_roi_pool_backward_cuda(const mmd_tensor *grad_output, const mmd_tensor *rois,
                               const mmd_tensor *grad_input, int64_t pooled_height,
                               int64_t pooled_width, double spatial_scale,
                               const mmd_context *ctx) {
    return backward_cuda(grad_output, rois, grad_input, pooled_height, pooled_width,
                         spatial_scale, false, ctx);
}

int ps_roi_pool_backward_cuda_deterministic(const mmd_tensor *grad_output,
                                             const mmd_tensor *rois,
                                             const mmd_tensor *grad_input, int64_t pooled_height,
                                            int64_t pooled_width, double spatial_scale,
                                            const mmd_context *ctx) {
    return backward_cuda(grad_output, rois, grad_input, pooled_height, pooled_width,
                         spatial_scale, true, ctx);
}

}  // namespace

MMD_REGISTRATIONS(cuda, ps_roi_pool) {
    MMD_REGISTER_DEVICE_IMPL(ps_roi_pool_forward_impl, CUDA, DEFAULT, ps_roi_pool_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(ps_roi_pool_backward_impl, CUDA, DEFAULT,
                             ps_roi_pool_backward_cuda);
    /* the forward is deterministic as it is (one thread per output element) */
    MMD_REGISTER_DEVICE_IMPL(ps_roi_pool_forward_impl, CUDA, DETERMINISTIC,
                             ps_roi_pool_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(ps_roi_pool_backward_impl, CUDA, DETERMINISTIC,
                             ps_roi_pool_backward_cuda_deterministic);
}
