/* binary_focal_loss (torchvision's sigmoid_focal_loss): the argument checks
 * and the per-element math shared by the CPU kernels
 * (src/cpu/binary_focal_loss.cpp) and the CUDA kernels
 * (src/cuda/binary_focal_loss.cu).
 *
 * input: logits of any shape; target: the same shape and dtype, (soft)
 * binary labels. With p = sigmoid(x), q = 1 - p = sigmoid(-x):
 *   ce   = softplus(x) - x * t     (binary cross entropy from the logit)
 *   r    = 1 - p_t = p * (1 - t) + q * t
 *   loss = a_t * ce * r^gamma,  a_t = alpha * t + (1 - alpha) * (1 - t),
 *          or 1 where alpha is -1 (no class weighting)
 * ce is taken as (1 - t) * softplus(x) + t * softplus(-x) and r as above,
 * sums of terms of one sign for t in [0, 1]: no cancellation where the
 * textbook forms subtract numbers close to 1 (torchvision's 1 - p_t). The
 * loss and d loss / d x are exact to rounding for logits of any size;
 * d loss / d t sums terms of both signs, which may cancel.
 * Gradients, with r' = d r^gamma / d r:
 *   d loss / d x = a_t * ((p - t) * r^gamma + ce * r' * p * q * (1 - 2t))
 *   (p - t taken as p * (1 - t) - q * t, exact for hard targets)
 *   d loss / d t = (2 alpha - 1) * ce * r^gamma
 *                  + a_t * (-x * r^gamma + ce * r' * (q - p))
 * (no first term where alpha is -1). T, the compute type, is float or
 * double; the overloads of exp, log1p, fabs and pow take T. */
#ifndef MMDISPATCH_OPS_BINARY_FOCAL_LOSS_H
#define MMDISPATCH_OPS_BINARY_FOCAL_LOSS_H

#include <math.h>

#include "mmdispatch/ops/focal_loss.h"

/* `t` shaped and typed like `input`, densely laid out. */
inline int mmd_binary_focal_loss_check_like(const mmd_tensor *t, const char *name,
                                            const mmd_tensor *input) {
    return mmd_check_like(t, name, input->ndim, input->shape, input, "input");
}

/* input, target and the scalars; gamma >= 0, alpha in [0, 1] or -1. */
inline int mmd_binary_focal_loss_check(const mmd_tensor *input, const mmd_tensor *target,
                                       double gamma, double alpha, unsigned float_mask) {
    int s = mmd_check_dtype(input, "input", float_mask);
    if (!s) s = mmd_check_contiguous(input, "input");
    if (!s) s = mmd_binary_focal_loss_check_like(target, "target", input);
    if (!s) s = mmd_focal_loss_check_scalars(input, gamma, alpha);
    if (!s && !((alpha >= 0 && alpha <= 1) || alpha == -1))
        s = mmd_error(MMD_ERR_VALUE, "alpha must be in [0, 1], or -1 for no class weighting, "
                                     "got %g", alpha);
    return s;
}

/* A gradient output: like input where it is `wanted` (with_grad_input,
 * with_grad_target); otherwise neither its shape nor its dtype is checked
 * and it is not written (the dispatcher's checks of every output, such as
 * writable and not overlapping an input, still apply). */
inline int mmd_binary_focal_loss_check_grad(const mmd_tensor *grad, const char *name,
                                            const mmd_tensor *input, int wanted) {
    return wanted ? mmd_binary_focal_loss_check_like(grad, name, input) : MMD_OK;
}

/* Whether grad_output is one value, the gradient of every element (0-d,
 * where input is not: a sum's or a mean's), rather than input's shape. */
inline int mmd_binary_focal_loss_broadcast(const mmd_tensor *grad_output,
                                           const mmd_tensor *input) {
    return grad_output->ndim == 0 && input->ndim != 0;
}

/* Every argument of the forward entry point. */
inline int mmd_binary_focal_loss_forward_check(const mmd_tensor *input, const mmd_tensor *target,
                                               const mmd_tensor *output, double gamma,
                                               double alpha, unsigned float_mask) {
    int s = mmd_binary_focal_loss_check(input, target, gamma, alpha, float_mask);
    if (!s) s = mmd_binary_focal_loss_check_like(output, "output", input);
    return s;
}

/* Every argument of the backward entry point. */
inline int mmd_binary_focal_loss_backward_check(const mmd_tensor *input,
                                                const mmd_tensor *target,
                                                const mmd_tensor *grad_output,
                                                const mmd_tensor *grad_input,
                                                const mmd_tensor *grad_target, double gamma,
                                                double alpha, int with_grad_input,
                                                int with_grad_target, unsigned float_mask) {
    int s = mmd_binary_focal_loss_check(input, target, gamma, alpha, float_mask);
    if (!s)
        s = mmd_binary_focal_loss_broadcast(grad_output, input)
                ? mmd_check_same_dtype(grad_output, "grad_output", input, "input")
                : mmd_binary_focal_loss_check_like(grad_output, "grad_output", input);
    if (!s) s = mmd_binary_focal_loss_check_grad(grad_input, "grad_input", input, with_grad_input);
    if (!s)
        s = mmd_binary_focal_loss_check_grad(grad_target, "grad_target", input, with_grad_target);
    return s;
}

/* The formulas below are written once over a math policy M: M::value is a
 * scalar (M::scalar, float or double: mmd_scalar_math, for CUDA and the
 * CPU's scalar elements) or a vector of them (the CPU's, src/cpu/
 * vec_math.h), whose comparisons give M::where's first argument. M has
 * `magnitude` (fabs), `exponential` (exp), `log_one_plus` (log1p of a
 * value in [0, 1]), `log_one_plus_wide` (log1p of one in [0, kWide]:
 * softmax_focal_loss.h) and `power` (pow: r^gamma). */
template <typename T> struct mmd_scalar_math {
    typedef T value;
    typedef T scalar;
    static MMD_HOSTDEV T where(bool c, T a, T b) { return c ? a : b; }
    static MMD_HOSTDEV T magnitude(T v) { return fabs(v); }
    static MMD_HOSTDEV T exponential(T v) { return exp(v); }
    static MMD_HOSTDEV T log_one_plus(T v) { return log1p(v); }
    static MMD_HOSTDEV T log_one_plus_wide(T v) { return log1p(v); }
    static MMD_HOSTDEV T power(T v, T e) { return pow(v, e); }
};

/* a_t: the class weight of a target (1 where alpha is -1), and its slope
 * d a_t / d t. */
template <typename M>
MMD_HOSTDEV inline typename M::value mmd_binary_focal_weight(typename M::value t,
                                                             typename M::scalar alpha) {
    typedef typename M::scalar T;
    return alpha < 0 ? typename M::value() + (T)1
                     : alpha * t + ((T)1 - alpha) * ((T)1 - t);
}
template <typename T> MMD_HOSTDEV inline T mmd_binary_focal_weight_slope(T alpha) {
    return alpha < 0 ? (T)0 : (T)2 * alpha - (T)1;
}

/* r^gamma: the common gammas without pow (as exact, and several times
 * cheaper on a GPU; glibc's pow rounds r * r correctly too). */
template <typename M>
MMD_HOSTDEV inline typename M::value mmd_focal_power(typename M::value r,
                                                     typename M::scalar gamma) {
    if (gamma == 2) return r * r;
    if (gamma == 1) return r;
    if (gamma == 0) return typename M::value() + (typename M::scalar)1;
    return M::power(r, gamma);
}

/* What an element's loss and gradients share: p = sigmoid(x),
 * q = sigmoid(-x), the cross entropy and r = 1 - p_t, from one exp and one
 * log1p. */
template <typename M> struct mmd_binary_focal_terms {
    typedef typename M::value V;
    typedef typename M::scalar T;
    V p, q, ce, r;
    MMD_HOSTDEV mmd_binary_focal_terms(V x, V t) {
        const V e = M::exponential(-M::magnitude(x)), tail = M::log_one_plus(e);
        const V big = (T)1 / ((T)1 + e);
        const auto positive = x >= (T)0;
        p = M::where(positive, big, e * big);
        q = M::where(positive, e * big, big);
        /* softplus(x) = max(x, 0) + tail, softplus(-x) = max(-x, 0) + tail;
         * a hard target's other term is left out (at an infinite logit it
         * is 0 * inf) */
        ce = M::where(t != (T)1, ((T)1 - t) * (M::where(positive, x, V()) + tail), V()) +
             M::where(t != (T)0, t * (M::where(positive, V(), -x) + tail), V());
        r = p * ((T)1 - t) + q * t;
    }
};

/* The loss of elements whose class weights are a (a_t, of the target; or
 * MMCV's alpha or 1 - alpha). */
template <typename M>
MMD_HOSTDEV inline typename M::value mmd_binary_focal_loss_of(typename M::value x,
                                                              typename M::value t,
                                                              typename M::scalar gamma,
                                                              typename M::value a) {
    const mmd_binary_focal_terms<M> f(x, t);
    return a * f.ce * mmd_focal_power<M>(f.r, gamma);
}

/* d loss / d x (*d_x) and d loss / d t (*d_t) of elements whose class
 * weights are a, of slope a_slope in t (a term left out where it is 0: at
 * an infinite logit ce is infinite). ce * r' is taken as
 * gamma * r^gamma * (ce / r), finite where r is subnormal and
 * r^(gamma - 1) would overflow (ce is about r there); at r = 0 (a logit
 * saturated on its target's side: then p * q = 0 too) as 0, but ce for
 * gamma = 1: r' is 0 there for gamma > 1 and its products' limit is 0 for
 * gamma < 1, where torchvision's pow gives inf * 0 = NaN; and as 0 for
 * gamma = 0 whatever ce is. */
template <typename M>
MMD_HOSTDEV inline void mmd_binary_focal_loss_grad_of(typename M::value x, typename M::value t,
                                                      typename M::scalar gamma,
                                                      typename M::value a,
                                                      typename M::scalar a_slope,
                                                      typename M::value *d_x,
                                                      typename M::value *d_t) {
    typedef typename M::value V;
    typedef typename M::scalar T;
    const mmd_binary_focal_terms<M> f(x, t);
    const V m = mmd_focal_power<M>(f.r, gamma);
    const V ce_slope = gamma == 0 ? V()
                                  : M::where(f.r != (T)0, gamma * m * (f.ce / f.r),
                                             gamma == 1 ? f.ce : V());
    /* p - t as p (1 - t) - q t: exact where t is 0 or 1 (p - 1 of a p
     * close to 1 would keep a few digits of q); where p q = 0 (an infinite
     * logit, or one past 745) the second term's limit is 0 whatever
     * ce_slope, which may be inf there */
    const V pq = f.p * f.q;
    *d_x = a * ((f.p * ((T)1 - t) - f.q * t) * m +
                M::where(pq != (T)0, ce_slope * pq * ((T)1 - (T)2 * t), V()));
    *d_t = (a_slope == 0 ? V() : a_slope * f.ce * m) + a * (-x * m + ce_slope * (f.q - f.p));
}

/* The same, of one element. */
template <typename T> MMD_HOSTDEV inline T mmd_binary_focal_loss(T x, T t, T gamma, T alpha) {
    typedef mmd_scalar_math<T> M;
    return mmd_binary_focal_loss_of<M>(x, t, gamma, mmd_binary_focal_weight<M>(t, alpha));
}
template <typename T>
MMD_HOSTDEV inline void mmd_binary_focal_loss_grad(T x, T t, T gamma, T alpha, T *d_x, T *d_t) {
    typedef mmd_scalar_math<T> M;
    mmd_binary_focal_loss_grad_of<M>(x, t, gamma, mmd_binary_focal_weight<M>(t, alpha),
                                     mmd_binary_focal_weight_slope(alpha), d_x, d_t);
}

#endif
