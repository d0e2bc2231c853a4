/* softmax_focal_loss on CPU: a row at a time (its softmax, then its loss
 * or gradient), rows split over the worker pool, each row's elements 8
 * float32 or 4 float64 at a time (its maximum, its sum of exps and the
 * gradient's probabilities, through vec_math.h's exp); targets are
 * validated before anything is written. */
#include "mmdispatch/ops/softmax_focal_loss.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "vec_math.h"

namespace {

int check_targets(const mmd_tensor *target, int64_t num_classes) {
    const int64_t *t = (const int64_t *)target->data;
    for (int64_t i = 0; i < target->shape[0]; ++i)
        if (t[i] >= num_classes) return mmd_softmax_focal_loss_target_error(i, t[i], num_classes);
    return MMD_OK;
}

/* A row's softmax on vectors: its maximum and log(sum(exp(x - max))) as
 * log1p of mmd_softmax_others of the terms below the maximum and the ties,
 * the sum taken lane by lane (lane l of the partial sums adds the
 * elements l, l + lanes, ..., then the lanes in order: every row of a
 * given length sums in the same order). */
template <typename M> struct VecSoftmaxRow {
    typedef typename M::scalar T;
    typedef typename M::value V;
    T max, log_sum, others;   /* others: mmd_softmax_others */

    /* terms (or null): each element's exp(x - max), written */
    MMD_INLINE VecSoftmaxRow(const T *x, int64_t classes, T *terms = nullptr) {
        V m = V() + (T)-INFINITY;
        for (int64_t c = 0; c < classes; c += M::lanes) {
            const int count = M::count(classes - c);
            const V v = M::load(x + c, count, (T)-INFINITY);
            m = M::where(v > m, v, m);   /* NaN skipped: never the maximum */
        }
        max = -INFINITY;
        for (int lane = 0; lane < M::lanes; ++lane) max = m[lane] > max ? m[lane] : max;
        V sum = V(), ties = V();   /* ties: the elements at the maximum, lane by lane */
        for (int64_t c = 0; c < classes; c += M::lanes) {
            const int count = M::count(classes - c);
            const V y = M::load(x + c, count, max) - max;   /* pad: y = 0, not counted */
            const typename M::mask top = y == (T)0;
            const V term = M::exp_nonpositive(y);
            if (terms) M::store(terms + c, count, term);
            const V e = M::where(top, V(), term);
            const V tie = M::where(top, V() + (T)1, V());
            if (count == M::lanes) {
                sum += e;
                ties += tie;
            } else {
                for (int lane = 0; lane < count; ++lane) {
                    sum[lane] += e[lane];
                    ties[lane] += tie[lane];
                }
            }
        }
        T rest = 0, tied = 0;   /* tied: exact (below 2^24 ties a lane) */
        for (int lane = 0; lane < M::lanes; ++lane) {
            rest += sum[lane];
            tied += ties[lane];
        }
        others = mmd_softmax_others(rest, tied);
        log_sum = log1p(others);
    }
    T log_p(T x) const { return x - max - log_sum; }
};

/* One row's loss (out: its element), or its gradient scaled by g (out: the
 * row), of a row whose target is `label`; the formulas of
 * softmax_focal_loss.h, with the vector softmax. */
template <bool Backward, typename T>
MMD_X86_CLONES void focal_loss_row(const T *x, int64_t classes, int64_t label, T scale, T g,
                                   T gamma, T alpha, T *out) {
    typedef VecMath<T> M;
    typedef typename M::value V;
    const VecSoftmaxRow<M> row(x, classes, Backward ? out : nullptr);   /* out: the terms */
    const T log_p = row.log_p(x[label]);
    if (!Backward) {
        *out = scale * mmd_softmax_focal_loss(log_p, gamma, alpha);
        return;
    }
    const T factor = g * scale * mmd_softmax_focal_loss_factor(log_p, gamma, alpha);
    const T per_term = mmd_softmax_focal_loss_term_scale(factor, row.others);
    for (int64_t c = 0; c < classes; c += M::lanes) {
        const int count = M::count(classes - c);
        V grad = per_term * M::load(out + c, count);
        if (label - c >= 0 && label - c < count)
            grad[label - c] = mmd_softmax_focal_loss_target_grad(factor, log_p);
        M::store(out + c, count, grad);
    }
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
            const T scale = w ? w[label] : (T)1;
            if (g == nullptr)
                focal_loss_row<false>(x, classes, label, scale, (T)1, gamma, alpha, out + i);
            else
                focal_loss_row<true>(x, classes, label, scale, g[i], gamma, alpha,
                                     out + i * classes);
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
