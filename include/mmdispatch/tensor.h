/* Tensor views, dtypes, devices and status codes shared by the dispatcher and
 * every kernel (C and CUDA). A view never owns memory: the Python caller keeps
 * the array alive for the duration of the call. */
#ifndef MMDISPATCH_TENSOR_H
#define MMDISPATCH_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __CUDACC__
#define MMD_HOSTDEV __host__ __device__
#else
#define MMD_HOSTDEV
#endif

#define MMD_MAX_NDIM 8

/* DLPack device type codes (dlpack.h DLDeviceType); the registry is indexed
 * by them directly. */
enum {
    MMD_DEVICE_CPU = 1,
    MMD_DEVICE_CUDA = 2,
    MMD_DEVICE_CUDA_HOST = 3,
    MMD_DEVICE_OPENCL = 4,
    MMD_DEVICE_VULKAN = 7,
    MMD_DEVICE_METAL = 8,
    MMD_DEVICE_VPI = 9,
    MMD_DEVICE_ROCM = 10,
    MMD_DEVICE_ROCM_HOST = 11,
    MMD_DEVICE_EXT_DEV = 12,
    MMD_DEVICE_CUDA_MANAGED = 13,
    MMD_DEVICE_ONEAPI = 14,
    MMD_DEVICE_WEBGPU = 15,
    MMD_DEVICE_HEXAGON = 16,
    MMD_DEVICE_MAIA = 17,
    MMD_MAX_DEVICE_TYPES = 32
};

typedef enum {
    MMD_DTYPE_UNKNOWN = 0,
    MMD_BOOL,
    MMD_INT8,
    MMD_INT16,
    MMD_INT32,
    MMD_INT64,
    MMD_UINT8,
    MMD_UINT16,
    MMD_UINT32,
    MMD_UINT64,
    MMD_FLOAT16,
    MMD_BFLOAT16,
    MMD_FLOAT32,
    MMD_FLOAT64,
    MMD_NUM_DTYPES
} mmd_dtype;

typedef struct {
    void *data;                      /* first element (byte offsets applied) */
    int64_t shape[MMD_MAX_NDIM];
    int64_t strides[MMD_MAX_NDIM];   /* in elements, not bytes */
    int32_t ndim;
    int32_t dtype;                   /* mmd_dtype */
    int32_t device_type;             /* DLPack code */
    int32_t device_id;
    int32_t writable;
} mmd_tensor;

/* Per-call execution context filled by the dispatcher. */
typedef struct {
    void *stream;      /* cudaStream_t for CUDA, NULL elsewhere */
    int32_t device_id;
    uint32_t flags;    /* MMD_CONTEXT_* */
    const char *op;    /* the entry point called, e.g. "roi_align_forward_impl" */
    void *fallback;    /* a boxed call's C fallback (mmdispatch/boxed.h), else NULL */
} mmd_context;

/* ctx->flags: strict mode (mmdispatch.strict()): a kernel that would check
 * its data asynchronously checks it before writing anything and waits for
 * the device, so every error is raised by the call that caused it. */
#define MMD_CONTEXT_STRICT 1u
/* ctx->flags: the call's float32 matrix products may run in TF32 where the
 * device has it (mmdispatch.set_float32_matmul_precision("high"), or
 * torch's float32 matmul precision for mmdispatch.torch's calls): on CUDA,
 * deform_conv2d's cuBLAS products, as torchvision's follow torch's setting.
 * Other products are IEEE float32 whatever it says. */
#define MMD_CONTEXT_TF32 2u

/* Kernel status codes; the dispatcher turns them into Python exceptions in
 * one place (OpRegistry.raise_kernel_error in _core.pyx). */
enum {
    MMD_OK = 0,
    MMD_ERR_VALUE = 1,    /* ValueError */
    MMD_ERR_TYPE = 2,     /* TypeError */
    MMD_ERR_RUNTIME = 3,  /* RuntimeError, e.g. a CUDA launch failure */
    MMD_ERR_MEMORY = 4,   /* MemoryError */
    MMD_ERR_DEFERRED = 5  /* mmdispatch.DeferredKernelError (a ValueError) found by an earlier
                             call's kernel; the message names that call's op itself */
};

/* Records a message for the calling thread and returns `status`, so kernels
 * write `return mmd_error(MMD_ERR_VALUE, "...", ...);`. */
int mmd_error(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
const char *mmd_last_error(void);

const char *mmd_dtype_name(int dtype);
size_t mmd_dtype_size(int dtype);

static inline int64_t mmd_numel(const mmd_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
    return n;
}

/* True when elements are laid out densely in C order (size-1 dims and
 * empty arrays, whose strides numpy may set to 0, are ignored). */
static inline int mmd_is_contiguous(const mmd_tensor *t) {
    int64_t expected = 1;   /* ends as the element count */
    int dense = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
        dense &= t->shape[i] == 1 || t->strides[i] == expected;
        expected *= t->shape[i];
    }
    return dense || expected == 0;
}

#ifdef __cplusplus
}
#endif
#endif
