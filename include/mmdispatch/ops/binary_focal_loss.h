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
 * textbook forms subtract numbers close to 1 (torchvision's 1 - p_t).
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
 * with_grad_target); otherwise neither checked nor written. */
inline int mmd_binary_focal_loss_check_grad(const mmd_tensor *grad, const char *name,
                                            const mmd_tensor *input, int wanted) {
    return wanted ? mmd_binary_focal_loss_check_like(grad, name, input) : MMD_OK;
}

/* a_t: the class weight of a target (1 where alpha is -1). */
template <typename T> MMD_HOSTDEV inline T mmd_binary_focal_weight(T t, T alpha) {
    return alpha < 0 ? (T)1 : alpha * t + ((T)1 - alpha) * ((T)1 - t);
}

/* r^gamma: the common gammas without pow (as exact, and several times
 * cheaper on a GPU; glibc's pow rounds r * r correctly too). */
template <typename T> MMD_HOSTDEV inline T mmd_focal_power(T r, T gamma) {
    if (gamma == 2) return r * r;
    if (gamma == 1) return r;
    if (gamma == 0) return (T)1;
    return pow(r, gamma);
}

/* What an element's loss and gradients share: p = sigmoid(x),
 * q = sigmoid(-x), the cross entropy and r = 1 - p_t, from one exp and one
 * log1p (mmd_sigmoid's and mmd_softplus's values). */
template <typename T> struct mmd_binary_focal_terms {
    T p, q, ce, r;
    MMD_HOSTDEV mmd_binary_focal_terms(T x, T t) {
        const T e = exp(-fabs(x)), tail = log1p(e), big = (T)1 / ((T)1 + e);
        const int positive = x >= 0;
        p = positive ? big : e * big;
        q = positive ? e * big : big;
        /* softplus(x) = max(x, 0) + tail, softplus(-x) = max(-x, 0) + tail */
        ce = ((T)1 - t) * ((positive ? x : (T)0) + tail) + t * ((positive ? (T)0 : -x) + tail);
        r = p * ((T)1 - t) + q * t;
    }
};

/* The loss of one element. */
template <typename T> MMD_HOSTDEV inline T mmd_binary_focal_loss(T x, T t, T gamma, T alpha) {
    const mmd_binary_focal_terms<T> f(x, t);
    return mmd_binary_focal_weight(t, alpha) * f.ce * mmd_focal_power(f.r, gamma);
}

/* d loss / d x (*d_x) and d loss / d t (*d_t) of one element. r' at r = 0
 * (a saturated logit on its target's side: then p * q = 0 too) is taken as
 * 0 but for gamma = 1 (1): its one-sided limit for gamma > 1, and for
 * gamma < 1 the limit of the products it enters, where torchvision's pow
 * gives inf * 0 = NaN. */
template <typename T>
MMD_HOSTDEV inline void mmd_binary_focal_loss_grad(T x, T t, T gamma, T alpha, T *d_x, T *d_t) {
    const mmd_binary_focal_terms<T> f(x, t);
    const T m = mmd_focal_power(f.r, gamma);
    const T slope = gamma == 0 ? (T)0
                    : f.r != 0 ? gamma * mmd_focal_power(f.r, gamma - (T)1)
                               : (gamma == 1 ? (T)1 : (T)0);
    const T a = mmd_binary_focal_weight(t, alpha);
    /* p - t as p (1 - t) - q t: exact where t is 0 or 1 (p - 1 of a p
     * close to 1 would keep a few digits of q) */
    *d_x = a * ((f.p * ((T)1 - t) - f.q * t) * m +
                f.ce * slope * f.p * f.q * ((T)1 - (T)2 * t));
    *d_t = (alpha < 0 ? (T)0 : ((T)2 * alpha - (T)1) * f.ce * m) +
           a * (-x * m + f.ce * slope * (f.q - f.p));
}

#endif
