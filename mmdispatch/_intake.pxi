# Array intake: views of numpy, CuPy, torch, DLPack and
# __cuda_array_interface__ arrays as mmd_tensor, without copies. Cheapest
# first: the numpy C struct (a few field reads), CuPy's and torch's
# attributes (a few attribute lookups each; torch's own __dlpack__ and
# __dlpack_device__ cost far more, microseconds), __dlpack_device__ /
# __dlpack__, then __cuda_array_interface__ (a dict to parse). Neither CuPy
# nor torch is imported here: their types are looked up only once the user
# has imported them.

cdef object _cupy_ndarray_type = None
# cupy.cuda.get_current_stream(device_id), looked up with the ndarray type
cdef object _cupy_current_stream = None
# callable(pointer) -> CUDA device index, installed by mmdispatch._cuda
cdef object _cai_device_resolver = None

# DLPack's __dlpack__(stream=...) value for CUDA's legacy default stream.
cdef int _DLPACK_LEGACY_DEFAULT_STREAM = 1


def _set_cai_device_resolver(resolver):
    global _cai_device_resolver
    _cai_device_resolver = resolver


cdef inline bint _is_cupy_array(object obj):
    """Whether obj is a CuPy array. CuPy is not imported for this: an array
    of CuPy's exists only once CuPy is."""
    global _cupy_ndarray_type, _cupy_current_stream
    if _cupy_ndarray_type is None:
        cupy = sys.modules.get("cupy")
        if cupy is None:
            return False
        _cupy_current_stream = cupy.cuda.get_current_stream
        _cupy_ndarray_type = cupy.ndarray
    return type(obj) is _cupy_ndarray_type


# torch.Tensor and torch.nn.Parameter (the exact types: subclasses such as
# FakeTensor take the DLPack path), looked up once torch is imported.
cdef object _torch_tensor_type = None
cdef object _torch_parameter_type = None
# torch dtype -> mmd dtype code, and back
cdef dict _torch_dtype_codes = None
cdef dict _torch_dtypes = None
# torch._C._cuda_getCurrentRawStream(device_index) -> stream pointer
cdef object _torch_current_stream = None
# torch.is_grad_enabled, and torch._C._increment_version (autograd's version
# counter of each tensor of a list; about 130 ns a call, where the same
# function given one tensor took 2.6 us: torch 2.14 on the 2-core machine)
cdef object _torch_grad_enabled = None
cdef object _torch_increment_version = None
# torch's DLPack C exchange API (torch 2.10 and later), NULL without it: a
# tensor's device, dtype, shape, strides and data in one C call, where its
# accessors take five Python calls (about 0.4 us per tensor), and the
# current CUDA stream without a Python call
cdef DLPackExchangeAPI *_torch_dlpack_api = NULL
cdef DLPackExchangeAPI *_torch_dlpack_api_found = NULL


def _use_torch_dlpack_api(bint on):
    """Whether torch tensors are viewed through torch's DLPack C exchange
    API where torch has one (the default), or through their accessors
    only (as with an older torch): for tests of both paths. Returns whether
    the API is in use."""
    global _torch_dlpack_api
    if _torch_tensor_type is None:
        _find_torch()
    _torch_dlpack_api = _torch_dlpack_api_found if on else NULL
    return _torch_dlpack_api != NULL


cdef DLPackExchangeAPI *_exchange_api(object array_type) noexcept:
    """The DLPack C exchange API a type offers (its
    __dlpack_c_exchange_api__ capsule, DLPack 1.x, with the view and stream
    functions), or NULL."""
    cdef DLPackExchangeAPI *api
    try:
        capsule = getattr(array_type, "__dlpack_c_exchange_api__", None)
        if capsule is None or not PyCapsule_IsValid(capsule, b"dlpack_exchange_api"):
            return NULL
        api = <DLPackExchangeAPI *>PyCapsule_GetPointer(capsule, b"dlpack_exchange_api")
    except Exception:
        return NULL
    if (api == NULL or api.header.version.major != 1 or api.dltensor_from_py_object_no_sync == NULL
            or api.current_work_stream == NULL):
        return NULL
    return api


cdef bint _find_torch() except -1:
    """Caches torch's tensor types, dtypes and stream lookup once torch is
    fully imported; False until then."""
    global _torch_tensor_type, _torch_parameter_type, _torch_dtype_codes, _torch_dtypes
    global _torch_current_stream, _torch_dlpack_api, _torch_dlpack_api_found
    global _torch_grad_enabled, _torch_increment_version
    torch = sys.modules.get("torch")
    tensor_type = getattr(torch, "Tensor", None)
    parameter_type = getattr(getattr(torch, "nn", None), "Parameter", None)
    if tensor_type is None or parameter_type is None:
        return False   # not imported, or still importing
    codes = {}
    for name, code in [("bool", MMD_BOOL), ("int8", MMD_INT8), ("int16", MMD_INT16),
                       ("int32", MMD_INT32), ("int64", MMD_INT64), ("uint8", MMD_UINT8),
                       ("uint16", MMD_UINT16), ("uint32", MMD_UINT32), ("uint64", MMD_UINT64),
                       ("float16", MMD_FLOAT16), ("bfloat16", MMD_BFLOAT16),
                       ("float32", MMD_FLOAT32), ("float64", MMD_FLOAT64)]:
        if hasattr(torch, name):
            codes[getattr(torch, name)] = code
    _torch_dtype_codes = codes
    _torch_dtypes = {code: dtype for dtype, code in codes.items()}
    _torch_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    _torch_grad_enabled = torch.is_grad_enabled
    _torch_increment_version = getattr(torch._C, "_increment_version", None)
    _torch_dlpack_api = _torch_dlpack_api_found = _exchange_api(tensor_type)
    _torch_parameter_type = parameter_type
    _torch_tensor_type = tensor_type
    return True


cdef inline bint _is_torch_tensor(object obj) except -1:
    if _torch_tensor_type is None and not _find_torch():
        return False
    return type(obj) is _torch_tensor_type or type(obj) is _torch_parameter_type


cdef bint _torch_device(object tensor, mmd_tensor *t) except -1:
    """t's device for a torch tensor on the CPU or a CUDA device; False for
    any other device (MPS, XPU, ...), which the DLPack path takes. A meta
    tensor says CPU here and is refused at intake (it has no data)."""
    cdef int index = tensor.get_device()
    if index < 0:
        t.device_type = MMD_DEVICE_CPU
        t.device_id = 0
        return True
    if tensor.is_cuda:
        t.device_type = MMD_DEVICE_CUDA
        t.device_id = index
        return True
    return False


cdef bint _torch_view(object tensor, mmd_tensor *t) noexcept:
    """Views a torch tensor on the CPU or a CUDA device in one call of
    torch's DLPack C exchange API (a view valid while the tensor lives).
    False where torch has no such API or it declines (a meta or sparse
    tensor, a dtype or rank we do not take, another device, no data,
    misaligned data, a negated view): the accessors (_torch_device,
    _intake_torch) then take the tensor, and their errors are the op's."""
    cdef DLTensor dl
    if _torch_dlpack_api == NULL:
        return False
    if _torch_dlpack_api.dltensor_from_py_object_no_sync(<void *>tensor, &dl) != 0:
        PyErr_Clear()
        return False
    if tensor.is_neg():   # the view's data is the negation of its values
        return False
    if dl.device.device_type == MMD_DEVICE_CPU:
        t.device_id = 0
    elif dl.device.device_type == MMD_DEVICE_CUDA:
        t.device_id = dl.device.device_id
    else:
        return False
    t.device_type = dl.device.device_type
    if _read_dltensor(&dl, t) != 0:
        return False
    if t.data == NULL and mmd_numel(t) != 0:
        return False
    if (<uintptr_t>t.data) % mmd_dtype_size(t.dtype):
        return False
    t.writable = 1
    return True


cdef int _torch_outputs_checked(OpRegistry op, CallState *st) except -1:
    """The torch tensors among the outputs of a C kernel (a subclass's,
    taken through DLPack, too) are written in place, as torch's in-place
    ops write, so autograd is told: a tensor that requires grad (in grad
    mode) is refused, as torch refuses an in-place write to a leaf that
    requires one (and a non-leaf's history would not describe what the
    kernel writes); every other is marked in st.torch_written, whose
    version counters _torch_outputs_written moves on once the kernel has
    succeeded, so that a backward through a graph that saved one raises
    torch's 'modified by an inplace operation' error rather than computing
    with the new values. An empty output (the torch layer's shared (0,)
    ones) is not written. A Python kernel writes as it writes: not here."""
    cdef int i, kind
    cdef int grad = -1   # grad mode, asked once
    st.torch_written = 0
    for i in range(op.n_arrays):
        kind = st.kinds[i]
        if (not (op.output_mask >> i & 1u) or (kind != KIND_TORCH and kind != KIND_DLPACK)
                or mmd_numel(&st.tensors[i]) == 0):
            continue
        tensor = <object>st.objects[i]
        if kind == KIND_DLPACK and not isinstance(tensor, _torch_tensor_type):
            continue
        if grad < 0:
            grad = _torch_grad_enabled()
        if grad and tensor.requires_grad:
            raise ValueError(f"{op.where(i)}, output tensor requires grad: autograd would not "
                             "see the kernel's write; pass a tensor that does not (detach "
                             "it), or call the op through mmdispatch.torch, which records it")
        st.torch_written |= 1u << i
    return 0


cdef int _torch_outputs_written(OpRegistry op, CallState *st) except -1:
    """Moves on the autograd version counters of the outputs marked in
    st.torch_written, after the kernel succeeded: one call of
    torch._C._increment_version with a list (about 130 ns; torch before 2.5
    takes one tensor a call, and an inference tensor has no counter)."""
    cdef int i
    written = [<object>st.objects[i] for i in range(op.n_arrays) if st.torch_written >> i & 1u]
    if _torch_increment_version is None:
        return 0
    try:
        _torch_increment_version(written)
    except (RuntimeError, TypeError):   # an older torch, or an inference tensor
        for tensor in written:
            if not tensor.is_inference():
                _torch_increment_version(tensor)
    return 0


@cython.boundscheck(False)
@cython.wraparound(False)
cdef int _intake_torch(OpRegistry op, int i, object tensor, mmd_tensor *t) except -1:
    """A torch tensor, viewed through its own accessors (no DLPack export):
    dtype, shape, strides (torch's count elements) and data pointer."""
    cdef int d, nd
    cdef int64_t numel = 1
    code = _torch_dtype_codes.get(tensor.dtype)
    if code is None:
        raise TypeError(f"{op.where(i)}, unsupported dtype {tensor.dtype}")
    try:   # sparse and other layouts have no strides or data pointer
        shape = tensor.shape
        strides = tensor.stride()
        pointer = tensor.data_ptr()
    except Exception as exc:
        raise TypeError(f"{op.where(i)}, cannot view a torch tensor of layout "
                        f"{tensor.layout}: {exc}") from exc
    nd = len(shape)
    if nd > MMD_MAX_NDIM:
        raise ValueError(f"{op.where(i)}, {nd} dimensions; at most {MMD_MAX_NDIM} are supported")
    t.dtype = code
    t.ndim = nd
    for d in range(nd):
        t.shape[d] = <int64_t>(<tuple>shape)[d]
        t.strides[d] = <int64_t>(<tuple>strides)[d]
        numel *= t.shape[d]
    if pointer == 0 and numel != 0:
        raise TypeError(f"{op.where(i)}, the torch tensor has no data (a meta or fake tensor, "
                        f"device {tensor.device})")
    if tensor.is_neg():   # its memory holds the negation of its values
        raise TypeError(f"{op.where(i)}, the torch tensor is a negated view (its negative bit "
                        "is set, as for x.conj().imag): pass x.resolve_neg()")
    t.data = <void *><uintptr_t>pointer
    t.writable = 1
    return _check_alignment(op, i, t)


cdef object _cuda_launch_stream(CallState *st, int n, int device_id):
    """Sets st.ctx.stream for a launch on CUDA device `device_id` and returns
    the stream to ask DLPack producers for: the current stream on that device
    of the library of the first CuPy or torch array among the arguments
    (where that library launches its own work), else the legacy default
    stream, on which a DLPack producer (JAX, ...) makes its data ready before
    handing it over. One C-level call into CuPy or torch, no Python frame."""
    cdef int i
    cdef uintptr_t ptr
    for i in range(n):
        if st.kinds[i] == KIND_CUPY:
            ptr = _cupy_current_stream(device_id).ptr
        elif st.kinds[i] == KIND_TORCH and _torch_dlpack_api != NULL:
            _torch_dlpack_api.current_work_stream(MMD_DEVICE_CUDA, device_id, <void **>&ptr)
        elif st.kinds[i] == KIND_TORCH and _torch_current_stream is not None:
            ptr = _torch_current_stream(device_id)
        else:
            continue
        st.ctx.stream = <void *>ptr
        return ptr if ptr else _DLPACK_LEGACY_DEFAULT_STREAM
    st.ctx.stream = NULL
    return _DLPACK_LEGACY_DEFAULT_STREAM


cdef extern from *:
    """
    static inline int mmd_dtype_code(char kind, Py_ssize_t itemsize) {
        switch (kind) {
        case 'f':
            return itemsize == 4 ? MMD_FLOAT32 : itemsize == 8 ? MMD_FLOAT64
                 : itemsize == 2 ? MMD_FLOAT16 : MMD_DTYPE_UNKNOWN;
        case 'i':
            return itemsize == 8 ? MMD_INT64 : itemsize == 4 ? MMD_INT32
                 : itemsize == 2 ? MMD_INT16 : itemsize == 1 ? MMD_INT8 : MMD_DTYPE_UNKNOWN;
        case 'u':
            return itemsize == 8 ? MMD_UINT64 : itemsize == 4 ? MMD_UINT32
                 : itemsize == 2 ? MMD_UINT16 : itemsize == 1 ? MMD_UINT8 : MMD_DTYPE_UNKNOWN;
        case 'b':
            return itemsize == 1 ? MMD_BOOL : MMD_DTYPE_UNKNOWN;
        }
        return MMD_DTYPE_UNKNOWN;
    }

    /* mmd_dtype_code and item size of each built-in numpy type number (native
       byte order; byte-swapped arrays are turned away separately), filled at
       import by mmd_init_dtype_table: one load instead of a switch and numpy's
       version-dependent descr accessor per array. */
    #define MMD_NPY_TYPES (NPY_HALF + 1)   /* the built-in types: NPY_BOOL .. NPY_HALF */
    typedef struct { unsigned char dtype, itemsize; } mmd_numpy_type;
    static mmd_numpy_type mmd_type_by_typenum[MMD_NPY_TYPES];

    static int mmd_init_dtype_table(void) {
        for (int t = 0; t < MMD_NPY_TYPES; ++t) {
            PyArray_Descr *d = PyArray_DescrFromType(t);
            if (!d) return -1;
            const int dtype = mmd_dtype_code(d->kind, PyDataType_ELSIZE(d));
            mmd_type_by_typenum[t].dtype = (unsigned char)dtype;
            /* only read for known dtypes, whose items are 1 to 8 bytes */
            mmd_type_by_typenum[t].itemsize =
                dtype == MMD_DTYPE_UNKNOWN ? 0 : (unsigned char)PyDataType_ELSIZE(d);
            Py_DECREF(d);
        }
        return 0;
    }

    /* The dispatch fast path: views an exact numpy array that is C-contiguous,
       aligned, native-endian and of a supported dtype, with no division, and
       sets [lo, hi) to the bytes it covers. numpy may give size-1 axes any
       stride; they are never stepped along, so the strides set here serve.
       Returns 0 for every other array: _intake_numpy then takes it (strided
       arrays) or raises the error. */
    static inline int mmd_view_contiguous_numpy(PyObject *obj, mmd_tensor *t, uintptr_t *lo,
                                                uintptr_t *hi) {
        PyArrayObject *arr = (PyArrayObject *)obj;
        const int nd = PyArray_NDIM(arr);
        if (!mmd_is_plain_numpy(obj)) return 0;
        const int type_num = PyArray_DESCR(arr)->type_num;
        if ((unsigned)type_num >= MMD_NPY_TYPES) return 0;
        const mmd_numpy_type type = mmd_type_by_typenum[type_num];
        const int dtype = type.dtype;
        if (dtype == MMD_DTYPE_UNKNOWN) return 0;
        const npy_intp *restrict dims = PyArray_DIMS(arr);
        int64_t numel = 1;
        /* innermost axis first; unrolled (a case per rank) as it runs for
           every array of every call */
        _Static_assert(MMD_MAX_NDIM == 8, "one case per rank below");
    #define MMD_AXIS(d) t->shape[d] = dims[d]; t->strides[d] = numel; numel *= dims[d];
        switch (nd) {
        case 8: MMD_AXIS(7) /* fall through */
        case 7: MMD_AXIS(6) /* fall through */
        case 6: MMD_AXIS(5) /* fall through */
        case 5: MMD_AXIS(4) /* fall through */
        case 4: MMD_AXIS(3) /* fall through */
        case 3: MMD_AXIS(2) /* fall through */
        case 2: MMD_AXIS(1) /* fall through */
        case 1: MMD_AXIS(0) /* fall through */
        default: break;
        }
    #undef MMD_AXIS
        t->ndim = nd;
        t->dtype = dtype;
        t->data = PyArray_DATA(arr);
        t->writable = PyArray_ISWRITEABLE(arr);
        *lo = (uintptr_t)t->data;
        *hi = *lo + (uintptr_t)(numel * type.itemsize);
        return 1;
    }

    /* The output test of every call, on the fast path and the general one
       (OpRegistry.check_outputs): each output (output_mask) must be
       writable and, unless empty, share no byte with any other array (the
       [lo, hi) ranges; absent optional arrays have lo == hi == 0 and meet
       nothing). Returns -1 when the outputs pass, else the first failing
       output i, with *other set to i when it is read-only, or to the array
       it overlaps. At the fast path's call site n and the mask are literals,
       so the loops unroll and the mask tests fold away. */
    static inline int mmd_find_output_conflict(int n, unsigned int output_mask,
                                               const mmd_tensor *tensors, const uintptr_t *lo,
                                               const uintptr_t *hi, int *other) {
    #pragma GCC unroll 16
        for (int i = 0; i < n; ++i) {
            if (!(output_mask >> i & 1u)) continue;
            *other = i;
            if (!tensors[i].writable) return i;
            const uintptr_t lo_i = lo[i], hi_i = hi[i];
            if (lo_i == hi_i) continue;   /* an empty output meets nothing */
    #pragma GCC unroll 16
            for (int j = 0; j < n; ++j) {
                *other = j;
                if (j != i && lo_i < hi[j] && lo[j] < hi_i) return i;
            }
        }
        return -1;
    }

    /* The whole intake of the common call, in one pass with no Python calls:
       every array argument a plain numpy array that mmd_view_contiguous_numpy
       takes (on the CPU, so on one device), or None where optional_mask
       allows (optional inputs, and outputs the entry point allocates next),
       and the outputs passing mmd_find_output_conflict. Returns 1
       with the views, args and extents filled, else 0: the general path then
       redoes the intake and takes the call, or raises its error. */
    static inline int mmd_intake_plain_numpy(PyObject *const *objects, int n,
                                             unsigned int optional_mask,
                                             unsigned int output_mask, mmd_tensor *tensors,
                                             const mmd_tensor **args, uintptr_t *lo,
                                             uintptr_t *hi) {
        unsigned int present = 0;
        /* n and the masks are literals at every call site: unrolled, the
           mask tests fold away */
    #pragma GCC unroll 16
        for (int i = 0; i < n; ++i) {
            PyObject *obj = objects[i];
            if (obj == Py_None && (optional_mask >> i & 1u)) {
                args[i] = NULL;
                lo[i] = hi[i] = 0;   /* overlaps nothing */
                tensors[i].writable = 1;   /* an output left to allocate passes */
                continue;
            }
            if (!mmd_is_exact_ndarray(obj) ||
                !mmd_view_contiguous_numpy(obj, &tensors[i], &lo[i], &hi[i]))
                return 0;
            tensors[i].device_type = MMD_DEVICE_CPU;
            tensors[i].device_id = 0;
            args[i] = &tensors[i];
            present |= 1u << i;
        }
        int other;
        return present && mmd_find_output_conflict(n, output_mask, tensors, lo, hi, &other) < 0;
    }
    """
    int _dtype_code "mmd_dtype_code"(char kind, Py_ssize_t itemsize) noexcept nogil
    enum:
        MMD_NPY_TYPES
    ctypedef struct mmd_numpy_type:
        unsigned char dtype
        unsigned char itemsize
    mmd_numpy_type mmd_type_by_typenum[]
    bint mmd_view_contiguous_numpy(PyObject *obj, mmd_tensor *t, uintptr_t *lo,
                                   uintptr_t *hi) noexcept nogil
    int mmd_init_dtype_table() except -1
    int mmd_find_output_conflict(int n, unsigned int output_mask, const mmd_tensor *tensors,
                                 const uintptr_t *lo, const uintptr_t *hi,
                                 int *other) noexcept nogil
    bint mmd_intake_plain_numpy(PyObject **objects, int n, unsigned int optional_mask,
                                unsigned int output_mask, mmd_tensor *tensors,
                                const mmd_tensor **args, uintptr_t *lo,
                                uintptr_t *hi) noexcept nogil


# DLPack DLDataTypeCode: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool.
cdef int _dlpack_dtype_code(int code, int bits) noexcept:
    if code == 4:
        return MMD_BFLOAT16 if bits == 16 else MMD_DTYPE_UNKNOWN
    if code == 6:
        return MMD_BOOL if bits == 8 else MMD_DTYPE_UNKNOWN
    if code in (0, 1, 2) and bits % 8 == 0:
        return _dtype_code(b"iuf"[code], bits // 8)
    return MMD_DTYPE_UNKNOWN


cdef inline void _contiguous_strides(mmd_tensor *t) noexcept:
    cdef int64_t step = 1
    cdef int d
    for d in range(t.ndim - 1, -1, -1):
        t.strides[d] = step
        step *= t.shape[d]


cdef enum:   # why _read_dltensor cannot view a DLPack tensor
    DL_BAD_DTYPE = 1
    DL_BAD_NDIM
    DL_NEGATIVE_SIZE


cdef int _read_dltensor(const DLTensor *dl, mmd_tensor *t) noexcept:
    """t's dtype, shape, strides and data from a DLPack tensor (a capsule's
    or one torch's exchange API filled): 0, or the DL_* reason it cannot be
    viewed, checked in that order."""
    cdef int d
    t.dtype = _dlpack_dtype_code(dl.dtype.code, dl.dtype.bits)
    if t.dtype == MMD_DTYPE_UNKNOWN or dl.dtype.lanes != 1:
        return DL_BAD_DTYPE
    if not 0 <= dl.ndim <= MMD_MAX_NDIM:
        return DL_BAD_NDIM
    t.ndim = dl.ndim
    for d in range(dl.ndim):
        t.shape[d] = dl.shape[d]
        if t.shape[d] < 0:
            return DL_NEGATIVE_SIZE
    if dl.strides == NULL:
        _contiguous_strides(t)
    else:
        for d in range(dl.ndim):
            t.strides[d] = dl.strides[d]   # DLPack strides count elements
    t.data = <char *>dl.data + dl.byte_offset
    return 0


cdef int _check_alignment(OpRegistry op, int i, mmd_tensor *t) except -1:
    cdef size_t size = mmd_dtype_size(t.dtype)
    if size and (<uintptr_t>t.data) % size:
        raise ValueError(f"{op.where(i)}, array data is not aligned to its dtype")
    return 0


cdef int _intake_numpy(OpRegistry op, int i, cnp.ndarray arr, mmd_tensor *t) except -1:
    """Any numpy array: the general path behind mmd_view_contiguous_numpy.
    A masked array is refused: the kernels would read (or write) the data
    under its mask as any other."""
    cdef int d, nd = cnp.PyArray_NDIM(arr)
    if type(arr) is not np.ndarray:
        masked = sys.modules.get("numpy.ma")   # none exists before numpy.ma is imported
        if masked is not None and isinstance(arr, masked.MaskedArray):
            raise TypeError(f"{op.where(i)}, masked arrays are not supported (the kernels "
                            "would take the data under the mask); pass arr.filled(value) "
                            "or arr.data")
    cdef cnp.npy_intp itemsize = cnp.PyArray_ITEMSIZE(arr)
    cdef cnp.npy_intp *dims = cnp.PyArray_DIMS(arr)
    cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(arr)
    t.dtype = _dtype_code(arr.descr.kind, itemsize)
    if t.dtype == MMD_DTYPE_UNKNOWN or cnp.PyArray_ISBYTESWAPPED(arr):
        raise TypeError(f"{op.where(i)}, unsupported dtype {arr.dtype.str}")
    if nd > MMD_MAX_NDIM:
        raise ValueError(f"{op.where(i)}, {nd} dimensions; at most {MMD_MAX_NDIM} are supported")
    if not cnp.PyArray_ISALIGNED(arr):
        raise ValueError(f"{op.where(i)}, array data is not aligned to its dtype")
    for d in range(nd):
        if strides[d] % itemsize:
            raise ValueError(f"{op.where(i)}, strides {(<object>arr).strides} are not multiples of the "
                             f"item size {itemsize}")
        t.shape[d] = dims[d]
        t.strides[d] = strides[d] // itemsize
    t.ndim = nd
    t.data = cnp.PyArray_DATA(arr)
    t.writable = cnp.PyArray_ISWRITEABLE(arr)
    return 0


cdef int _intake_layout(OpRegistry op, int i, object shape, object strides,
                        Py_ssize_t itemsize, mmd_tensor *t) except -1:
    """Shape and byte strides (None: C-contiguous) given as Python sequences."""
    cdef int d, nd = len(shape)
    cdef int64_t stride
    if nd > MMD_MAX_NDIM:
        raise ValueError(f"{op.where(i)}, {nd} dimensions; at most {MMD_MAX_NDIM} are supported")
    if strides is not None and len(strides) != nd:
        raise TypeError(f"{op.where(i)}, strides {strides!r} do not match shape {shape!r}")
    t.ndim = nd
    for d in range(nd):
        t.shape[d] = operator.index(shape[d])  # a float size is malformed, not truncated
        if t.shape[d] < 0:
            raise ValueError(f"{op.where(i)}, negative size in shape {shape!r}")
    if strides is None:
        _contiguous_strides(t)
        return 0
    for d in range(nd):
        stride = operator.index(strides[d])
        if stride % itemsize:
            raise ValueError(f"{op.where(i)}, strides {strides!r} are not multiples of the "
                             f"item size {itemsize}")
        t.strides[d] = stride // itemsize
    return 0


@cython.boundscheck(False)
@cython.wraparound(False)
cdef int _intake_cupy(OpRegistry op, int i, object arr, mmd_tensor *t) except -1:
    """A CuPy array: its dtype's numpy type number (CuPy arrays are always
    native-endian) through the numpy type table, and its shape and byte
    strides from their tuples, read in C."""
    cdef int num = arr.dtype.num
    cdef tuple shape = arr.shape
    cdef tuple strides = arr.strides
    cdef int d, nd = len(shape)
    cdef int64_t itemsize, stride
    if not 0 <= num < MMD_NPY_TYPES or mmd_type_by_typenum[num].dtype == MMD_DTYPE_UNKNOWN:
        raise TypeError(f"{op.where(i)}, unsupported dtype {arr.dtype.str}")
    t.dtype = mmd_type_by_typenum[num].dtype
    itemsize = mmd_type_by_typenum[num].itemsize
    if nd > MMD_MAX_NDIM:
        raise ValueError(f"{op.where(i)}, {nd} dimensions; at most {MMD_MAX_NDIM} are supported")
    t.ndim = nd
    for d in range(nd):
        t.shape[d] = <int64_t>shape[d]
        stride = <int64_t>strides[d]
        if stride % itemsize:
            raise ValueError(f"{op.where(i)}, strides {strides!r} are not multiples of the "
                             f"item size {itemsize}")
        t.strides[d] = stride // itemsize
    t.data = <void *><uintptr_t>arr.data.ptr
    t.writable = 1
    return _check_alignment(op, i, t)


cdef int _read_dlpack_device(str where, object method, object obj, mmd_tensor *t) except -1:
    """t's device from obj's __dlpack_device__ (`method`, looked up on its
    type). That is the caller's code: whatever it raises, or a malformed
    answer, becomes a TypeError naming the op and the parameter."""
    try:
        device = method(obj)
    except Exception as exc:
        raise TypeError(f"{where}, __dlpack_device__() raised {type(exc).__name__}: "
                        f"{exc}") from exc
    try:
        device_type, device_id = device
        t.device_type = operator.index(device_type)
        t.device_id = operator.index(device_id)
    except Exception:
        raise TypeError(f"{where}, __dlpack_device__() returned {device!r:.80}; expected "
                        "(device_type, device_id)") from None
    return 0


cdef object _export_dlpack(object obj, object stream):
    """obj.__dlpack__(), asking for a DLPack 1.x (versioned) capsule, whose
    flags say whether the memory is read-only or a copy; a producer that does
    not take max_version (it raises TypeError, as the array API standard
    says) is asked again for the unversioned kind."""
    try:
        if stream is None:
            return obj.__dlpack__(max_version=(1, 0))
        return obj.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:
        if stream is None:
            return obj.__dlpack__()
        return obj.__dlpack__(stream=stream)


cdef object _intake_dlpack(OpRegistry op, int i, object obj, object stream, mmd_tensor *t):
    """Views a DLPack export; returns the capsule, which the caller keeps
    alive until the kernel has run (the producer frees it after that)."""
    cdef DLManagedTensorVersioned *versioned = NULL
    cdef DLTensor *dl
    cdef int refused
    try:
        capsule = _export_dlpack(obj, stream)
        if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
            versioned = <DLManagedTensorVersioned *>PyCapsule_GetPointer(
                capsule, b"dltensor_versioned")
            dl = &versioned.dl_tensor
        else:
            dl = &(<DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")).dl_tensor
    except Exception as exc:
        raise TypeError(f"{op.where(i)}, could not export the array through __dlpack__: "
                        f"{exc}") from exc
    if versioned != NULL:
        if versioned.version.major != 1:
            raise TypeError(f"{op.where(i)}, __dlpack__ gave DLPack {versioned.version.major}."
                            f"{versioned.version.minor}, which is not 1.x")
        if versioned.flags & DLPACK_FLAG_IS_COPIED and op.array_flags[i] & ARG_OUTPUT:
            raise ValueError(f"{op.where(i)}, __dlpack__ exported a copy of this output "
                             "(DLPack flag IS_COPIED): what the kernel wrote would be lost")
    if dl.device.device_type != t.device_type or dl.device.device_id != t.device_id:
        raise ValueError(f"{op.where(i)}, __dlpack__ device "
                         f"{device_name(dl.device.device_type, dl.device.device_id)} differs "
                         f"from __dlpack_device__ {device_name(t.device_type, t.device_id)}")
    refused = _read_dltensor(dl, t)
    if refused == DL_BAD_DTYPE:
        raise TypeError(f"{op.where(i)}, unsupported DLPack dtype (code {dl.dtype.code}, "
                        f"bits {dl.dtype.bits}, lanes {dl.dtype.lanes})")
    if refused == DL_BAD_NDIM:
        raise ValueError(f"{op.where(i)}, {dl.ndim} dimensions; at most {MMD_MAX_NDIM} are "
                         "supported")
    if refused == DL_NEGATIVE_SIZE:
        raise ValueError(f"{op.where(i)}, negative size in DLPack shape")
    # an unversioned capsule cannot say; producers refuse to export read-only
    # memory that way (numpy does)
    t.writable = versioned == NULL or not (versioned.flags & DLPACK_FLAG_READ_ONLY)
    _check_alignment(op, i, t)
    return capsule


cdef int _cai_device(str where, object cai) except -1:
    """The CUDA device of a __cuda_array_interface__'s data pointer; a
    pointer that is not an address, or that CUDA does not know, is a
    TypeError naming the op and the parameter."""
    try:
        pointer = operator.index(cai["data"][0])
        if not 0 <= pointer < 2 ** 64:
            raise OverflowError(f"{pointer:#x} is not a 64-bit address")
    except Exception as exc:
        raise TypeError(f"{where}, malformed __cuda_array_interface__ {cai!r:.200}: "
                        f"{exc}") from None
    if _cai_device_resolver is None or not pointer:
        return 0
    try:
        return _cai_device_resolver(pointer)
    except Exception as exc:
        raise TypeError(f"{where}, __cuda_array_interface__ data pointer {pointer:#x} is not "
                        f"memory CUDA knows ({type(exc).__name__}: {exc})") from exc


cdef object _read_cai(str where, object obj):
    """obj.__cuda_array_interface__, or None where obj has none. That is
    the caller's code: whatever it raises becomes a TypeError naming the op
    and the parameter."""
    try:
        return getattr(obj, "__cuda_array_interface__", None)
    except Exception as exc:
        raise TypeError(f"{where}, __cuda_array_interface__ raised {type(exc).__name__}: "
                        f"{exc}") from exc


cdef int _intake_cai(OpRegistry op, int i, object obj, mmd_tensor *t) except -1:
    cai = _read_cai(op.where(i), obj)
    try:
        pointer, readonly = cai["data"]
        typestr = cai["typestr"]
        shape = tuple(cai["shape"])
        strides = cai.get("strides")
        mask = cai.get("mask")
        itemsize = int(typestr[2:])
    except Exception:
        raise TypeError(f"{op.where(i)}, malformed __cuda_array_interface__ {cai!r}") from None
    if mask is not None:
        raise TypeError(f"{op.where(i)}, masked __cuda_array_interface__ arrays are not supported")
    try:  # values beyond the C types (or not ints) are a malformed interface
        t.dtype = _dtype_code(<char>ord(typestr[1]), itemsize)
        if t.dtype == MMD_DTYPE_UNKNOWN or typestr[0] == ">":
            raise TypeError(f"{op.where(i)}, unsupported dtype {typestr}")
        _intake_layout(op, i, shape, strides, itemsize, t)
        t.data = <void *><uintptr_t>pointer
    except (OverflowError, TypeError, IndexError) as exc:
        if str(exc).startswith(op.name):
            raise
        raise TypeError(f"{op.where(i)}, malformed __cuda_array_interface__ {cai!r:.200}: "
                        f"{exc}") from None
    t.writable = not readonly
    return _check_alignment(op, i, t)


cdef inline void _byte_extent(const mmd_tensor *t, uintptr_t *lo, uintptr_t *hi) noexcept:
    """[lo, hi) covers every byte the view can touch; lo == hi when empty."""
    cdef int64_t low = 0, high = 0, step
    cdef int64_t size = <int64_t>mmd_dtype_size(t.dtype)
    cdef int d
    for d in range(t.ndim):
        if t.shape[d] == 0:
            lo[0] = hi[0] = <uintptr_t>t.data
            return
        step = (t.shape[d] - 1) * t.strides[d]
        if step < 0:
            low += step
        else:
            high += step
    lo[0] = <uintptr_t>(<char *>t.data + low * size)
    hi[0] = <uintptr_t>(<char *>t.data + (high + 1) * size)
