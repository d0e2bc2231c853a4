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

/* Wildcard for one dimension in mmd_check_shape. */
#define MMD_ANY_DIM (-1)

/* ndim must equal `ndim`; each expected[i] >= 0 must match exactly. */
int mmd_check_shape(const mmd_tensor *t, const char *name, int ndim, const int64_t *expected);
/* dtype must be one of the bits in `allowed_mask`. */
int mmd_check_dtype(const mmd_tensor *t, const char *name, unsigned allowed_mask);
/* dtype must equal the reference tensor's dtype. */
int mmd_check_same_dtype(const mmd_tensor *t, const char *name, const mmd_tensor *ref,
                         const char *ref_name);
/* Kernels index densely; strided views are rejected rather than misread. */
int mmd_check_contiguous(const mmd_tensor *t, const char *name);
/* Writes "(2, 3, 4)" into buf. */
void mmd_format_shape(const mmd_tensor *t, char *buf, size_t size);

#ifdef __cplusplus
}
#endif
#endif
