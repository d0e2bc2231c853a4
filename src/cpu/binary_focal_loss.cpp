/* binary_focal_loss on CPU: elementwise, the elements split over the worker
 * pool; the math is mmdispatch/ops/binary_focal_loss.h's. */
#include "mmdispatch/ops/binary_focal_loss.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

/* an element (exp, log1p, pow) costs several steps: shared out from 16384 */
constexpr int64_t kParallelFrom = 16384;

template <typename T>
void forward(const mmd_tensor *input, const mmd_tensor *target, const mmd_tensor *output,
             T gamma, T alpha) {
    const int64_t total = mmd_numel(input);
    const T *x = (const T *)input->data, *t = (const T *)target->data;
    T *out = (T *)output->data;
    mmd_parallel_for(total, mmd_even_chunk(total), total >= kParallelFrom,
                     [&](int64_t begin, int64_t end) {
                         for (int64_t i = begin; i < end; ++i)
                             out[i] = mmd_binary_focal_loss(x[i], t[i], gamma, alpha);
                         return (int)MMD_OK;
                     });
}

/* grad_input and grad_target, each where it is not null: the element's
 * gradients times grad_output's. */
template <typename T>
void backward(const mmd_tensor *input, const mmd_tensor *target, const mmd_tensor *grad_output,
              T *grad_input, T *grad_target, T gamma, T alpha) {
    const int64_t total = mmd_numel(input);
    const T *x = (const T *)input->data, *t = (const T *)target->data;
    const T *g = (const T *)grad_output->data;
    mmd_parallel_for(total, mmd_even_chunk(total), total >= kParallelFrom,
                     [&](int64_t begin, int64_t end) {
                         for (int64_t i = begin; i < end; ++i) {
                             T d_x, d_t;
                             mmd_binary_focal_loss_grad(x[i], t[i], gamma, alpha, &d_x, &d_t);
                             if (grad_input) grad_input[i] = g[i] * d_x;
                             if (grad_target) grad_target[i] = g[i] * d_t;
                         }
                         return (int)MMD_OK;
                     });
}

int binary_focal_loss_forward_cpu(const mmd_tensor *input, const mmd_tensor *target,
                                  const mmd_tensor *output, double gamma, double alpha,
                                  const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_binary_focal_loss_forward_check(input, target, output, gamma, alpha, MMD_FLOAT32_64);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        forward<float>(input, target, output, (float)gamma, (float)alpha);
    else
        forward<double>(input, target, output, gamma, alpha);
    return MMD_OK;
}

int binary_focal_loss_backward_cpu(const mmd_tensor *input, const mmd_tensor *target,
                                   const mmd_tensor *grad_output, const mmd_tensor *grad_input,
                                   const mmd_tensor *grad_target, double gamma, double alpha,
                                   int with_grad_input, int with_grad_target,
                                   const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_binary_focal_loss_backward_check(input, target, grad_output, grad_input,
                                                 grad_target, gamma, alpha, with_grad_input,
                                                 with_grad_target, MMD_FLOAT32_64);
    if (s || !(with_grad_input || with_grad_target)) return s;
    auto run = [&](auto zero) {
        typedef decltype(zero) T;
        backward<T>(input, target, grad_output, with_grad_input ? (T *)grad_input->data : nullptr,
                    with_grad_target ? (T *)grad_target->data : nullptr, (T)gamma, (T)alpha);
    };
    if (input->dtype == MMD_FLOAT32)
        run(0.0f);
    else
        run(0.0);
    return MMD_OK;
}

}  // namespace

MMD_REGISTRATIONS(cpu, binary_focal_loss) {
    MMD_REGISTER_DEVICE_IMPL(binary_focal_loss_forward_impl, CPU, DEFAULT,
                             binary_focal_loss_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(binary_focal_loss_backward_impl, CPU, DEFAULT,
                             binary_focal_loss_backward_cpu);
}
