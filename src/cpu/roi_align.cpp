/* roi_align on CPU: the registered entry points. The `default` backend
 * computes each roi's interpolation weights once per axis and runs on the
 * worker pool (roi_align_forward.cpp, roi_align_backward.cpp); the
 * `reference` backend is the same code restricted to the sample-by-sample
 * path on one thread. Backward is race-free and deterministic in both. */
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "roi_align_weights.h"

namespace {

using mmd_roi_align_cpu::Call;

/* The call's shapes and scalars; `map` is input (forward) or grad_input
 * (backward). */
template <typename T>
Call<T> make_call(const mmd_tensor *map, const mmd_tensor *rois, int64_t pooled_h,
                  int64_t pooled_w, double spatial_scale, int64_t sampling_ratio,
                  int64_t pool_mode, int aligned, bool reference) {
    return Call<T>{(const T *)rois->data, rois->shape[0], map->shape[0], map->shape[1],
                   map->shape[2],         map->shape[3], pooled_h,      pooled_w,
                   (T)spatial_scale,      sampling_ratio, pool_mode,    aligned,
                   reference};
}

template <typename T>
int forward(bool reference, const mmd_tensor *input, const mmd_tensor *rois,
            const mmd_tensor *output, const mmd_tensor *argmax_y, const mmd_tensor *argmax_x,
            int64_t pooled_h, int64_t pooled_w, double spatial_scale, int64_t sampling_ratio,
            int64_t pool_mode, int aligned) {
    const Call<T> call = make_call<T>(input, rois, pooled_h, pooled_w, spatial_scale,
                                      sampling_ratio, pool_mode, aligned, reference);
    const bool max = pool_mode == MMD_POOL_MAX;
    return mmd_roi_align_cpu::forward(call, (const T *)input->data, (T *)output->data,
                                      max ? (T *)argmax_y->data : nullptr,
                                      max ? (T *)argmax_x->data : nullptr);
}

template <typename T>
int backward(bool reference, const mmd_tensor *grad_output, const mmd_tensor *rois,
             const mmd_tensor *argmax_y, const mmd_tensor *argmax_x,
             const mmd_tensor *grad_input, int64_t pooled_h, int64_t pooled_w,
             double spatial_scale, int64_t sampling_ratio, int64_t pool_mode, int aligned) {
    const Call<T> call = make_call<T>(grad_input, rois, pooled_h, pooled_w, spatial_scale,
                                      sampling_ratio, pool_mode, aligned, reference);
    const bool max = pool_mode == MMD_POOL_MAX;
    return mmd_roi_align_cpu::backward(call, (const T *)grad_output->data,
                                       max ? (const T *)argmax_y->data : nullptr,
                                       max ? (const T *)argmax_x->data : nullptr,
                                       (T *)grad_input->data);
}

/* The registered entry points, one per backend, with the generated
 * mmd_roi_align_forward_impl_fn / _backward_impl_fn signatures. */
template <bool REFERENCE>
int forward_entry(const mmd_tensor *input, const mmd_tensor *rois,
                          const mmd_tensor *output, const mmd_tensor *argmax_y,
                          const mmd_tensor *argmax_x, int64_t aligned_height,
                          int64_t aligned_width, double spatial_scale, int64_t sampling_ratio,
                          int64_t pool_mode, int aligned, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_roi_align_forward_check(input, rois, output, argmax_y, argmax_x, aligned_height,
                                        aligned_width, spatial_scale, sampling_ratio, pool_mode,
                                        MMD_FLOAT32_64);
    if (s) return s;
    const auto run = input->dtype == MMD_FLOAT32 ? forward<float> : forward<double>;
    return run(REFERENCE, input, rois, output, argmax_y, argmax_x, aligned_height, aligned_width,
               spatial_scale, sampling_ratio, pool_mode, aligned);
}

template <bool REFERENCE>
int backward_entry(const mmd_tensor *grad_output, const mmd_tensor *rois,
                           const mmd_tensor *argmax_y, const mmd_tensor *argmax_x,
                           const mmd_tensor *grad_input, int64_t aligned_height,
                           int64_t aligned_width, double spatial_scale, int64_t sampling_ratio,
                           int64_t pool_mode, int aligned, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_roi_align_backward_check(grad_output, rois, argmax_y, argmax_x, grad_input,
                                         aligned_height, aligned_width, spatial_scale,
                                         sampling_ratio, pool_mode, MMD_FLOAT32_64);
    if (s) return s;
    const auto run = grad_input->dtype == MMD_FLOAT32 ? backward<float> : backward<double>;
    return run(REFERENCE, grad_output, rois, argmax_y, argmax_x, grad_input, aligned_height,
               aligned_width, spatial_scale, sampling_ratio, pool_mode, aligned);
}

const auto roi_align_forward_cpu = forward_entry<false>;
const auto roi_align_forward_cpu_reference = forward_entry<true>;
const auto roi_align_backward_cpu = backward_entry<false>;
const auto roi_align_backward_cpu_reference = backward_entry<true>;

}  // namespace

MMD_REGISTRATIONS(cpu, roi_align) {
    MMD_REGISTER_DEVICE_IMPL(roi_align_forward_impl, CPU, DEFAULT, roi_align_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(roi_align_forward_impl, CPU, REFERENCE,
                             roi_align_forward_cpu_reference);
    MMD_REGISTER_DEVICE_IMPL(roi_align_backward_impl, CPU, DEFAULT, roi_align_backward_cpu);
    MMD_REGISTER_DEVICE_IMPL(roi_align_backward_impl, CPU, REFERENCE,
                             roi_align_backward_cpu_reference);
}
