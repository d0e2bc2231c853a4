/* sigmoid_focal_loss on CUDA: one thread per element, the math shared with
 * the CPU kernels (mmdispatch/ops/sigmoid_focal_loss.h); float16 and
 * bfloat16 compute in float32. Launches on ctx->stream, on ctx->device_id. A target outside [0, C] is never used to
 * index: by default its row is NaN and the first such row is reported as a
 * deferred error; in strict mode targets are checked before anything is
 * written and the call raises. */
#include "mmdispatch/cuda/targets.cuh"
#include "mmdispatch/ops/sigmoid_focal_loss.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

/* A target in [0, C] (C: background). */
struct ValidTarget {
    int64_t classes;
    __device__ bool operator()(int64_t t) const { return t >= 0 && t <= classes; }
};

/* Deferred messages; args[0] is the number of classes. */
int format_error(const mmd_deferred_call *call, int64_t row, int) {
    return mmd_error(MMD_ERR_VALUE,
                     "target[%lld] is not a class index in [0, %lld] (%lld = background)",
                     (long long)row, (long long)call->args[0], (long long)call->args[0]);
}

template <typename T>
__global__ void focal_loss_kernel(int backward, const T *input, const int64_t *target,
                                  const T *weight, T *output, int64_t total, int64_t classes,
                                  typename Compute<T>::type gamma,
                                  typename Compute<T>::type alpha, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    MMD_GRID_STRIDE_LOOP(index, total) {
        const int64_t row = index / classes;
        const int64_t t = target[row];
        if (t < 0 || t > classes) {
            if (index % classes == 0) sink.report(row, kBadTarget);
            output[index] = from_compute<T>((A)NAN);
            continue;
        }
        const int positive = (index % classes) == t;
        const A x = to_compute(input[index]);
        const A value = backward ? mmd_focal_loss_grad(x, positive, gamma, alpha)
                                 : mmd_focal_loss(x, positive, gamma, alpha);
        output[index] = from_compute<T>((weight && t < classes) ? value * to_compute(weight[t])
                                                                : value);
    }
}

int focal_loss_run(int backward, const mmd_tensor *input, const mmd_tensor *target,
                   const mmd_tensor *weight, const mmd_tensor *output, double gamma,
                   double alpha, const mmd_context *ctx) {
    int s = mmd_sigmoid_focal_loss_check(input, target, weight, output,
                                         backward ? "grad_input" : "output", gamma, alpha,
                                         MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t rows = input->shape[0], classes = input->shape[1];
    const int64_t total = mmd_numel(input);
    return on_device(ctx, [&](cudaStream_t stream) -> int {
        const int64_t *t = (const int64_t *)target->data;
        ErrorSink sink;
        const int s = check_targets(ctx, "sigmoid_focal_loss target check", t, rows,
                                    ValidTarget{classes}, format_error, classes,
                                    [&](int64_t row, int64_t value) {
                                        return mmd_sigmoid_focal_loss_target_error(row, value,
                                                                                   classes);
                                    },
                                    stream, total > 0, &sink);
        if (s || total == 0) return s;
        return by_dtype(input->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            focal_loss_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
                backward, (const T *)input->data, t, weight ? (const T *)weight->data : nullptr,
                (T *)output->data, total, classes, (A)gamma, (A)alpha, sink);
            return launch_status("sigmoid_focal_loss launch");
        });
    });
}

int sigmoid_focal_loss_forward_cuda(const mmd_tensor *input, const mmd_tensor *target,
                                    const mmd_tensor *weight, const mmd_tensor *output,
                                    double gamma, double alpha, const mmd_context *ctx) {
    return focal_loss_run(0, input, target, weight, output, gamma, alpha, ctx);
}

int sigmoid_focal_loss_backward_cuda(const mmd_tensor *input, const mmd_tensor *target,
                                     const mmd_tensor *weight, const mmd_tensor *grad_input,
                                     double gamma, double alpha, const mmd_context *ctx) {
    return focal_loss_run(1, input, target, weight, grad_input, gamma, alpha, ctx);
}

}  // namespace

MMD_REGISTRATIONS(cuda, sigmoid_focal_loss) {
    MMD_REGISTER_DEVICE_IMPL(sigmoid_focal_loss_forward_impl, CUDA, DEFAULT,
                             sigmoid_focal_loss_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(sigmoid_focal_loss_backward_impl, CUDA, DEFAULT,
                             sigmoid_focal_loss_backward_cuda);
    /* one thread per element, no atomics: deterministic as it is */
    MMD_REGISTER_DEVICE_IMPL(sigmoid_focal_loss_forward_impl, CUDA, DETERMINISTIC,
                             sigmoid_focal_loss_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(sigmoid_focal_loss_backward_impl, CUDA, DETERMINISTIC,
                             sigmoid_focal_loss_backward_cuda);
}
