/* Boxed C fallbacks: mmdispatch.register_fallback(device, capsule) with a
 * PyCapsule named MMD_BOXED_FALLBACK_CAPSULE holding an mmd_boxed_fn. For
 * every op whose slot on that device type is empty, the dispatcher views
 * the arrays (any device: DLPack or __cuda_array_interface__, no copies),
 * checks them as for a kernel, allocates the outputs the caller left as
 * None where it can (numpy, CuPy, torch), and calls, without the GIL,
 *     status = fn(&call)
 * with the op's arguments boxed in signature order. The fallback returns 0,
 * or a status (MMD_ERR_VALUE: ValueError, MMD_ERR_TYPE: TypeError,
 * MMD_ERR_MEMORY: MemoryError, else RuntimeError) after call->error(call, status,
 * message) has said why. Each op's boxing function is generated from its
 * signature (mmd_<op>_boxed in mmdispatch_generated.h). The capsule holds
 * the function's address only: the function must stay valid while it is
 * registered and while calls through it run (a ctypes or cffi callback:
 * keep a reference to it). */
#ifndef MMDISPATCH_BOXED_H
#define MMDISPATCH_BOXED_H

#include "mmdispatch/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MMD_BOXED_FALLBACK_CAPSULE "mmdispatch.boxed_fallback"

typedef enum {
    MMD_BOXED_ARRAY = 0,   /* `array`; NULL for an optional array given as None */
    MMD_BOXED_INT = 1,     /* `int_value` */
    MMD_BOXED_FLOAT = 2,   /* `float_value` */
    MMD_BOXED_BOOL = 3     /* `int_value`, 0 or 1 */
} mmd_boxed_kind;

typedef struct {
    const char *name;           /* the parameter's name in the signature */
    int32_t kind;               /* mmd_boxed_kind */
    int32_t flags;              /* arrays: MMD_ARG_OUTPUT / _OPTIONAL / _ACCUMULATE */
    const mmd_tensor *array;
    int64_t int_value;
    double float_value;
} mmd_boxed_arg;

typedef struct mmd_boxed_call {
    const char *op;             /* the entry point, e.g. "roi_align_forward_impl" */
    int32_t device_type;        /* DLPack code of the arrays' device */
    int32_t device_id;
    int32_t num_args;
    const mmd_boxed_arg *args;  /* every parameter, in signature order */
    const mmd_context *ctx;     /* stream (CUDA), strict mode flag */
    /* Sets the message of the error status the fallback returns (this
     * call's own, from any thread); returns `status`. */
    int (*error)(const struct mmd_boxed_call *call, int status, const char *message);
    void *state;                /* the dispatcher's, for `error` */
} mmd_boxed_call;

typedef int (*mmd_boxed_fn)(const mmd_boxed_call *call);

/* Calls the C fallback the dispatcher chose for this call (ctx->fallback)
 * with the boxed arguments (the generated mmd_<op>_boxed functions end
 * here). */
int mmd_boxed_dispatch(const char *op, int num_args, const mmd_boxed_arg *args,
                       const mmd_context *ctx);

#ifdef __cplusplus
}
#endif
#endif
