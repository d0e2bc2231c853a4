/* softmax_focal_loss on CPU: a row at a time (its softmax, then its loss
 * or gradient), rows split over the worker pool; targets are validated
 * before anything is written. */
#include "mmdispatch/ops/softmax_focal_loss.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

int check_targets(const mmd_tensor *target, int64_t num_classes) {
    const int64_t *t = (const int64_t *)target->data;
    for (int64_t i = 0; i < target->shape[0]; ++i)
        if (t[i] >= num_classes) return mmd_softmax_focal_loss_target_error(i, t[i], num_classes);
    return MMD_OK;
}

/* The loss of every row (grad_output null), or the gradient of
 * sum(loss * grad_output) with respect to the logits. */
template <typename T>
void focal_loss(const mmd_tensor *input, const mmd_tensor *target, const mmd_tensor *weight,
                const mmd_tensor *grad_output, const mmd_tensor *result, T gamma, T alpha) {
    const int64_t rows = input->shape[0], classes = input->shape[1];
    const T *in = (const T *)input->data, *w = weight ? (const T *)weight->data : nullptr;
    const T *g = grad_output ? (const T *)grad_output->data : nullptr;
    const int64_t *t = (const int64_t *)target->data;
    T *out = (T *)result->data;
    /* a row element (exp, and pow per row) costs several steps: shared out from 16384 */
    mmd_parallel_for(rows, mmd_even_chunk(rows), rows * classes > 16384,
                     [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const T *x = in + i * classes;
            const int64_t label = t[i];
            if (label < 0) {   /* ignored */
                if (g == nullptr)
                    out[i] = 0;
                else
                    for (int64_t c = 0; c < classes; ++c) out[i * classes + c] = 0;
                continue;
            }
            const mmd_softmax_row<T, T> row(x, classes);
            const T log_p = row.log_p(x[label]), scale = w ? w[label] : (T)1;
            if (g == nullptr) {
                out[i] = scale * mmd_softmax_focal_loss(log_p, gamma, alpha);
                continue;
            }
            const T factor = g[i] * scale * mmd_softmax_focal_loss_factor(log_p, gamma, alpha);
            for (int64_t c = 0; c < classes; ++c)
                out[i * classes + c] = factor * ((c == label ? (T)1 : (T)0) -
                                                 exp(row.log_p(x[c])));
        }
        return (int)MMD_OK;
    });
}

int focal_loss_run(const mmd_tensor *input, const mmd_tensor *target, const mmd_tensor *weight,
                   const mmd_tensor *output, const mmd_tensor *grad_output,
                   const mmd_tensor *grad_input, double gamma, double alpha) {
    int s = mmd_softmax_focal_loss_check(input, target, weight, output, grad_output, grad_input,
                                         gamma, alpha, MMD_FLOAT32_64);
    if (!s) s = check_targets(target, input->shape[1]);
    if (s) return s;
    const mmd_tensor *result = output ? output : grad_input;
    if (input->dtype == MMD_FLOAT32)
        focal_loss<float>(input, target, weight, grad_output, result, (float)gamma,
                          (float)alpha);
    else
        focal_loss<double>(input, target, weight, grad_output, result, gamma, alpha);
    return MMD_OK;
}

int softmax_focal_loss_forward_cpu(const mmd_tensor *input, const mmd_tensor *target,
                                   const mmd_tensor *weight, const mmd_tensor *output,
                                   double gamma, double alpha, const mmd_context *ctx) {
    (void)ctx;
    return focal_loss_run(input, target, weight, output, nullptr, nullptr, gamma, alpha);
}

int softmax_focal_loss_backward_cpu(const mmd_tensor *input, const mmd_tensor *target,
                                    const mmd_tensor *weight, const mmd_tensor *grad_output,
                                    const mmd_tensor *grad_input, double gamma, double alpha,
                                    const mmd_context *ctx) {
    (void)ctx;
    return focal_loss_run(input, target, weight, nullptr, grad_output, grad_input, gamma,
                          alpha);
}

}  // namespace

MMD_REGISTRATIONS(cpu, softmax_focal_loss) {
    MMD_REGISTER_DEVICE_IMPL(softmax_focal_loss_forward_impl, CPU, DEFAULT,
                             softmax_focal_loss_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(softmax_focal_loss_backward_impl, CPU, DEFAULT,
                             softmax_focal_loss_backward_cpu);
}
