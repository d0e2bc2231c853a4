/* binary_focal_loss on CUDA: one thread per element, the math shared with
 * the CPU kernels (mmdispatch/ops/binary_focal_loss.h); float16 and
 * bfloat16 compute in float32. Launches on ctx->stream, on ctx->device_id.
 * No data makes it read or write out of bounds: no deferred errors. One
 * launch a call, where torchvision's sigmoid_focal_loss takes 15
 * elementwise ops forward and about 20 backward. */
#include "mmdispatch/cuda/common.cuh"
#include "mmdispatch/ops/binary_focal_loss.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

template <typename T>
__global__ void forward_kernel(const T *input, const T *target, T *output, int64_t total,
                               typename Compute<T>::type gamma,
                               typename Compute<T>::type alpha) {
    MMD_GRID_STRIDE_LOOP(i, total) {
        output[i] = from_compute<T>(
            mmd_binary_focal_loss(to_compute(input[i]), to_compute(target[i]), gamma, alpha));
    }
}

/* grad_input and grad_target, each where it is not null; grad_output's
 * element i * grad_step (0: one gradient for every element). */
template <typename T>
__global__ void backward_kernel(const T *input, const T *target, const T *grad_output,
                                int64_t grad_step, T *grad_input, T *grad_target, int64_t total,
                                typename Compute<T>::type gamma,
                                typename Compute<T>::type alpha) {
    typedef typename Compute<T>::type A;
    MMD_GRID_STRIDE_LOOP(i, total) {
        A d_x, d_t;
        mmd_binary_focal_loss_grad(to_compute(input[i]), to_compute(target[i]), gamma, alpha,
                                   &d_x, &d_t);
        const A g = to_compute(grad_output[i * grad_step]);
        if (grad_input) grad_input[i] = from_compute<T>(g * d_x);
        if (grad_target) grad_target[i] = from_compute<T>(g * d_t);
    }
}

int binary_focal_loss_forward_cuda(const mmd_tensor *input, const mmd_tensor *target,
                                   const mmd_tensor *output, double gamma, double alpha,
                                   const mmd_context *ctx) {
    int s = mmd_binary_focal_loss_forward_check(input, target, output, gamma, alpha, MMD_FLOAT16_BF16_32_64);
    const int64_t total = mmd_numel(input);
    if (s || total == 0) return s;
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(input->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            forward_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
                (const T *)input->data, (const T *)target->data, (T *)output->data, total,
                (A)gamma, (A)alpha);
            return launch_status("binary_focal_loss launch");
        });
    });
}

int binary_focal_loss_backward_cuda(const mmd_tensor *input, const mmd_tensor *target,
                                    const mmd_tensor *grad_output, const mmd_tensor *grad_input,
                                    const mmd_tensor *grad_target, double gamma, double alpha,
                                    int with_grad_input, int with_grad_target,
                                    const mmd_context *ctx) {
    int s = mmd_binary_focal_loss_backward_check(input, target, grad_output, grad_input,
                                                 grad_target, gamma, alpha, with_grad_input,
                                                 with_grad_target, MMD_FLOAT16_BF16_32_64);
    const int64_t total = mmd_numel(input);
    if (s || total == 0 || !(with_grad_input || with_grad_target)) return s;
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(input->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            backward_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
                (const T *)input->data, (const T *)target->data, (const T *)grad_output->data,
                mmd_binary_focal_loss_broadcast(grad_output, input) ? 0 : 1,
                with_grad_input ? (T *)grad_input->data : nullptr,
                with_grad_target ? (T *)grad_target->data : nullptr, total, (A)gamma, (A)alpha);
            return launch_status("binary_focal_loss launch");
        });
    });
}

}  // namespace

MMD_REGISTRATIONS(cuda, binary_focal_loss) {
    MMD_REGISTER_DEVICE_IMPL(binary_focal_loss_forward_impl, CUDA, DEFAULT,
                             binary_focal_loss_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(binary_focal_loss_backward_impl, CUDA, DEFAULT,
                             binary_focal_loss_backward_cuda);
    /* one thread per element, no atomics: deterministic as it is */
    MMD_REGISTER_DEVICE_IMPL(binary_focal_loss_forward_impl, CUDA, DETERMINISTIC,
                             binary_focal_loss_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(binary_focal_loss_backward_impl, CUDA, DETERMINISTIC,
                             binary_focal_loss_backward_cuda);
}
