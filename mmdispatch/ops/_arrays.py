"""Array plumbing shared by the user-facing ops: accept numpy, CuPy and any
DLPack / __cuda_array_interface__ array; allocate outputs of the input's
kind on the input's device; hand results back in the caller's library."""
import contextlib
import operator
import sys

import numpy as np

from mmdispatch import _core

_CPU, _CUDA = 1, 2
_INT64_MAX = np.iinfo(np.int64).max


def _cupy():
    """CuPy if it is imported: an array of CuPy's exists only then."""
    return sys.modules.get("cupy")


def _import_cupy():
    """CuPy, imported if it is installed (to allocate like a CUDA array of
    another library), else None. What the ops do never depends on whether
    the caller imported CuPy first."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def native(op, name, x):
    """numpy or CuPy view of array argument `name` (no copy). A CUDA array
    of another library (torch, JAX, ...) stays as it is: the dispatcher
    views it through DLPack, after checking that every argument is on one
    device, so nothing exports an array on the wrong device."""
    if isinstance(x, np.ndarray):
        return x
    cupy = _cupy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return x
    # The protocols run the caller's code, which may fail in any way: the
    # error is re-raised naming the op and the parameter.
    try:
        if getattr(type(x), "__dlpack_device__", None) is not None:
            device_type = operator.index(x.__dlpack_device__()[0])
            if device_type == _CPU:
                return np.from_dlpack(x)
            return x  # viewed by the dispatcher (or left to Python kernels, or its error)
        if getattr(x, "__cuda_array_interface__", None) is not None:
            cupy = _import_cupy()
            if cupy is not None:
                return cupy.asarray(x)   # reads the interface, not the memory
            return x
    except Exception as exc:
        raise TypeError(f"{op}: {name} could not be viewed through its array protocol "
                        f"({type(x).__name__}): {type(exc).__name__}: {exc}") from exc
    raise TypeError(f"{op}: {name} must be an array (numpy, CuPy, or one with __dlpack__ or "
                    f"__cuda_array_interface__), got {type(x).__name__}")


_NO_SWITCH = contextlib.nullcontext()


def namespace(op, x):
    """(array module, context manager selecting x's device) for allocating
    the outputs of `op` like x: numpy, or CuPy for CUDA arrays (CuPy's own,
    and other libraries' when CuPy is installed)."""
    cupy = _cupy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        if x.data.device_id == cupy.cuda.runtime.getDevice():
            return cupy, _NO_SWITCH   # already current: no device switch, twice, per call
        return cupy, x.device
    if isinstance(x, np.ndarray):
        return np, _NO_SWITCH
    try:
        device = getattr(type(x), "__dlpack_device__", None) and tuple(
            operator.index(v) for v in x.__dlpack_device__())
    except Exception:
        device = None
    if device and len(device) == 2 and device[0] == _CUDA:
        cupy = _import_cupy()
        try:
            count = cupy.cuda.runtime.getDeviceCount() if cupy is not None else 0
        except Exception:   # CuPy installed, but no driver or no GPU
            count = 0
        if count:
            if not 0 <= device[1] < count:
                raise ValueError(f"{op}: the arrays are on cuda:{device[1]}, which does not "
                                 f"exist: this machine has {count} CUDA device(s)")
            return cupy, cupy.cuda.Device(device[1])
    where = f" on DLPack device {device}" if device else ""
    raise TypeError(f"{op}: cannot allocate outputs like a {type(x).__name__}{where}: the op "
                    f"functions allocate with numpy (CPU) or CuPy (CUDA, when installed); for "
                    f"other devices call the {op}_impl-style entry points with your own outputs")


def contiguous(x):
    """x itself when C-contiguous, else a contiguous copy."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    cupy = _cupy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return x if x.flags.c_contiguous else cupy.ascontiguousarray(x)
    return x


# (library, device, dtype) -> a zero-size array, for outputs a call leaves
# unused (roi_align's argmax pair in avg mode): allocating one costs a CuPy
# call several microseconds. Never handed to the caller.
_UNUSED: dict = {}


def unused_output(xp, like):
    """A shared zero-size array of `like`'s dtype, library and device."""
    device = like.data.device_id if xp is not np else 0
    key = (xp.__name__, device, like.dtype.str)
    array = _UNUSED.get(key)
    if array is None:
        array = _UNUSED[key] = xp.empty((0,), dtype=like.dtype)
    return array


def unused_like(op, like):
    """unused_output of like's library and device; for an array that is
    neither numpy nor CuPy, a fresh zero-size one (zeros())."""
    try:
        xp, device = namespace(op, like)
    except TypeError:
        return zeros(op, "an unused output", like, (0,))
    with device:
        return unused_output(xp, like)


def like(original, result):
    """result (numpy/CuPy, or already of original's type) as an array of
    original's library, zero-copy."""
    cupy = _cupy()
    if (isinstance(original, np.ndarray) or type(result) is type(original)
            or (cupy is not None and isinstance(original, cupy.ndarray))):
        return result
    return _core._in_library_of(original, result)


def check_ndim(op, name, x, ndim, layout):
    if getattr(x, "ndim", None) != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D {layout}, got shape "
                         f"{tuple(getattr(x, 'shape', ()))}")


def pair(op, name, value, low=1):
    """(h, w) from an int or a pair of ints (anything with __index__, numpy's
    integers included, counts as an int), each >= low (low None: no bound;
    the torch layer leaves bounds to the op). A tuple or list is taken as a
    pair before anything else: torch 2.11's dynamo raises an internal
    error, not a TypeError, for operator.index of a tuple, so torch.compile
    of a call with a pair failed there."""
    try:  # runs the caller's __index__ / __iter__, which may fail in any way
        items = None
        if not isinstance(value, (tuple, list)):
            try:
                size = operator.index(value)
                items = (size, size)
            except TypeError:
                pass
        if items is None:
            h, w = value
            items = (operator.index(h), operator.index(w))
    except Exception as exc:
        raise TypeError(f"{op}: {name} must be an int or a pair of ints, got {value!r}") from exc
    h, w = items
    if low is not None and (h < low or w < low):
        raise ValueError(f"{op}: {name} must be >= {low}, got {value!r}")
    return h, w


def allocate(op, name, xp, shape, dtype, zeros=False):
    """xp.empty(shape, dtype) (xp.zeros with zeros=True) for output `name`
    of `op`. A shape the allocator refuses (its size overflows int64, e.g. a
    huge output_size) is a ValueError and a failed allocation a
    MemoryError, both naming the op and the output; nothing is checked
    before the allocation, so the common case costs nothing extra."""
    make = xp.zeros if zeros else xp.empty
    return _allocating(op, name, shape, lambda: make(shape, dtype=dtype))


def _allocating(op, name, shape, make):
    """make(), with allocate's errors."""
    try:
        return make()
    except MemoryError as exc:
        raise MemoryError(f"{op}: out of memory allocating {name} of shape {tuple(shape)}: "
                          f"{exc}") from exc
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"{op}: {name} cannot have shape {tuple(shape)}: {exc}") from exc


def zeros(op, name, like, shape):
    """Zeroed output `name` of `op` of like's dtype on like's device: with
    numpy or CuPy as namespace() chooses, else in like's own library, so
    that an op on a device served by a fallback (mmdispatch.fallbacks)
    works: torch's new_zeros, or the Array API namespace's zeros(device=).
    An array of neither kind gets namespace()'s TypeError."""
    try:
        xp, device = namespace(op, like)
    except TypeError:
        new_zeros = getattr(like, "new_zeros", None)   # torch
        get_namespace = getattr(like, "__array_namespace__", None)
        if callable(new_zeros):
            return _allocating(op, name, shape, lambda: new_zeros(shape))
        if get_namespace is None:
            raise
        xp = get_namespace()
        return _allocating(op, name, shape,
                           lambda: xp.zeros(shape, dtype=like.dtype, device=like.device))
    with device:
        return allocate(op, name, xp, shape, like.dtype, zeros=True)


def roi_backward_operands(op, grad_output, rois, input_shape, layout):
    """(grad_output, rois, grad_input) of a roi op's backward: grad_output
    ((K, C, out_h, out_w) as `layout` names it) and rois viewed, contiguous,
    and a zeroed grad_input of shape input_shape (N, C, H, W) like
    grad_output (zeros())."""
    grad_output = contiguous(native(op, "grad_output", grad_output))
    rois = contiguous(native(op, "rois", rois))
    check_ndim(op, "grad_output", grad_output, 4, layout)
    shape = shape_arg(op, "input_shape", input_shape, 4, "(N, C, H, W)")
    return grad_output, rois, zeros(op, "grad_input", grad_output, shape)


def shape_arg(op, name, value, ndim, layout):
    """A shape given as a sequence of `ndim` non-negative ints."""
    try:  # runs the caller's __iter__ / __index__, which may fail in any way
        shape = tuple(operator.index(v) for v in value)
    except Exception as exc:
        raise TypeError(f"{op}: {name} must be a sequence of {ndim} ints {layout}, got "
                        f"{value!r}") from exc
    if len(shape) != ndim or min(shape, default=0) < 0:
        raise ValueError(f"{op}: {name} must be {ndim} non-negative ints {layout}, got "
                         f"{value!r}")
    return shape


def index_array(op, name, x):
    """Integer array argument as int64 (copied only if it has another
    integer dtype); anything else is a TypeError. Another library's device
    array (a torch CUDA tensor, say: its dtype is not numpy's) goes to the
    kernel as it is, whose check demands int64, naming the op and `name`."""
    x = contiguous(native(op, name, x))
    kind = getattr(getattr(x, "dtype", None), "kind", None)
    if kind is None and getattr(type(x), "__dlpack_device__", None) is not None:
        return x
    if kind not in ("i", "u"):
        raise TypeError(f"{op}: {name} must have an integer dtype, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dtype == np.int64:
        return x
    if not hasattr(x, "astype"):
        raise TypeError(f"{op}: {name} must be int64 (got {x.dtype}) when it is not a numpy "
                        f"or CuPy array, which could be converted")
    if x.dtype.itemsize == 8 and kind == "u" and x.size and int(x.max()) > _INT64_MAX:
        raise ValueError(f"{op}: {name} holds {int(x.max())}, beyond the int64 range")
    return x.astype(np.int64)


def output_pair(op, name, value):
    """(h, w) of an output size: an int >= 1, or a pair of them."""
    if type(value) is int and value >= 1:   # the common case, without pair's checks
        return value, value
    return pair(op, name, value)


def explain(op, exc, arrays):
    """Raises the error of an entry-point call that failed with `exc` (a
    TypeError or ValueError): the op's own error when an argument of
    `arrays` ((name, value, ndim, layout) each; ndim None: any rank) is
    not an array or has another rank than the op's layout, else `exc`
    itself. Errors are rare: the call does not test for them beforehand."""
    if not isinstance(exc, _core.DeferredKernelError):
        for name, value, ndim, layout in arrays:
            array = native(op, name, value)
            if ndim is not None:
                check_ndim(op, name, array, ndim, layout)
    raise exc


def choice(op, name, value, options):
    """options[value] for a string parameter such as mode or reduction."""
    # only strings are looked up: hashing another object may fail in any way
    # (a writable memoryview raises ValueError)
    if isinstance(value, str) and value in options:
        return options[value]
    allowed = ", ".join(repr(k) for k in options)
    raise ValueError(f"{op}: {name} must be one of {allowed}, got {value!r}")


_REDUCTIONS = {"none": "none", "mean": "mean", "sum": "sum"}


def reduction_of(op, reduction):
    """A loss's reduction parameter, checked: "none", "sum" or "mean"."""
    return choice(op, "reduction", reduction, _REDUCTIONS)


def reduce_loss(loss, reduction):
    """A loss reduced as MMCV's losses reduce it (reduction checked by
    reduction_of): "none" (as it is), "sum", or "mean" (the sum over its
    first axis's N entries over N, NaN for N = 0), the last two as 0-d
    arrays of loss's library."""
    if reduction == "none":
        return loss
    total = loss.sum()   # numpy gives a scalar, other libraries a 0-d array
    if reduction == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            total = total / loss.shape[0]
    return np.asarray(total) if isinstance(total, np.generic) else total
