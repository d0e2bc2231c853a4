/* softmax_focal_loss on CUDA: one thread per row (its softmax, then its
 * loss or gradient), the math shared with the CPU kernels
 * (mmdispatch/ops/softmax_focal_loss.h); float16 and bfloat16 compute in
 * float32. Launches on ctx->stream, on ctx->device_id. A target >= C is
 * never used to index: by default its row is NaN and the first such row is
 * reported as a deferred error; in strict mode targets are checked before
 * anything is written and the call raises. */
#include "mmdispatch/cuda/targets.cuh"
#include "mmdispatch/ops/softmax_focal_loss.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

/* A class index below C, or negative (an ignored row). */
struct ValidTarget {
    int64_t classes;
    __device__ bool operator()(int64_t t) const { return t < classes; }
};

/* Deferred messages; args[0] is the number of classes. */
int format_error(const mmd_deferred_call *call, int64_t row, int) {
    return mmd_error(MMD_ERR_VALUE,
                     "target[%lld] is not a class index in [0, %lld) (negative: ignored)",
                     (long long)row, (long long)call->args[0]);
}

/* The loss of each row (grad_output null) into `result` (N,), or the
 * gradient of sum(loss * grad_output) into `result` (N, C). */
template <typename T>
__global__ void focal_loss_kernel(const T *input, const int64_t *target, const T *weight,
                                  const T *grad_output, T *result, int64_t rows,
                                  int64_t classes, typename Compute<T>::type gamma,
                                  typename Compute<T>::type alpha, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    MMD_GRID_STRIDE_LOOP(i, rows) {
        const T *x = input + i * classes;
        const int64_t label = target[i];
        const bool bad = label >= classes;
        if (bad) sink.report(i, kBadTarget);
        if (bad || label < 0) {   /* bad: NaN; ignored: 0 */
            const T fill = from_compute<T>(bad ? (A)NAN : (A)0);
            if (grad_output == nullptr)
                result[i] = fill;
            else
                for (int64_t c = 0; c < classes; ++c) result[i * classes + c] = fill;
            continue;
        }
        const mmd_softmax_row<A, T> row(x, classes);
        const A log_p = row.log_p(to_compute(x[label]));
        const A scale = weight ? to_compute(weight[label]) : (A)1;
        if (grad_output == nullptr) {
            result[i] = from_compute<T>(scale * mmd_softmax_focal_loss(log_p, gamma, alpha));
            continue;
        }
        const A factor = to_compute(grad_output[i]) * scale *
                         mmd_softmax_focal_loss_factor(log_p, gamma, alpha);
        for (int64_t c = 0; c < classes; ++c)
            result[i * classes + c] = from_compute<T>(
                factor * ((c == label ? (A)1 : (A)0) - exp(row.log_p(to_compute(x[c])))));
    }
}

int focal_loss_run(const mmd_tensor *input, const mmd_tensor *target, const mmd_tensor *weight,
                   const mmd_tensor *output, const mmd_tensor *grad_output,
                   const mmd_tensor *grad_input, double gamma, double alpha,
                   const mmd_context *ctx) {
    int s = mmd_softmax_focal_loss_check(input, target, weight, output, grad_output, grad_input,
                                         gamma, alpha, MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t rows = input->shape[0], classes = input->shape[1];
    const mmd_tensor *result = output ? output : grad_input;
    const bool work = mmd_numel(result) > 0;
    return on_device(ctx, [&](cudaStream_t stream) -> int {
        const int64_t *t = (const int64_t *)target->data;
        ErrorSink sink;
        const int s = check_targets(ctx, "softmax_focal_loss target check", t, rows,
                                    ValidTarget{classes}, format_error, classes,
                                    [&](int64_t row, int64_t value) {
                                        return mmd_softmax_focal_loss_target_error(row, value,
                                                                                   classes);
                                    },
                                    stream, work, &sink);
        if (s || !work) return s;
        return by_dtype(input->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            focal_loss_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(
                (const T *)input->data, t, weight ? (const T *)weight->data : nullptr,
                grad_output ? (const T *)grad_output->data : nullptr, (T *)result->data, rows,
                classes, (A)gamma, (A)alpha, sink);
            return launch_status("softmax_focal_loss launch");
        });
    });
}

int softmax_focal_loss_forward_cuda(const mmd_tensor *input, const mmd_tensor *target,
                                    const mmd_tensor *weight, const mmd_tensor *output,
                                    double gamma, double alpha, const mmd_context *ctx) {
    return focal_loss_run(input, target, weight, output, nullptr, nullptr, gamma, alpha, ctx);
}

int softmax_focal_loss_backward_cuda(const mmd_tensor *input, const mmd_tensor *target,
                                     const mmd_tensor *weight, const mmd_tensor *grad_output,
                                     const mmd_tensor *grad_input, double gamma, double alpha,
                                     const mmd_context *ctx) {
    return focal_loss_run(input, target, weight, nullptr, grad_output, grad_input, gamma, alpha,
                          ctx);
}

}  // namespace

MMD_REGISTRATIONS(cuda, softmax_focal_loss) {
    MMD_REGISTER_DEVICE_IMPL(softmax_focal_loss_forward_impl, CUDA, DEFAULT,
                             softmax_focal_loss_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(softmax_focal_loss_backward_impl, CUDA, DEFAULT,
                             softmax_focal_loss_backward_cuda);
    /* one thread per row, no atomics: deterministic as it is */
    MMD_REGISTER_DEVICE_IMPL(softmax_focal_loss_forward_impl, CUDA, DETERMINISTIC,
                             softmax_focal_loss_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(softmax_focal_loss_backward_impl, CUDA, DETERMINISTIC,
                             softmax_focal_loss_backward_cuda);
}
