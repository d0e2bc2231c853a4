/* Argument checks shared by every op's kernels (host code, C and CUDA).
 * Each returns MMD_OK or an error status with a message naming the
 * parameter; the dispatcher prefixes the op name. */
#ifndef MMDISPATCH_CHECKS_H
#define MMDISPATCH_CHECKS_H

#include "mmdispatch/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MMD_DTYPE_BIT(d) (1u << (d))
#define MMD_FLOAT32_64 (MMD_DTYPE_BIT(MMD_FLOAT32) | MMD_DTYPE_BIT(MMD_FLOAT64))
#define MMD_FLOAT16_32_64 (MMD_FLOAT32_64 | MMD_DTYPE_BIT(MMD_FLOAT16))
/* CUDA's 16-bit float kernels take bfloat16 as well (computed in float32) */
#define MMD_FLOAT16_BF16_32_64 (MMD_FLOAT16_32_64 | MMD_DTYPE_BIT(MMD_BFLOAT16))

/* Wildcard for one dimension in mmd_check_shape. */
#define MMD_ANY_DIM (-1)

/* The checks run on every call, so their passing test is inline; the
 * message of a failing one is built out of line (mmd_*_error). */
int mmd_shape_error(const mmd_tensor *t, const char *name, int ndim, const int64_t *expected);
int mmd_dtype_error(const mmd_tensor *t, const char *name, unsigned allowed_mask);
int mmd_same_dtype_error(const mmd_tensor *t, const char *name, const mmd_tensor *ref,
                         const char *ref_name);
int mmd_contiguous_error(const mmd_tensor *t, const char *name);

/* ndim must equal `ndim`; each expected[i] >= 0 must match exactly. */
static inline int mmd_check_shape(const mmd_tensor *t, const char *name, int ndim,
                                  const int64_t *expected) {
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; ++i)
        ok = expected[i] == MMD_ANY_DIM || expected[i] == t->shape[i];
    return ok ? MMD_OK : mmd_shape_error(t, name, ndim, expected);
}

/* dtype must be one of the bits in `allowed_mask`. */
static inline int mmd_check_dtype(const mmd_tensor *t, const char *name, unsigned allowed_mask) {
    const int ok = t->dtype > 0 && t->dtype < MMD_NUM_DTYPES &&
                   (allowed_mask & MMD_DTYPE_BIT(t->dtype));
    return ok ? MMD_OK : mmd_dtype_error(t, name, allowed_mask);
}

/* dtype must equal the reference tensor's dtype. */
static inline int mmd_check_same_dtype(const mmd_tensor *t, const char *name,
                                       const mmd_tensor *ref, const char *ref_name) {
    return t->dtype == ref->dtype ? MMD_OK : mmd_same_dtype_error(t, name, ref, ref_name);
}

/* Kernels index densely; strided views are rejected rather than misread. */
static inline int mmd_check_contiguous(const mmd_tensor *t, const char *name) {
    return mmd_is_contiguous(t) ? MMD_OK : mmd_contiguous_error(t, name);
}

/* Exactly `shape`, the dtype of `ref` and densely laid out: an array that
 * goes with another, such as an output with its input. */
static inline int mmd_check_like(const mmd_tensor *t, const char *name, int ndim,
                                 const int64_t *shape, const mmd_tensor *ref,
                                 const char *ref_name) {
    int s = mmd_check_shape(t, name, ndim, shape);
    if (!s) s = mmd_check_same_dtype(t, name, ref, ref_name);
    if (!s) s = mmd_check_contiguous(t, name);
    return s;
}

/* Writes "(2, 3, 4)" into buf. */
void mmd_format_shape(const mmd_tensor *t, char *buf, size_t size);

#ifdef __cplusplus
}
#endif
#endif
