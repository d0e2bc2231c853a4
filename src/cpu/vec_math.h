/* Elementwise math on vectors of float or double (vec16.h's Vec), for the
 * CPU kernels whose elements each take an exp and a log1p (glibc's take
 * several times the rest of such an element's work, one lane at a time):
 * the math policy of the formulas in include/mmdispatch/ops (M there; see
 * mmd_scalar_math), and a loop that runs such a formula over arrays.
 *
 * exponential and log_one_plus hold only on the domain that those
 * formulas give them, e^(-|x|) and log1p of it for |x| <= kSafe: there
 * they are within 1.2 ulp of the exact value (series of exp to r^7 or r^13
 * and of atanh to s^9 or s^21, whose remainders stay far below an ulp;
 * measured against long double over 2 * 10^7 arguments each:
 * tools/vec_math_accuracy.py); log_one_plus_wide, log1p on [0, kWide] (a
 * softmax row's sum of exps less one), within 1.23 ulp. Elements whose x
 * lies outside (larger, infinite or NaN), where exp's result nears the
 * subnormals, take the scalar formula with the C library's exp and log1p
 * instead. Only IEEE
 * operations, and no FMA in any clone of MMD_X86_CLONES: each gives the
 * same bits (a build whose compiler may fuse multiply-adds, such as
 * -march=native or arm64, gives others), and an element's value does not
 * depend on where it lies. */
#ifndef MMDISPATCH_CPU_VEC_MATH_H
#define MMDISPATCH_CPU_VEC_MATH_H

#include <math.h>
#include <stdint.h>

#include "mmdispatch/parallel.h"
#include "vec16.h"

namespace {

/* The constants of T's exp and log1p. */
template <typename T> struct VecMathConstants;
template <> struct VecMathConstants<float> {
    typedef int32_t bits;
    static constexpr float kSafe = 80;              /* e^-80 = 1.8e-35: normal */
    static constexpr float kRound = 12582912.0f;    /* 1.5 * 2^23: a sum with it is an integer */
    static constexpr int kMantissa = 23, kBias = 127;
    /* ln 2 in 16 bits and the rest: n * kLn2High is exact for |n| < 256 */
    static constexpr float kLn2High = 0.693145751953125f, kLn2Low = 1.428606765330187e-06f;
    static constexpr int kExpTerms = 7, kAtanhTerms = 4;
    static constexpr float kWide = 4194304.0f;      /* 2^22: 1 + kWide < 2^kMantissa */
};
template <> struct VecMathConstants<double> {
    typedef int64_t bits;
    static constexpr double kSafe = 700;            /* e^-700 = 9.9e-305: normal */
    static constexpr double kRound = 6755399441055744.0;   /* 1.5 * 2^52 */
    static constexpr int kMantissa = 52, kBias = 1023;
    /* ln 2 in 42 bits and the rest: n * kLn2High is exact for |n| < 2048 */
    static constexpr double kLn2High = 0.6931471805598903, kLn2Low = 5.497923018708371e-14;
    static constexpr int kExpTerms = 13, kAtanhTerms = 10;
    static constexpr double kWide = 2251799813685248.0;   /* 2^51 */
};

/* 1/k!, and 2/(2k + 1) (atanh's series), correctly rounded to double
 * (k! is exact in double up to 18!). */
constexpr double mmd_inverse_factorial(int k) {
    double factorial = 1;
    for (int i = 2; i <= k; ++i) factorial *= i;
    return 1 / factorial;
}
constexpr double mmd_atanh_coefficient(int k) { return 2.0 / (2 * k + 1); }

template <typename T, int Bytes = 32> struct VecMath {
    typedef VecMathConstants<T> C;
    typedef Vec<T, Bytes> vec;
    typedef typename vec::type value;
    typedef T scalar;
    typedef typename C::bits bits_scalar;
    typedef bits_scalar bits __attribute__((vector_size(Bytes)));
    typedef decltype(value() < value()) mask;   /* lanes of all ones or all zeros */
    static constexpr int lanes = vec::lanes;

    static MMD_INLINE value where(mask m, value a, value b) {
        return (value)(((bits)a & (bits)m) | ((bits)b & ~(bits)m));
    }
    static MMD_INLINE value magnitude(value v) {
        return (value)((bits)v & ~(bits)(-value()));   /* -value(): the sign bits */
    }
    static MMD_INLINE bool any(mask m) {
        bits_scalar seen = 0;
        for (int lane = 0; lane < lanes; ++lane) seen |= m[lane];
        return seen != 0;
    }

    /* Coefficient(K) + Coefficient(K + 1) z + ... + Coefficient(Last)
     * z^(Last-K), by Horner's rule. */
    template <double (*Coefficient)(int), int K, int Last>
    static MMD_INLINE value series(value z) {
        constexpr T coefficient = (T)Coefficient(K);
        if constexpr (K == Last)
            return value() + coefficient;
        else
            return series<Coefficient, K + 1, Last>(z) * z + coefficient;
    }

    /* e^y for y in [-kSafe, 0]: y = n ln 2 + r, |r| <= ln 2 / 2, and
     * e^r = 1 + r + r^2 (1/2! + r/3! + ...), times 2^n made in the
     * exponent's bits. */
    static MMD_INLINE value exponential(value y) {
        y = where(y > -C::kSafe, y, value() - C::kSafe);
        const value shifted = y * (T)1.4426950408889634 + C::kRound;   /* n + kRound */
        const value n = shifted - C::kRound;
        const value r = (y - n * C::kLn2High) - n * C::kLn2Low;
        const value power =
            (value)(((bits)shifted - (bits)(value() + C::kRound) + (bits_scalar)C::kBias)
                    << C::kMantissa);
        const value tail = series<mmd_inverse_factorial, 2, C::kExpTerms>(r);
        return power * ((T)1 + (r + r * r * tail));
    }

    /* log(1 + f) for |f| <= 1/2: 2 atanh(s), s = f / (2 + f), |s| < 0.2,
     * taken as f - (f^2/2 - s (f^2/2 + R)), R = 2 atanh(s) - 2 s over s
     * = (2/3) s^2 + (2/5) s^4 + .... */
    static MMD_INLINE value log_one_plus_small(value f) {
        const value s = f / ((T)2 + f), z = s * s, half_square = (T)0.5 * f * f;
        const value rest = z * series<mmd_atanh_coefficient, 1, C::kAtanhTerms>(z);
        return f - (half_square - s * (half_square + rest));
    }

    /* log(1 + e) for e in [0, 1]: log(1 + f) with f = e below 1/2, else
     * ln 2 + log(1 + f) with f = (e - 1) / 2 (exact). */
    static MMD_INLINE value log_one_plus(value e) {
        const mask upper = e >= (T)0.5;
        const value log_f = log_one_plus_small(where(upper, (e - (T)1) * (T)0.5, e));
        return where(upper, log_f + (T)0.6931471805599453, log_f);
    }

    /* log(1 + e) for e in [0, kWide]: u = 1 + e rounded is 2^k m with m in
     * [sqrt(1/2), sqrt(2)) (k from u's bits less sqrt(1/2)'s: the exponent
     * once m passes sqrt(2)), so log(1 + e) = k ln 2 + log(1 + f) with
     * f = m - 1 (exact), plus d / u for what rounding u lost,
     * d = e - (u - 1) (exact: u - 1 is, as u <= 1 + kWide < 2^kMantissa, and
     * e is within a factor 2 of it). */
    static MMD_INLINE value log_one_plus_wide(value e) {
        const value u = (T)1 + e, d = e - (u - (T)1);
        const bits low = (bits)(value() + (T)0.70710678118654752);
        const bits k = ((bits)u - low) >> C::kMantissa;
        const value m = (value)((bits)u - (k << C::kMantissa));
        const value n = __builtin_convertvector(k, value);
        return n * C::kLn2High + (log_one_plus_small(m - (T)1) + (n * C::kLn2Low + d / u));
    }

    /* The elements of a run of at most `lanes` from `left` remaining. */
    static MMD_INLINE int count(int64_t left) { return left < lanes ? (int)left : lanes; }

    /* count elements from p (the rest of the lanes `pad`), and back. */
    static MMD_INLINE value load(const T *p, int count, T pad = 0) {
        if (count == lanes) return vec::load(p);
        value v = value() + pad;
        for (int lane = 0; lane < count; ++lane) v[lane] = p[lane];
        return v;
    }
    static MMD_INLINE void store(T *p, int count, value v) {
        if (count == lanes) return vec::store(p, v);
        for (int lane = 0; lane < count; ++lane) p[lane] = v[lane];
    }

    /* e^y for y <= 0: exponential, and the C library's exp for lanes below
     * -kSafe (where e^y nears the subnormals) or NaN, which stays NaN. */
    static MMD_INLINE value exp_nonpositive(value y) {
        value e = exponential(y);
        const mask outside = ~((y >= -C::kSafe) & (y <= (T)0));
        if (any(outside))
            for (int lane = 0; lane < lanes; ++lane)
                if (outside[lane]) e[lane] = exp(y[lane]);
        return e;
    }

    /* exponential(y) for y <= 0 (or NaN), with the lanes where that does
     * not hold (y below -kSafe, or NaN) added to `outside`: a loop that
     * takes exp_nonpositive of those instead tests them once, after its
     * last vector, not after each. */
    static MMD_INLINE value exp_nonpositive_inside(value y, mask &outside) {
        outside |= ~(y >= -C::kSafe);
        return exponential(y);
    }

    /* v^e, lane by lane (the C library's pow). */
    static MMD_INLINE value power(value v, T e) {
        for (int lane = 0; lane < lanes; ++lane) v[lane] = pow(v[lane], e);
        return v;
    }
};

/* For elements [begin, end) of arrays of T whose x decides which math
 * holds: element(i, count, x_vector) for the runs of M::lanes elements
 * from i (count of them valid: fewer in a run that the arrays end within,
 * whose vectors M::load pads with zeros), then scalar(i) for each element
 * whose x lies outside the vector math's domain (which overwrites what
 * element stored there). */
template <typename M, typename Element, typename Scalar>
MMD_INLINE void mmd_vec_elements(int64_t begin, int64_t end, const typename M::scalar *x,
                                 const Element &element, const Scalar &scalar) {
    for (int64_t i = begin; i < end; i += M::lanes) {
        const int count = M::count(end - i);
        const typename M::value xv = M::load(x + i, count);
        element(i, count, xv);
        const typename M::mask outside = ~(M::magnitude(xv) <= M::C::kSafe);
        if (M::any(outside))
            for (int lane = 0; lane < count; ++lane)
                if (outside[lane]) scalar(i + lane);
    }
}

}  // namespace

#endif
