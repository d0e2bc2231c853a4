# C declarations of the dispatcher core (include/mmdispatch/*.h) and the
# per-call state shared by _core.pyx and the generated entry points.
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t

cdef extern from "mmdispatch/tensor.h" nogil:
    enum:
        MMD_MAX_NDIM
        MMD_MAX_DEVICE_TYPES
        MMD_DEVICE_CPU
        MMD_DEVICE_CUDA
        MMD_OK
        MMD_ERR_VALUE
        MMD_ERR_TYPE
        MMD_ERR_RUNTIME
        MMD_ERR_MEMORY
        MMD_ERR_DEFERRED
        MMD_CONTEXT_STRICT
        MMD_CONTEXT_TF32
    ctypedef enum mmd_dtype:
        MMD_DTYPE_UNKNOWN
        MMD_BOOL
        MMD_INT8
        MMD_INT16
        MMD_INT32
        MMD_INT64
        MMD_UINT8
        MMD_UINT16
        MMD_UINT32
        MMD_UINT64
        MMD_FLOAT16
        MMD_BFLOAT16
        MMD_FLOAT32
        MMD_FLOAT64
        MMD_NUM_DTYPES
    ctypedef struct mmd_tensor:
        void *data
        int64_t shape[MMD_MAX_NDIM]
        int64_t strides[MMD_MAX_NDIM]
        int32_t ndim
        int32_t dtype
        int32_t device_type
        int32_t device_id
        int32_t writable
    ctypedef struct mmd_context:
        void *stream
        int32_t device_id
        uint32_t flags
        const char *op
        void *fallback
    const char *mmd_last_error()
    const char *mmd_dtype_name(int dtype)
    size_t mmd_dtype_size(int dtype)
    int64_t mmd_numel(const mmd_tensor *t)
    bint mmd_is_contiguous(const mmd_tensor *t)

cdef extern from "mmdispatch/registry.h" nogil:
    enum:
        MMD_MAX_BACKENDS
        MMD_TABLE_SIZE
    unsigned char *mmd_thread_backends()
    enum:
        MMD_STRICT_UNSET
        MMD_STRICT_OFF
        MMD_STRICT_ON
    unsigned char *mmd_thread_strict()
    unsigned char *mmd_thread_tf32()
    int *mmd_thread_hook_guard()

cdef extern from "mmdispatch/boxed.h" nogil:
    ctypedef struct mmd_boxed_call:
        pass
    ctypedef int (*mmd_boxed_fn)(const mmd_boxed_call *call) noexcept nogil

cdef extern from "mmdispatch_generated.h" nogil:
    ctypedef struct mmd_device_module:
        const char *name
        int device_type
        int (*register_fn)(char *status, size_t size, int *device_count) noexcept nogil
        int (*synchronize_fn)(int device_id) noexcept nogil
        int (*empty_cache_fn)(int device_id) noexcept nogil
    const mmd_device_module *mmd_get_device_modules(int *count)

# DLPack ABI (dlpack.h: DLManagedTensor, and DLManagedTensorVersioned of
# DLPack 1.x with its flags), read from capsules.
cdef struct DLDevice:
    int32_t device_type
    int32_t device_id

cdef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

cdef struct DLTensor:
    void *data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t *shape
    int64_t *strides
    uint64_t byte_offset

cdef struct DLManagedTensor:
    DLTensor dl_tensor
    void *manager_ctx
    void (*deleter)(DLManagedTensor *)

cdef struct DLPackVersion:
    uint32_t major
    uint32_t minor

cdef struct DLManagedTensorVersioned:
    DLPackVersion version
    void *manager_ctx
    void (*deleter)(DLManagedTensorVersioned *)
    uint64_t flags
    DLTensor dl_tensor

# DLPack's C exchange API (a library's `__dlpack_c_exchange_api__` capsule,
# "dlpack_exchange_api"; the layout of DLPack 1.2 and 1.3): the two
# functions read here, called with the GIL held; each returns 0, or -1
# with a Python error set (the stream's error then propagates as it is).
cdef struct DLPackExchangeAPIHeader:
    DLPackVersion version
    DLPackExchangeAPIHeader *prev_api

cdef struct DLPackExchangeAPI:
    DLPackExchangeAPIHeader header
    void *managed_tensor_allocator
    void *managed_tensor_from_py_object_no_sync
    void *managed_tensor_to_py_object_no_sync
    # a view (non-owning: valid while the object lives) filled in place
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out) noexcept
    int (*current_work_stream)(int device_type, int32_t device_id, void **out) except -1

cdef enum:
    DLPACK_FLAG_READ_ONLY = 1    # DLPACK_FLAG_BITMASK_READ_ONLY
    DLPACK_FLAG_IS_COPIED = 2    # DLPACK_FLAG_BITMASK_IS_COPIED

# The array-argument flags and limit, written into the generated header by
# _codegen.py (their one source).
cdef extern from "mmdispatch_generated.h":
    enum:
        MAX_ARRAY_ARGS "MMD_MAX_ARRAY_ARGS"
        ARG_OUTPUT "MMD_ARG_OUTPUT"
        ARG_OPTIONAL "MMD_ARG_OPTIONAL"
        ARG_ACCUMULATE "MMD_ARG_ACCUMULATE"   # with ARG_OUTPUT: Tensor+

cdef enum ArrayKind:
    KIND_NONE = 0   # optional argument given as None
    KIND_NUMPY
    KIND_CUPY
    KIND_DLPACK
    KIND_CAI        # __cuda_array_interface__
    KIND_TORCH      # a torch tensor on the CPU or a CUDA device, viewed directly

# Everything one dispatch needs, on the caller's C stack.
cdef struct CallState:
    PyObject *objects[MAX_ARRAY_ARGS]        # borrowed: the caller's arguments
    int kinds[MAX_ARRAY_ARGS]
    mmd_tensor tensors[MAX_ARRAY_ARGS]
    const mmd_tensor *args[MAX_ARRAY_ARGS]   # NULL for an absent optional
    uintptr_t lo[MAX_ARRAY_ARGS]             # [lo, hi): the bytes each view covers
    uintptr_t hi[MAX_ARRAY_ARGS]
    void *kernel
    bint python_kernel
    bint boxed       # the Python kernel is a fallback's (_BoxedKernel): nothing is allocated
    bint c_fallback  # the kernel is the op's boxing function, for its device's C fallback
    # bit i: output i is a torch tensor whose autograd version counter the
    # kernel's success moves on (_torch_outputs_written); set 0 first
    unsigned int torch_written
    mmd_context ctx

cdef class OpRegistry:
    cdef readonly str name
    cdef bytes name_bytes        # keeps c_name alive
    cdef const char *c_name      # mmd_context.op
    cdef readonly str signature
    cdef readonly tuple param_names
    cdef readonly tuple array_names
    cdef void **c_table
    cdef const char **c_origin
    cdef void *boxed_kernel      # mmd_<op>_boxed: the kernel a C fallback serves through
    cdef list python_kernels     # slot -> active Python kernel or None
    # slot -> C kernel registered at run time (a capsule), active when not NULL
    cdef void *runtime_c_kernels[MMD_TABLE_SIZE]
    cdef dict runtime_stacks     # slot -> [KernelHandle], newest last
    cdef int n_arrays
    cdef int array_positions[MAX_ARRAY_ARGS]
    cdef int array_flags[MAX_ARRAY_ARGS]
    cdef unsigned int output_mask  # bit i: array i is an output

    cdef str where(self, int array_index)
    cdef int classify(self, int i, object obj, CallState *st) except -1
    cdef object prepare(self, CallState *st, unsigned int missing=*)
    cdef object prepare_allocating(self, CallState *st, unsigned int missing, list held)
    cdef int view_new(self, CallState *st, int i, object array) except -1
    cdef object allocate(self, CallState *st, int k, int nd, Py_ssize_t *dims, int dtype,
                         bint zeros)
    cdef object view_pending(self, CallState *st, unsigned int pending, int device_type,
                             int device_id)
    cdef int view_for_python(self, CallState *st, unsigned int pending) except -1
    cdef object view(self, CallState *st, int i, object dlpack_stream)
    cdef int check_outputs(self, CallState *st) except -1
    cdef int check_data(self, CallState *st) except -1
    cdef void activate(self, int slot)
    cdef object no_such_device(self, int ref, int device_type, int device_id)
    cdef object not_found(self, int device_type, int device_id, int backend)
    cdef int raise_kernel_error(self, int status) except -1

# Inline numpy / int helpers (mmdispatch/_pyarray.h).
cdef extern from "_pyarray.h":
    bint mmd_is_exact_ndarray(PyObject *obj) noexcept nogil
    bint mmd_is_plain_numpy(PyObject *obj) noexcept nogil
    bint mmd_compact_int(object v, int64_t *out) noexcept
