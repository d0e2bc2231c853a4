/* sigmoid_focal_loss on CPU: elementwise over (N, C), rows split over the
 * worker pool; targets are validated before anything is written. */
#include "mmdispatch/ops/sigmoid_focal_loss.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

int check_targets(const mmd_tensor *target, int64_t num_classes) {
    const int64_t *t = (const int64_t *)target->data;
    for (int64_t i = 0; i < target->shape[0]; ++i)
        if (t[i] < 0 || t[i] > num_classes)
            return mmd_sigmoid_focal_loss_target_error(i, t[i], num_classes);
    return MMD_OK;
}

/* Loss (backward = false) or its gradient (true) for every element. */
template <typename T>
void focal_loss(bool backward, const mmd_tensor *input, const mmd_tensor *target,
                const mmd_tensor *weight, const mmd_tensor *output, T gamma, T alpha) {
    const int64_t rows = input->shape[0], classes = input->shape[1];
    const T *in = (const T *)input->data, *w = weight ? (const T *)weight->data : nullptr;
    const int64_t *t = (const int64_t *)target->data;
    T *out = (T *)output->data;
    /* an element (exp, log1p, pow) costs several steps: shared out from 16384 */
    mmd_parallel_for(rows, mmd_even_chunk(rows), rows * classes > 16384,
                     [&](int64_t begin, int64_t end) {
                         for (int64_t i = begin; i < end; ++i) {
                             const T scale = (w && t[i] < classes) ? w[t[i]] : (T)1;
                             for (int64_t c = 0; c < classes; ++c) {
                                 const int64_t o = i * classes + c;
                                 const int positive = c == t[i];
                                 out[o] = scale * (backward
                                                       ? mmd_focal_loss_grad(in[o], positive,
                                                                             gamma, alpha)
                                                       : mmd_focal_loss(in[o], positive, gamma,
                                                                        alpha));
                             }
                         }
                         return (int)MMD_OK;
                     });
}

int focal_loss_run(bool backward, const mmd_tensor *input, const mmd_tensor *target,
                   const mmd_tensor *weight, const mmd_tensor *output, double gamma,
                   double alpha) {
    int s = mmd_sigmoid_focal_loss_check(input, target, weight, output,
                                         backward ? "grad_input" : "output", gamma, alpha,
                                         MMD_FLOAT32_64);
    if (!s) s = check_targets(target, input->shape[1]);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        focal_loss<float>(backward, input, target, weight, output, (float)gamma, (float)alpha);
    else
        focal_loss<double>(backward, input, target, weight, output, gamma, alpha);
    return MMD_OK;
}

int sigmoid_focal_loss_forward_cpu(const mmd_tensor *input, const mmd_tensor *target,
                                   const mmd_tensor *weight, const mmd_tensor *output,
                                   double gamma, double alpha, const mmd_context *ctx) {
    (void)ctx;
    return focal_loss_run(false, input, target, weight, output, gamma, alpha);
}

int sigmoid_focal_loss_backward_cpu(const mmd_tensor *input, const mmd_tensor *target,
                                    const mmd_tensor *weight, const mmd_tensor *grad_input,
                                    double gamma, double alpha, const mmd_context *ctx) {
    (void)ctx;
    return focal_loss_run(true, input, target, weight, grad_input, gamma, alpha);
}

}  // namespace

MMD_REGISTRATIONS(cpu, sigmoid_focal_loss) {
    MMD_REGISTER_DEVICE_IMPL(sigmoid_focal_loss_forward_impl, CPU, DEFAULT,
                             sigmoid_focal_loss_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(sigmoid_focal_loss_backward_impl, CPU, DEFAULT,
                             sigmoid_focal_loss_backward_cpu);
}
