/* roi_align_rotated on CUDA, the geometry shared with the CPU kernels
 * (mmdispatch/ops/roi_align_rotated.h); float16 and bfloat16 compute in
 * float32. Launches on ctx->stream, on ctx->device_id.
 *
 * - Forward: one thread per output element.
 * - Backward (default): one thread per grad_output element, adding with
 *   atomics; deterministic backend: one warp per (image, channel) plane,
 *   which alone writes it, taking its rois' samples 32 at a time in order
 *   (warp_ordered_add).
 * - Rois are checked as the other roi ops' are (mmdispatch/cuda/rois.cuh):
 *   by default each kernel thread skips a bad roi (its bins NaN) and
 *   reports it as a deferred error; in strict mode a check kernel and one
 *   sync come first, and the call raises having written nothing. */
#include "mmdispatch/cuda/rois.cuh"
#include "mmdispatch/ops/roi_align_rotated.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

template <typename A> struct Params {
    int64_t pooled_h, pooled_w, sampling_ratio, batch;
    A scale;
    int aligned, clockwise;
};

/* Roi k's geometry from storage type T, in compute type A. */
template <typename T, typename A>
__device__ inline int roi_at(const T *rois, int64_t k, const Params<A> &p,
                             mmd_rotated_roi<A> *g) {
    A roi[6];
    for (int i = 0; i < 6; ++i) roi[i] = to_compute(rois[6 * k + i]);
    return mmd_roi_align_rotated_geometry(roi, p.batch, p.scale, p.pooled_h, p.pooled_w,
                                          p.sampling_ratio, p.aligned, p.clockwise, g);
}

template <typename T> struct RoiCheck {
    typedef typename Compute<T>::type A;
    const T *rois;
    Params<A> p;

    __device__ int operator()(int64_t k) const {
        mmd_rotated_roi<A> g;
        return roi_at(rois, k, p, &g);
    }
};

/* Output element `index`'s roi, channel and bin, and the roi's geometry;
 * false for a bad roi (reported once, by its first element). */
template <typename T, typename A>
__device__ inline bool element_of(int64_t index, const T *rois, int64_t channels,
                                  const Params<A> &p, ErrorSink sink, int64_t *k, int64_t *c,
                                  int64_t *ph, int64_t *pw, mmd_rotated_roi<A> *g) {
    *pw = index % p.pooled_w;
    *ph = index / p.pooled_w % p.pooled_h;
    *c = index / (p.pooled_w * p.pooled_h) % channels;
    *k = index / (p.pooled_w * p.pooled_h * channels);
    const int code = roi_at(rois, *k, p, g);
    if (code == MMD_ROI_OK) return true;
    if (*c == 0 && *ph == 0 && *pw == 0) sink.report(*k, code);
    return false;
}

template <typename T>
__global__ void forward_kernel(const T *input, const T *rois, T *output, int64_t total,
                               int64_t channels, int64_t height, int64_t width,
                               Params<typename Compute<T>::type> p, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    MMD_GRID_STRIDE_LOOP(index, total) {
        int64_t k, c, ph, pw;
        mmd_rotated_roi<A> g;
        if (!element_of(index, rois, channels, p, sink, &k, &c, &ph, &pw, &g)) {
            output[index] = from_compute<T>((A)NAN);
            continue;
        }
        const T *plane = input + (g.batch * channels + c) * height * width;
        A sum = 0;
        for (int64_t iy = 0; iy < g.grid_h; ++iy)
            for (int64_t ix = 0; ix < g.grid_w; ++ix) {
                A y, x;
                g.sample(ph, pw, iy, ix, &y, &x);
                mmd_interp_axis<A> ay, ax;
                mmd_interp(y, height, &ay);
                mmd_interp(x, width, &ax);
                if (!(ay.valid && ax.valid)) continue;
                sum += ay.w_low * ax.w_low * to_compute(plane[ay.low * width + ax.low]) +
                       ay.w_low * ax.w_high * to_compute(plane[ay.low * width + ax.high]) +
                       ay.w_high * ax.w_low * to_compute(plane[ay.high * width + ax.low]) +
                       ay.w_high * ax.w_high * to_compute(plane[ay.high * width + ax.high]);
            }
        output[index] = from_compute<T>(sum / (A)g.count());
    }
}

template <typename T>
__global__ void backward_kernel(const T *grad_output, const T *rois, T *grad_input,
                                int64_t total, int64_t channels, int64_t height, int64_t width,
                                Params<typename Compute<T>::type> p, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    MMD_GRID_STRIDE_LOOP(index, total) {
        int64_t k, c, ph, pw;
        mmd_rotated_roi<A> g;
        if (!element_of(index, rois, channels, p, sink, &k, &c, &ph, &pw, &g)) continue;
        T *plane = grad_input + (g.batch * channels + c) * height * width;
        const A share = to_compute(grad_output[index]) / (A)g.count();
        for (int64_t iy = 0; iy < g.grid_h; ++iy)
            for (int64_t ix = 0; ix < g.grid_w; ++ix) {
                A y, x;
                g.sample(ph, pw, iy, ix, &y, &x);
                mmd_interp_axis<A> ay, ax;
                mmd_interp(y, height, &ay);
                mmd_interp(x, width, &ax);
                if (!(ay.valid && ax.valid)) continue;
                atomicAdd(plane + ay.low * width + ax.low,
                          from_compute<T>(share * ay.w_low * ax.w_low));
                atomicAdd(plane + ay.low * width + ax.high,
                          from_compute<T>(share * ay.w_low * ax.w_high));
                atomicAdd(plane + ay.high * width + ax.low,
                          from_compute<T>(share * ay.w_high * ax.w_low));
                atomicAdd(plane + ay.high * width + ax.high,
                          from_compute<T>(share * ay.w_high * ax.w_high));
            }
    }
}

/* One warp (the block) per (image, channel) plane: each roi of that image,
 * its bins and samples 32 at a time, lane order within a step. */
template <typename T>
__global__ void deterministic_backward_kernel(const T *grad_output, const T *rois,
                                              T *grad_input, int64_t num_rois, int64_t channels,
                                              int64_t height, int64_t width,
                                              Params<typename Compute<T>::type> p,
                                              ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int64_t n = blockIdx.x / channels, c = blockIdx.x % channels;
    T *plane = grad_input + (int64_t)blockIdx.x * height * width;
    const int64_t bins = p.pooled_h * p.pooled_w;
    for (int64_t k = 0; k < num_rois; ++k) {
        mmd_rotated_roi<A> g;
        const int code = roi_at(rois, k, p, &g);
        if (code != MMD_ROI_OK) {
            if (blockIdx.x == 0 && threadIdx.x == 0) sink.report(k, code);
            continue;
        }
        if (g.batch != n) continue;
        const int64_t per_bin = g.grid_h * g.grid_w, samples = bins * per_bin;
        for (int64_t s0 = 0; s0 < samples; s0 += 32) {
            const int64_t s = s0 + threadIdx.x;
            mmd_interp_axis<A> ay, ax;
            ay.valid = ax.valid = 0;
            A share = 0;
            if (s < samples) {
                const int64_t bin = s / per_bin, i = s % per_bin;
                const int64_t ph = bin / p.pooled_w, pw = bin % p.pooled_w;
                A y, x;
                g.sample(ph, pw, i / g.grid_w, i % g.grid_w, &y, &x);
                mmd_interp(y, height, &ay);
                mmd_interp(x, width, &ax);
                share = to_compute(grad_output[(k * channels + c) * bins + bin]) / (A)g.count();
            }
            const bool on = ay.valid && ax.valid;
            warp_ordered_add(plane, on ? ay.low * width + ax.low : (int64_t)-1,
                             on ? share * ay.w_low * ax.w_low : (A)0);
            warp_ordered_add(plane, on ? ay.low * width + ax.high : (int64_t)-1,
                             on ? share * ay.w_low * ax.w_high : (A)0);
            warp_ordered_add(plane, on ? ay.high * width + ax.low : (int64_t)-1,
                             on ? share * ay.w_high * ax.w_low : (A)0);
            warp_ordered_add(plane, on ? ay.high * width + ax.high : (int64_t)-1,
                             on ? share * ay.w_high * ax.w_high : (A)0);
        }
    }
}

/* On ctx's device, for the storage type T of `dtype`: checks the rois
 * (rois.cuh), then, when there is work, launch(T(), params, sink, stream). */
template <typename Launch>
int run(const mmd_context *ctx, int dtype, const mmd_tensor *rois, int64_t batch,
        int64_t pooled_height, int64_t pooled_width, double spatial_scale,
        int64_t sampling_ratio, int aligned, int clockwise, bool work, Launch launch) {
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            const Params<A> p{pooled_height, pooled_width, sampling_ratio, batch,
                              (A)spatial_scale, aligned, clockwise};
            ErrorSink sink;
            int s = check_rois(ctx, "roi_align_rotated roi check",
                               RoiCheck<T>{(const T *)rois->data, p}, rois->shape[0], batch,
                               stream, work, &sink);
            return s || !work ? s : launch(tag, p, sink, stream);
        });
    });
}

int roi_align_rotated_forward_cuda(const mmd_tensor *input, const mmd_tensor *rois,
                                   const mmd_tensor *output, int64_t pooled_height,
                                   int64_t pooled_width, double spatial_scale,
                                   int64_t sampling_ratio, int aligned, int clockwise,
                                   const mmd_context *ctx) {
    int s = mmd_roi_align_rotated_check(input, "input", rois, output, "output", pooled_height,
                                        pooled_width, spatial_scale, MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t total = mmd_numel(output);
    return run(ctx, input->dtype, rois, input->shape[0], pooled_height, pooled_width,
               spatial_scale, sampling_ratio, aligned, clockwise, total > 0,
               [&](auto tag, const auto &p, ErrorSink sink, cudaStream_t stream) {
                   typedef decltype(tag) T;
                   forward_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
                       (const T *)input->data, (const T *)rois->data, (T *)output->data, total,
                       input->shape[1], input->shape[2], input->shape[3], p, sink);
                   return launch_status("roi_align_rotated forward launch");
               });
}

template <bool Deterministic>
int roi_align_rotated_backward_cuda(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                    const mmd_tensor *grad_input, int64_t pooled_height,
                                    int64_t pooled_width, double spatial_scale,
                                    int64_t sampling_ratio, int aligned, int clockwise,
                                    const mmd_context *ctx) {
    int s = mmd_check_dtype(grad_output, "grad_output", MMD_FLOAT16_BF16_32_64);
    /* rois against grad_output first: the op's wrappers allocate grad_input */
    if (!s) s = mmd_check_same_dtype(rois, "rois", grad_output, "grad_output");
    if (!s) s = mmd_roi_align_rotated_check(grad_input, "grad_input", rois, grad_output,
                                            "grad_output", pooled_height, pooled_width,
                                            spatial_scale, MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t total = mmd_numel(grad_output);
    const int64_t planes = grad_input->shape[0] * grad_input->shape[1];
    if (Deterministic && planes > INT32_MAX)   /* before anything is written */
        return mmd_error(MMD_ERR_VALUE, "the deterministic backend takes at most %d (image, "
                         "channel) planes, got %lld", INT32_MAX, (long long)planes);
    return run(ctx, grad_input->dtype, rois, grad_input->shape[0], pooled_height, pooled_width,
               spatial_scale, sampling_ratio, aligned, clockwise,
               total > 0 && mmd_numel(grad_input) > 0,
               [&](auto tag, const auto &p, ErrorSink sink, cudaStream_t stream) {
                   typedef decltype(tag) T;
                   const int64_t channels = grad_input->shape[1];
                   const int64_t height = grad_input->shape[2], width = grad_input->shape[3];
                   if (Deterministic)
                       deterministic_backward_kernel<T><<<(unsigned)planes, 32, 0, stream>>>(
                           (const T *)grad_output->data, (const T *)rois->data,
                           (T *)grad_input->data, rois->shape[0], channels, height, width, p,
                           sink);
                   else
                       backward_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
                           (const T *)grad_output->data, (const T *)rois->data,
                           (T *)grad_input->data, total, channels, height, width, p, sink);
                   return launch_status("roi_align_rotated backward launch");
               });
}

}  // namespace

MMD_REGISTRATIONS(cuda, roi_align_rotated) {
    MMD_REGISTER_DEVICE_IMPL(roi_align_rotated_forward_impl, CUDA, DEFAULT,
                             roi_align_rotated_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(roi_align_rotated_backward_impl, CUDA, DEFAULT,
                             roi_align_rotated_backward_cuda<false>);
    /* forward: one thread per output element, no atomics */
    MMD_REGISTER_DEVICE_IMPL(roi_align_rotated_forward_impl, CUDA, DETERMINISTIC,
                             roi_align_rotated_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(roi_align_rotated_backward_impl, CUDA, DETERMINISTIC,
                             roi_align_rotated_backward_cuda<true>);
}
