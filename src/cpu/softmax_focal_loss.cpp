/* softmax_focal_loss on CPU: rows split over the worker pool; each row's
 * softmax on its elements 8 float32 or 4 float64 at a time (its maximum,
 * its sum of exps and the gradient's probabilities, through vec_math.h's
 * exp), then the per-row math of 8 or 4 rows at once (vec_math.h's wide
 * log1p; softmax_focal_loss.h's formulas); targets are validated before
 * anything is written. */
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

/* Where a row of `classes` elements ends, for vectors of M::lanes: `full`
 * elements in whole vectors from 0, then (if the row does not end there) a
 * tail vector from `tail`, the last M::lanes elements (overlapping the
 * whole vectors' last) or, in a row shorter than that, its elements and
 * padding, whose `fresh` lanes are the elements the whole vectors did not
 * take. */
template <typename M> struct VecRowTail {
    typedef typename M::scalar T;
    typedef typename M::value V;
    int64_t full, tail;
    int count;   /* fresh lanes */
    bool short_row;
    typename M::mask fresh;
    MMD_INLINE explicit VecRowTail(int64_t classes)
        : full(classes - classes % M::lanes), tail(classes < M::lanes ? 0 : classes - M::lanes),
          count((int)(classes - full)), short_row(classes < M::lanes) {
        V lane;
        for (int l = 0; l < M::lanes; ++l) lane[l] = (T)l;
        fresh = short_row ? lane < (T)count : lane >= (T)(M::lanes - count);
    }
    /* the tail's elements (a short row's padded with pad) */
    MMD_INLINE V load(const T *x, T pad) const {
        return short_row ? M::load(x, count, pad) : M::load(x + tail, M::lanes);
    }
    MMD_INLINE void store(T *x, V v) const {
        if (short_row)
            M::store(x, count, v);
        else
            M::store(x + tail, M::lanes, v);
    }
};

/* A row's softmax on vectors: its maximum and mmd_softmax_others of the
 * terms below the maximum and the ties, the sum taken lane by lane (lane l
 * of the partial sums adds the elements l, l + lanes, ... of the whole
 * vectors, then its element of the tail vector if fresh, then the lanes in
 * order: every row of a given length sums in the same order). */
template <typename M> struct VecSoftmaxRow {
    typedef typename M::scalar T;
    typedef typename M::value V;
    T max, others;   /* others: mmd_softmax_others */

    /* terms (or null): each element's exp(x - max), written */
    MMD_INLINE VecSoftmaxRow(const T *x, const VecRowTail<M> &tail, T *terms = nullptr) {
        V m = V() + (T)-INFINITY;
        for (int64_t c = 0; c < tail.full; c += M::lanes) {
            const V v = M::load(x + c, M::lanes);
            m = M::where(v > m, v, m);   /* NaN skipped: never the maximum */
        }
        if (tail.count) {   /* the overlap: seen twice, the same maximum */
            const V v = tail.load(x, (T)-INFINITY);
            m = M::where(v > m, v, m);
        }
        max = -INFINITY;
        for (int lane = 0; lane < M::lanes; ++lane) max = m[lane] > max ? m[lane] : max;
        V sum = V(), ties = V();   /* ties: the elements at the maximum, lane by lane */
        if (!add_terms<false>(x, tail, terms, sum, ties)) {
            sum = V();   /* a lane outside the vector exp's domain: again, exactly */
            ties = V();
            add_terms<true>(x, tail, terms, sum, ties);
        }
        T rest = 0, tied = 0;   /* tied: exact (below 2^24 ties a lane) */
        for (int lane = 0; lane < M::lanes; ++lane) {
            rest += sum[lane];
            tied += ties[lane];
        }
        others = mmd_softmax_others(rest, tied);
    }

    /* Adds each element's exp(x - max) to sum, but the ties' (1 each), which
     * it counts: y = x - max is at most 0 where x is not NaN (the rounded
     * difference of x <= max). Exact: the lanes where y lies outside the
     * vector exp's domain take the C library's, vector by vector; else
     * false where any lane does (the sums are then not the row's). */
    template <bool Exact>
    MMD_INLINE bool add_terms(const T *x, const VecRowTail<M> &tail, T *terms, V &sum,
                              V &ties) const {
        typename M::mask outside = typename M::mask();
        const auto term_of = [&](V y) {
            return Exact ? M::exp_nonpositive(y) : M::exp_nonpositive_inside(y, outside);
        };
        for (int64_t c = 0; c < tail.full; c += M::lanes) {
            const V y = M::load(x + c, M::lanes) - max;
            const typename M::mask top = y == (T)0;
            const V term = term_of(y);
            if (terms) M::store(terms + c, M::lanes, term);
            sum += M::where(top, V(), term);
            ties += M::where(top, V() + (T)1, V());
        }
        if (tail.count) {   /* a short row's padding: y = 0, not fresh */
            const V y = tail.load(x, max) - max;
            const typename M::mask top = y == (T)0;
            const V term = term_of(y);
            if (terms) tail.store(terms, term);
            sum += M::where(top | ~tail.fresh, V(), term);
            ties += M::where(top & tail.fresh, V() + (T)1, V());
        }
        return Exact || !M::any(outside);
    }
};

/* The loss of rows [begin, end) (grad_output null; out: the losses), or
 * the gradient of sum(loss * grad_output) with respect to their logits
 * (out: the gradient), M::lanes rows at a time: each row's softmax on
 * vectors of its elements, then the block's per-row math
 * (softmax_focal_loss.h) on a vector of its rows, but where a row's others
 * or y lies outside what VecMath's log_one_plus_wide and exponential hold
 * (a row with NaN, or a target far below the maximum), which takes the
 * scalar formulas and the C library's math. */
template <bool Backward, typename T>
MMD_X86_CLONES void focal_loss_rows(const T *in, const int64_t *t, const T *w, const T *g,
                                    int64_t begin, int64_t end, int64_t classes, T gamma,
                                    T alpha, T *out) {
    typedef VecMath<T> M;
    typedef typename M::value V;
    typedef mmd_scalar_math<T> S;
    const VecRowTail<M> tail(classes);
    for (int64_t first = begin; first < end; first += M::lanes) {
        const int rows = M::count(end - first);
        V y = V(), others = V(), scale = V() + (T)1, g_row = V() + (T)1;
        unsigned live = 0;   /* the bits of the rows not ignored */
        for (int l = 0; l < rows; ++l) {
            const int64_t i = first + l, label = t[i];
            const T *x = in + i * classes;
            T *o = out + (Backward ? i * classes : i);
            if (label < 0) {   /* ignored */
                for (int64_t c = 0; c < (Backward ? classes : 1); ++c) o[c] = 0;
                continue;
            }
            const VecSoftmaxRow<M> row(x, tail, Backward ? o : nullptr);   /* o: the terms */
            live |= 1u << l;
            y[l] = x[label] - row.max;
            others[l] = row.others;
            if (w) scale[l] = w[label];
            if (Backward) g_row[l] = g[i];
        }
        if (!live) continue;
        const typename M::mask outside =
            ~(others <= M::C::kWide) | ~(y >= -M::C::kSafe);   /* NaN: outside */
        /* a row's loss (times its weight), or its gradient's factor (times
         * its weight and grad_output), of either policy */
        const auto value_of = [&](const auto &f, auto weight) {
            return weight * (Backward ? mmd_softmax_focal_loss_factor(f, gamma, alpha)
                                      : mmd_softmax_focal_loss(f, gamma, alpha));
        };
        const V weights = Backward ? g_row * scale : scale;
        const mmd_softmax_focal_target<M> f(M::where(outside, V(), y),
                                            M::where(outside, V(), others));
        V value = value_of(f, weights), q = f.q;
        for (int l = 0; l < rows; ++l) {
            if (!(live >> l & 1)) continue;
            if (outside[l]) {
                const mmd_softmax_focal_target<S> scalar(y[l], others[l]);
                value[l] = value_of(scalar, weights[l]);
                q[l] = scalar.q;
            }
            const int64_t i = first + l;
            if (!Backward) {
                out[i] = value[l];
                continue;
            }
            /* the row's terms, in o, become its gradient */
            const T factor = value[l];
            const T per_term = mmd_softmax_focal_loss_term_scale(factor, others[l]);
            const int64_t label = t[i];
            T *o = out + i * classes;
            const V tail_terms = tail.count ? tail.load(o, 0) : V();   /* before the overlap's */
            for (int64_t c = 0; c < tail.full; c += M::lanes)
                M::store(o + c, M::lanes, per_term * M::load(o + c, M::lanes));
            if (tail.count) tail.store(o, per_term * tail_terms);
            o[label] = factor * q[l];
        }
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
        if (g == nullptr)
            focal_loss_rows<false>(in, t, w, g, begin, end, classes, gamma, alpha, out);
        else
            focal_loss_rows<true>(in, t, w, g, begin, end, classes, gamma, alpha, out);
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
