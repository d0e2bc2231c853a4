/* sigmoid_focal_loss on CPU: elementwise over (N, C), rows split over the
 * worker pool, each row's elements 8 float32 or 4 float64 at a time;
 * targets are validated before anything is written. */
#include "mmdispatch/ops/sigmoid_focal_loss.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "vec_math.h"

namespace {

int check_targets(const mmd_tensor *target, int64_t num_classes) {
    const int64_t *t = (const int64_t *)target->data;
    for (int64_t i = 0; i < target->shape[0]; ++i)
        if (t[i] < 0 || t[i] > num_classes)
            return mmd_sigmoid_focal_loss_target_error(i, t[i], num_classes);
    return MMD_OK;
}

/* Loss (Backward = false) or its gradient (true) of a row's elements, whose
 * target column is `target` (none: background), times `scale`: on vectors
 * of binary_focal_loss's terms of the one-hot target (vec_math.h). */
template <bool Backward, typename T>
MMD_X86_CLONES void focal_loss_row(const T *x, int64_t classes, int64_t target, T scale,
                                   T gamma, T alpha, T *out) {
    typedef VecMath<T> M;
    typedef typename M::value V;
    mmd_vec_elements<M>(
        0, classes, x,
        [&](int64_t c, int count, const V &xv) {
            V t = V();
            if (target - c >= 0 && target - c < count) t[target - c] = 1;
            const V a = M::where(t != (T)0, V() + alpha, V() + ((T)1 - alpha));
            V value, d_t;
            if (Backward)
                mmd_binary_focal_loss_grad_of<M>(xv, t, gamma, a, (T)0, &value, &d_t);
            else
                value = mmd_binary_focal_loss_of<M>(xv, t, gamma, a);
            M::store(out + c, count, scale * value);
        },
        [&](int64_t c) {
            const int positive = c == target;
            out[c] = scale * (Backward ? mmd_focal_loss_grad(x[c], positive, gamma, alpha)
                                       : mmd_focal_loss(x[c], positive, gamma, alpha));
        });
}

/* Loss or its gradient for every element. */
template <bool Backward, typename T>
void focal_loss(const mmd_tensor *input, const mmd_tensor *target, const mmd_tensor *weight,
                const mmd_tensor *output, T gamma, T alpha) {
    const int64_t rows = input->shape[0], classes = input->shape[1];
    const T *in = (const T *)input->data, *w = weight ? (const T *)weight->data : nullptr;
    const int64_t *t = (const int64_t *)target->data;
    T *out = (T *)output->data;
    /* an element (exp, log1p) costs several steps: shared out from 16384 */
    mmd_parallel_for(rows, mmd_even_chunk(rows), rows * classes > 16384,
                     [&](int64_t begin, int64_t end) {
                         for (int64_t i = begin; i < end; ++i)
                             focal_loss_row<Backward>(in + i * classes, classes, t[i],
                                                      (w && t[i] < classes) ? w[t[i]] : (T)1,
                                                      gamma, alpha, out + i * classes);
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
    auto run = [&](auto zero) {
        typedef decltype(zero) T;
        (backward ? focal_loss<true, T> : focal_loss<false, T>)(input, target, weight, output,
                                                                (T)gamma, (T)alpha);
    };
    if (input->dtype == MMD_FLOAT32)
        run(0.0f);
    else
        run(0.0);
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
