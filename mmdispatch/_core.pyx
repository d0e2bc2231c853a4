# cython: language_level=3, cdivision=True
"""The device registry and dispatcher: MMCV's DeviceRegistry,
REGISTER_DEVICE_IMPL and DISPATCH_DEVICE_IMPL over numpy, CuPy, DLPack and
__cuda_array_interface__ arrays.

One call of an entry point (generated per op into _dispatch_gen.pxi):
  1. classify every array argument and read its device (no copies);
  2. every array must sit on the first array's device (type and index);
  3. slot = device_type * MMD_MAX_BACKENDS + the thread's backend;
     a Python kernel there wins, else the C table's pointer, else the
     device's fallback (register_fallback), else KernelNotFoundError;
  4. view each array as an mmd_tensor, check outputs (writable, no overlap);
  5. call the kernel without the GIL (with the hooks' begin and end around
     it where a hook is added: _layers.pxi); a nonzero status becomes an
     exception in one place (OpRegistry.raise_kernel_error).
"""
cimport cython
cimport numpy as cnp
from cpython.exc cimport PyErr_Clear
from cpython.list cimport PyList_GET_ITEM
from cpython.pycapsule cimport (PyCapsule_CheckExact, PyCapsule_GetName, PyCapsule_GetPointer,
                                PyCapsule_IsValid)
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint32_t, uint64_t, uintptr_t

import contextlib
import operator
import os
import sys
import threading

import numpy as np

cnp.import_array()

include "_intake.pxi"
mmd_init_dtype_table()


class DeviceMismatchError(RuntimeError):
    """Array arguments of one call live on different devices."""


class KernelNotFoundError(NotImplementedError):
    """No kernel is registered for the arrays' device and the selected backend."""


class DeferredKernelError(ValueError):
    """Bad input found by the kernel of an earlier call after that call had
    returned (a CUDA kernel runs after its call returns, and mmdispatch does
    not wait for it): raised by the next mmdispatch call on that device,
    which then does not run, or by synchronize(). The message names the op
    of the call that caused it and the bad item. strict() raises such
    errors at the call instead."""


# DLPack device type codes -> names; devices print as "cpu", "cuda:0".
DEVICE_TYPES = {
    1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
    9: "vpi", 10: "rocm", 11: "rocm_host", 12: "ext_dev", 13: "cuda_managed",
    14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia",
}
_DEVICE_CODES = {name: code for code, name in DEVICE_TYPES.items()}

MAX_BACKENDS = MMD_MAX_BACKENDS
MAX_DEVICE_TYPES = MMD_MAX_DEVICE_TYPES

# Backend names, shared by all devices; index = position. The first three
# match MMD_BACKEND_* in registry.h; register_impl may add more.
_backend_names = ["default", "reference", "deterministic"]
_registry_lock = threading.RLock()
_ops = {}
# device type -> (available, status message, module name), from the device
# module's registration, which runs the first time the device type is needed
# (_probe_device): importing mmdispatch asks no driver anything, so a process
# that forks after the import can still use CUDA in the child.
_device_status = {}
cdef bint _device_probed[MMD_MAX_DEVICE_TYPES]
# How many devices of each type exist, from its module's registration; -1
# where unknown (no module in this build, not registered yet, or unusable:
# kernels registered from Python may serve devices the module cannot see).
cdef int _device_count[MMD_MAX_DEVICE_TYPES]
for _code in range(MMD_MAX_DEVICE_TYPES):
    _device_count[_code] = -1


def device_name(int device_type, int device_id=0):
    """Printable device, e.g. ``cpu`` or ``cuda:0`` (``cpu:1``: a CPU index
    other than 0, which an array may claim)."""
    if device_type == MMD_DEVICE_CPU:
        return "cpu" if device_id == 0 else f"cpu:{device_id}"
    return f"{DEVICE_TYPES.get(device_type, f'device{device_type}')}:{device_id}"


def parse_device_type(device):
    """Device type code from a name (``"cuda"``) or a DLPack code (``2``)."""
    if isinstance(device, str):
        base, _, index = device.partition(":")
        if index:
            raise ValueError(
                f"device must be a device type such as 'cuda', got {device!r}: "
                "kernels are registered per device type, not per index")
        if base not in _DEVICE_CODES:
            raise ValueError(f"unknown device {device!r}; known: {', '.join(_DEVICE_CODES)}")
        return _DEVICE_CODES[base]
    try:
        code = operator.index(device)
    except TypeError:
        raise TypeError(f"device must be a name or a DLPack device code, got {device!r}") from None
    if not 0 < code < MMD_MAX_DEVICE_TYPES:
        raise ValueError(f"device code must be in [1, {MMD_MAX_DEVICE_TYPES}), got {code}")
    return code


def _backend_index(name, bint create=False):
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}")
    with _registry_lock:
        if name in _backend_names:
            return _backend_names.index(name)
        if not create:
            raise ValueError(f"unknown backend {name!r}; known: {', '.join(_backend_names)}")
        if not name or name != name.strip():
            raise ValueError(f"backend must be a non-empty name without surrounding spaces, "
                             f"got {name!r}")
        if len(_backend_names) >= MMD_MAX_BACKENDS:
            # a name lives as long as the process (threads select backends by
            # index): reusing one is the way to register again
            raise ValueError(f"cannot add backend {name!r}: at most {MMD_MAX_BACKENDS} backends, "
                             f"and a name, once added, stays for the process (known: "
                             f"{', '.join(_backend_names)}); register under one of them")
        _backend_names.append(name)
        return len(_backend_names) - 1


def backends():
    """Names of all known backends."""
    return list(_backend_names)


def get_backend(device):
    """The calling thread's backend for a device type."""
    return _backend_names[mmd_thread_backends()[parse_device_type(device)]]


# Whether any thread ever selected a backend other than "default": until one
# does, every thread's selection is "default" and dispatch need not read the
# thread-local table. Read and written with the GIL held.
cdef bint _any_backend_selected = False


# Called with no arguments after use_backend() or strict() changes the
# calling thread's selection, each way (set by mmdispatch.torch, which
# hands the selection to the threads torch's autograd runs CUDA backwards
# in: _thread_selection).
_selection_hook = None


def _set_selection_hook(hook):
    """Sets the function called after each change of a thread's backend
    selection or strict mode (None: none)."""
    global _selection_hook
    _selection_hook = hook


cdef int _selection_changed() except -1:
    if _selection_hook is not None:
        _selection_hook()
    return 0


def _thread_selection():
    """The calling thread's backend selection and strict mode, as bytes
    (a backend index per device type, then the strict state), or None
    while all of them are the defaults."""
    cdef unsigned char *selected = mmd_thread_backends()
    cdef unsigned char state = mmd_thread_strict()[0]
    cdef int i
    if state == MMD_STRICT_UNSET:
        for i in range(MMD_MAX_DEVICE_TYPES):
            if selected[i] != 0:
                break
        else:
            return None
    return selected[:MMD_MAX_DEVICE_TYPES] + bytes((state,))


def _set_thread_selection(selection):
    """Sets the calling thread's backend selection and strict mode to
    `selection` (one of _thread_selection's values); returns the previous
    one. The hook is not called: the caller restores the previous value."""
    previous = _thread_selection()
    cdef unsigned char *selected = mmd_thread_backends()
    cdef int i
    global _any_backend_selected, _flags_possible
    if selection is None:
        for i in range(MMD_MAX_DEVICE_TYPES):
            selected[i] = 0
        mmd_thread_strict()[0] = MMD_STRICT_UNSET
        return previous
    if len(selection) != MMD_MAX_DEVICE_TYPES + 1:
        raise ValueError(f"not a thread selection: {selection!r}")
    for i in range(MMD_MAX_DEVICE_TYPES):
        if selection[i] >= len(_backend_names):
            raise ValueError(f"not a thread selection: {selection!r}")
        selected[i] = selection[i]
        if selection[i] != 0:
            _any_backend_selected = True
    mmd_thread_strict()[0] = selection[MMD_MAX_DEVICE_TYPES]
    if selection[MMD_MAX_DEVICE_TYPES] == MMD_STRICT_ON:
        _flags_possible = True
    return previous


@contextlib.contextmanager
def use_backend(device, name):
    """Selects the backend (e.g. ``"reference"``) for a device type in this
    thread for the duration of the ``with`` block. With mmdispatch.torch
    imported, the backward passes that torch's autograd runs from this
    thread in the block, on CUDA in a thread of its own, take it too."""
    cdef int code = parse_device_type(device)
    cdef int index = _backend_index(name)
    cdef unsigned char *selected = mmd_thread_backends()
    cdef unsigned char previous = selected[code]
    global _any_backend_selected
    if index != 0:
        _any_backend_selected = True
    selected[code] = index
    _selection_changed()
    try:
        yield
    finally:
        mmd_thread_backends()[code] = previous
        _selection_changed()


# Strict mode's process default (MMDISPATCH_STRICT=1), TF32's (the float32
# matmul precision set), and whether either may be on in some thread: until
# one may, dispatch does not read the thread-local settings. Read and
# written with the GIL held.
cdef bint _strict_default = os.environ.get("MMDISPATCH_STRICT", "").strip().lower() in (
    "1", "true", "yes", "on")
cdef bint _tf32_default = False
cdef str _float32_precision = "highest"
cdef bint _flags_possible = _strict_default


cdef inline uint32_t _context_flags() noexcept:
    cdef unsigned char state
    cdef uint32_t flags = 0
    if not _flags_possible:
        return 0
    state = mmd_thread_strict()[0]
    if state == MMD_STRICT_ON or (state == MMD_STRICT_UNSET and _strict_default):
        flags = MMD_CONTEXT_STRICT
    state = mmd_thread_tf32()[0]
    if state == MMD_STRICT_ON or (state == MMD_STRICT_UNSET and _tf32_default):
        flags |= MMD_CONTEXT_TF32
    return flags


def is_strict():
    """Whether calls in this thread run in strict mode (see strict())."""
    return (_context_flags() & MMD_CONTEXT_STRICT) != 0


_FLOAT32_PRECISIONS = ("highest", "high", "medium")


def set_float32_matmul_precision(precision):
    """The precision of float32 matrix products in the kernels, for the
    whole process, in torch.set_float32_matmul_precision's terms:
    ``"highest"`` (the default) computes them in IEEE float32; ``"high"``
    and ``"medium"`` let them run in TF32 (10 mantissa bits in the
    operands, float32 sums) where the device has it: on CUDA devices of
    compute capability 8.0 and later, deform_conv2d's products (through
    cuBLAS; NVIDIA_TF32_OVERRIDE=0 still turns TF32 off). The CPU's
    products are IEEE float32 always. mmdispatch.torch's calls follow
    torch's own setting instead (torch.set_float32_matmul_precision,
    torch.backends.cuda.matmul.allow_tf32 or .fp32_precision), as
    torchvision's and MMCV's deform_conv2d do."""
    global _float32_precision, _tf32_default, _flags_possible
    if not isinstance(precision, str) or precision not in _FLOAT32_PRECISIONS:
        raise ValueError(f"set_float32_matmul_precision: precision must be one of "
                         f"{', '.join(map(repr, _FLOAT32_PRECISIONS))}, got {precision!r}")
    _float32_precision = precision
    _tf32_default = precision != "highest"
    if _tf32_default:
        _flags_possible = True


def get_float32_matmul_precision():
    """The process's float32 product precision (see
    set_float32_matmul_precision): "highest", "high" or "medium"."""
    return _float32_precision


def _swap_thread_tf32(int value):
    """Sets whether this thread's calls may run float32 products in TF32:
    -1 as the process's setting says, 0 no, 1 yes (mmdispatch.torch, for
    its calls, from torch's setting); returns the previous value."""
    global _flags_possible
    cdef unsigned char *state = mmd_thread_tf32()
    previous = -1 if state[0] == MMD_STRICT_UNSET else int(state[0] == MMD_STRICT_ON)
    if value < 0:
        state[0] = MMD_STRICT_UNSET
    elif value:
        state[0] = MMD_STRICT_ON
        _flags_possible = True
    else:   # off: as the default, unless the process's setting is on (flags then read)
        state[0] = MMD_STRICT_OFF
    return previous


@contextlib.contextmanager
def strict(bint enabled=True):
    """Strict mode for this thread during the ``with`` block (the default for
    every thread is the environment variable MMDISPATCH_STRICT=1): a call
    whose CUDA kernel checks its data (rois, argmax entries, class targets)
    checks it before writing anything and waits for the device, so a bad
    item is raised by that call, as on the CPU, and a failed kernel is
    reported by the call that launched it. Slower (a synchronisation per
    call): for debugging, like CUDA_LAUNCH_BLOCKING. Outside strict mode
    such errors are deferred (see DeferredKernelError). With mmdispatch.torch
    imported, the backward passes that torch's autograd runs from this
    thread in the block, on CUDA in a thread of its own, take it too."""
    cdef unsigned char *state = mmd_thread_strict()
    cdef unsigned char previous = state[0]
    global _flags_possible
    if enabled:
        _flags_possible = True
    state[0] = MMD_STRICT_ON if enabled else MMD_STRICT_OFF
    _selection_changed()
    try:
        yield
    finally:
        mmd_thread_strict()[0] = previous
        _selection_changed()


cdef tuple _device_selection(str what, device):
    """(device type code or -1 for every type, device index or -1 for
    every device of the type) of ``device`` as synchronize and empty_cache
    take it: a device type, one device ("cuda:1") or None."""
    cdef int device_id = -1, code = -1
    if device is not None:
        name = device if isinstance(device, str) else None
        if name is not None and ":" in name:
            name, _, index = name.partition(":")
            try:
                device_id = int(index)
            except ValueError:
                raise ValueError(f"{what}: bad device {device!r}") from None
            if device_id < 0:
                raise ValueError(f"{what}: bad device {device!r}")
        code = parse_device_type(device if name is None else name)
    return code, device_id


cdef _each_device_module(str what, device, bint empty_cache):
    """Calls the synchronize_fn (or empty_cache_fn) of each selected device
    module that is usable, raising the status it returns."""
    cdef int count, i, status, device_id, code
    cdef const mmd_device_module *modules
    cdef int (*fn)(int) noexcept nogil
    code, device_id = _device_selection(what, device)
    modules = mmd_get_device_modules(&count)
    for i in range(count):
        fn = modules[i].empty_cache_fn if empty_cache else modules[i].synchronize_fn
        if ((code >= 0 and modules[i].device_type != code) or fn == NULL
                or not _device_status.get(modules[i].device_type, (False,))[0]):
            continue   # not this device, or nothing can have been queued on it
        with nogil:
            status = fn(device_id)
        if status != 0:
            _raise_status(what, status)


def synchronize(device=None):
    """Waits until the kernels mmdispatch queued on ``device`` have finished
    and raises the deferred error one of them left (DeferredKernelError),
    if any. ``device``: a device type (``"cuda"``: every device of that type
    mmdispatch ran on), one device (``"cuda:1"``), or None for every device
    type. CPU kernels finish before their call returns."""
    _each_device_module("synchronize", device, False)


def empty_cache(device=None):
    """Returns the memory that mmdispatch's kernels keep for reuse on
    ``device`` to its driver, as ``torch.cuda.empty_cache()`` does for
    torch's. On CUDA that is each device's scratch pool (the temporary
    memory of nms, deform_conv2d and others): it keeps up to 256 MiB of
    freed scratch across synchronisations, so that the next call need not
    map it again; this waits for the device, then releases all of it.
    ``device`` as for synchronize(). The CPU keeps nothing."""
    _each_device_module("empty_cache", device, True)


def devices():
    """Device modules compiled into this build and whether they are usable
    now: a list of dicts with ``device``, ``available`` and ``status``. The
    first call asks each device's driver (CUDA: its runtime) what is there."""
    _probe_all_devices()
    return [
        {"device": DEVICE_TYPES.get(code, str(code)), "code": code,
         "available": available, "status": status}
        for code, (available, status, _name) in sorted(_device_status.items())
    ]


cdef class KernelHandle:
    """Returned by register_impl; ``remove()`` (or leaving a ``with`` block)
    unregisters the kernel and restores what it replaced. ``kind`` is
    "python" for a callable, "C" for a kernel capsule."""
    cdef readonly str op
    cdef readonly str device
    cdef readonly str backend
    cdef readonly object fn
    cdef readonly str kind
    cdef readonly str origin
    cdef OpRegistry registry
    cdef int slot
    cdef void *c_kernel

    def remove(self):
        """Unregisters this kernel; calling it again does nothing."""
        with _registry_lock:
            stack = self.registry.runtime_stacks.get(self.slot)
            if stack is None or self not in stack:
                return
            stack.remove(self)
            if not stack:
                del self.registry.runtime_stacks[self.slot]
            self.registry.activate(self.slot)

    @property
    def active(self):
        """True while this kernel is the one the dispatcher calls."""
        stack = self.registry.runtime_stacks.get(self.slot)
        return bool(stack) and stack[-1] is self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def __repr__(self):
        return f"<KernelHandle {self.op} {self.device}/{self.backend} {self.origin}>"


def _origin_of(fn):
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"python:{module}.{qualname}"


def kernel_capsule_name(op_name):
    """The name a PyCapsule must carry to be registered as a C kernel of
    ``op_name``: its pointer must be a function with the op's C signature
    (``int fn(const mmd_tensor *..., <scalars>, const mmd_context *)``, see
    mmdispatch_generated.h), callable without the GIL."""
    return f"mmdispatch.kernel.{_op_registry(op_name).name}"


cdef void *_capsule_kernel(OpRegistry op, object capsule) except NULL:
    expected = kernel_capsule_name(op.name)
    cdef const char *name = PyCapsule_GetName(capsule)
    if name == NULL or name.decode("utf-8", "replace") != expected:
        got = "no name" if name == NULL else repr(name.decode("utf-8", "replace"))
        raise TypeError(f"register_impl: a C kernel capsule for {op.name} must be named "
                        f"{expected!r}, got {got}")
    return PyCapsule_GetPointer(capsule, name)


def register_impl(op_name, device, fn, *, backend="default", bint override=False):
    """Registers a kernel of ``op_name`` for a device type and backend: a
    Python callable, called with the entry point's original arguments, or a
    PyCapsule holding a C kernel (named ``kernel_capsule_name(op_name)``),
    called like the built-in ones, without the GIL.
    Registering where a kernel (C or Python) already is raises ValueError
    unless ``override=True``; the returned handle's ``remove()`` restores the
    previous kernel."""
    cdef OpRegistry op = _op_registry(op_name)
    cdef bint is_capsule = PyCapsule_CheckExact(fn)
    cdef void *c_kernel = _capsule_kernel(op, fn) if is_capsule else NULL
    if not is_capsule and not callable(fn):
        raise TypeError(f"register_impl: fn must be callable or a C kernel capsule, got "
                        f"{type(fn).__name__}")
    cdef int code = parse_device_type(device)
    cdef int slot
    cdef KernelHandle handle
    _probe_device(code)  # its built-in kernels, if any, fill their slots first
    with _registry_lock:
        slot = code * MMD_MAX_BACKENDS + _backend_index(backend, create=True)
        existing = op.runtime_stacks.get(slot)
        if not override and (existing or op.c_table[slot] != NULL):
            current = existing[-1].origin if existing else op.c_origin[slot].decode()
            raise ValueError(
                f"register_impl: {op.name} already has a kernel for "
                f"{DEVICE_TYPES[code] if code in DEVICE_TYPES else code}/{backend} "
                f"({current}); pass override=True to replace it")
        handle = KernelHandle.__new__(KernelHandle)
        handle.op = op.name
        handle.device = DEVICE_TYPES.get(code, str(code))
        handle.backend = backend
        handle.fn = fn
        handle.kind = "C" if is_capsule else "python"
        handle.origin = f"capsule:{kernel_capsule_name(op.name)}" if is_capsule else _origin_of(fn)
        handle.registry = op
        handle.slot = slot
        handle.c_kernel = c_kernel
        op.runtime_stacks.setdefault(slot, []).append(handle)
        op.activate(slot)
    return handle


def _op_registry(op_name):
    try:
        return _ops[op_name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown op {op_name!r}; known: {', '.join(sorted(_ops))}") from None


cdef extern from "mmdispatch/gemm.h":
    const char *mmd_gemm_provider() nogil
    const char *mmd_tile_isa_name() nogil


def gemm_provider():
    """The library the CPU kernels' matrix products call (deform_conv2d):
    the process's BLAS, found on the first product, or "mmdispatch's own"
    (none found, or MMDISPATCH_BLAS=none)."""
    return mmd_gemm_provider().decode()


def cpu_tiles():
    """The instruction set of our own products' register tiles: "avx512",
    "avx2" or "baseline", the best this CPU has, capped by
    MMDISPATCH_CPU_ISA. From AVX2 up, deform_conv2d's products run on them
    instead of the BLAS (unless its groups have fewer than a quarter of a
    strip, 8 float32 values in AVX-512, of out channels or columns)."""
    return mmd_tile_isa_name().decode()


def op_signatures():
    """{op name: signature line} for every dispatchable op."""
    return {name: op.signature for name, op in _ops.items()}


def registry_table():
    """Every filled slot as plain data: a list of dicts with ``op``,
    ``device``, ``backend``, ``kind`` ("C" or "python"), ``origin`` (who
    registered it) and ``active`` (whether dispatch calls it)."""
    cdef OpRegistry op
    cdef KernelHandle handle
    cdef int slot
    rows = []
    _probe_all_devices()
    with _registry_lock:
        for name in sorted(_ops):
            op = _ops[name]
            for slot in range(MMD_TABLE_SIZE):
                code, backend = divmod(slot, MMD_MAX_BACKENDS)
                stack = op.runtime_stacks.get(slot, ())
                base = {"op": name, "device": DEVICE_TYPES.get(code, str(code)),
                        "backend": _backend_names[backend] if backend < len(_backend_names)
                        else str(backend)}
                if op.c_table[slot] != NULL:
                    rows.append(dict(base, kind="C", origin=op.c_origin[slot].decode(),
                                     active=not stack))
                for handle in stack:
                    rows.append(dict(base, kind=handle.kind, origin=handle.origin,
                                     active=handle is stack[-1]))
    return rows


cdef class OpRegistry:
    """The registry of one op: its typed C kernel table (filled by
    MMD_REGISTER_DEVICE_IMPL at import) and its Python kernels."""

    def __repr__(self):
        return f"<OpRegistry {self.signature}>"

    cdef str where(self, int i):
        return f"{self.name}: at param {self.array_positions[i]} ({self.array_names[i]})"

    cdef int classify(self, int i, object obj, CallState *st) except -1:
        """Kind and device of array argument i, without touching its data;
        1 where the view came with them (a torch tensor through torch's
        DLPack C exchange API: st.tensors[i], lo and hi are set), else 0."""
        cdef mmd_tensor *t = &st.tensors[i]
        if cnp.PyArray_Check(obj):
            st.kinds[i] = KIND_NUMPY
            t.device_type = MMD_DEVICE_CPU
            t.device_id = 0
            return 0
        if obj is None:
            if self.array_flags[i] & ARG_OPTIONAL:
                st.kinds[i] = KIND_NONE
                return 0
            raise TypeError(f"{self.where(i)}, expected an array, got None")
        if _is_cupy_array(obj):
            st.kinds[i] = KIND_CUPY
            t.device_type = MMD_DEVICE_CUDA
            t.device_id = obj.data.device_id
            return 0
        if _is_torch_tensor(obj):
            if _torch_view(obj, t):
                st.kinds[i] = KIND_TORCH
                _byte_extent(t, &st.lo[i], &st.hi[i])
                return 1   # viewed already
            if _torch_device(obj, t):
                st.kinds[i] = KIND_TORCH
                return 0
        dlpack_device = getattr(type(obj), "__dlpack_device__", None)
        if dlpack_device is not None:
            st.kinds[i] = KIND_DLPACK
            _read_dlpack_device(self.where(i), dlpack_device, obj, t)
            return 0
        cai = _read_cai(self.where(i), obj)
        if cai is not None:
            st.kinds[i] = KIND_CAI
            t.device_type = MMD_DEVICE_CUDA
            t.device_id = _cai_device(self.where(i), cai)
            return 0
        raise TypeError(
            f"{self.where(i)}, expected an array (numpy, CuPy, or an object with "
            f"__dlpack__ or __cuda_array_interface__), got {type(obj).__name__}")

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef object prepare(self, CallState *st, unsigned int missing=0):
        """Steps 1-4 of a call. Returns the Python kernel to call (with
        st.python_kernel set), or the DLPack capsules that must stay alive
        while the C kernel runs (None when there are none). The outputs of
        bitmask `missing` are left out (prepare_allocating makes them), and
        then every array is viewed, for a Python kernel too."""
        cdef int i, ref = -1
        cdef int n = self.n_arrays
        cdef int device_type, device_id
        cdef unsigned int pending = 0  # bit i: array i still needs its view
        cdef mmd_tensor *t
        st.python_kernel = False
        for i in range(n):
            t = &st.tensors[i]
            if missing >> i & 1u:   # an output to allocate: meets nothing yet
                st.kinds[i] = KIND_NONE
                st.args[i] = NULL
                t.writable = 1
                st.lo[i] = st.hi[i] = 0
                continue
            if mmd_is_exact_ndarray(st.objects[i]):  # the common case, inline
                st.kinds[i] = KIND_NUMPY
                t.device_type = MMD_DEVICE_CPU
                t.device_id = 0
                if not mmd_view_contiguous_numpy(st.objects[i], t, &st.lo[i], &st.hi[i]):
                    pending |= 1u << i  # viewed (or rejected) after the lookup
            elif not self.classify(i, <object>st.objects[i], st) and st.kinds[i] != KIND_NONE:
                pending |= 1u << i   # viewed after the lookup
            if st.kinds[i] == KIND_NONE:
                st.args[i] = NULL
                st.lo[i] = st.hi[i] = 0   # meets no output
                continue
            st.args[i] = t
            if ref < 0:
                ref = i
            elif (t.device_type != st.tensors[ref].device_type
                  or t.device_id != st.tensors[ref].device_id):
                raise DeviceMismatchError(
                    f"{self.where(i)}, inconsistent device: "
                    f"{device_name(t.device_type, t.device_id)} vs "
                    f"{device_name(st.tensors[ref].device_type, st.tensors[ref].device_id)}")
        if ref < 0:
            raise TypeError(f"{self.name}: no array argument was given")
        device_type = st.tensors[ref].device_type
        device_id = st.tensors[ref].device_id
        if not 0 <= device_type < MMD_MAX_DEVICE_TYPES:
            raise self.not_found(device_type, device_id, 0)
        python_kernel = _find_kernel(self, st, device_type, device_id,
                                     mmd_thread_backends()[device_type])
        if st.python_kernel:
            if not missing:   # it takes the arrays themselves
                self.view_for_python(st, pending)
                self.check_outputs(st)
                return python_kernel
            if st.boxed:   # the fallback gets the missing outputs as None
                return python_kernel, None
        elif _device_count[device_type] >= 0 and not 0 <= device_id < _device_count[device_type]:
            raise self.no_such_device(ref, device_type, device_id)
        held = None
        if pending:  # arrays other than plain contiguous numpy ones (sets the stream)
            held = self.view_pending(st, pending, device_type, device_id)
        elif device_type == MMD_DEVICE_CUDA:   # torch tensors viewed by classify
            _cuda_launch_stream(st, self.n_arrays, device_id)
        self.check_outputs(st)
        if not st.python_kernel:
            self.check_data(st)
            if _torch_tensor_type is not None:
                _torch_outputs_checked(self, st)
        if st.c_fallback:   # its first use warns once the call has passed the checks
            _warn_once(<FallbackHandle>python_kernel, self, device_name(device_type, device_id))
        if missing:   # the Python kernel, or the C fallback's handle to hold
            return python_kernel, held
        return held if not st.c_fallback else (held, python_kernel)

    cdef object prepare_allocating(self, CallState *st, unsigned int missing, list held):
        """prepare() for a call whose outputs of bitmask `missing` are None,
        for allocate() to make. Strided inputs are copied to C order (the
        kernels index densely; an array of another library is left to the
        kernel's check). Returns the Python kernel or None, and puts in
        `held` what must stay alive while the kernel runs."""
        cdef int i
        cdef int kind
        python_kernel, capsules = self.prepare(st, missing)
        if st.boxed:
            return python_kernel
        if capsules:
            held.extend(capsules)
        for i in range(self.n_arrays):
            kind = st.kinds[i]
            if (self.array_flags[i] & ARG_OUTPUT or kind == KIND_NONE or kind == KIND_DLPACK
                    or kind == KIND_CAI or mmd_is_contiguous(&st.tensors[i])):
                continue
            obj = <object>st.objects[i]
            try:
                if kind == KIND_NUMPY:
                    copy = np.ascontiguousarray(obj)
                elif kind == KIND_TORCH:
                    copy = obj.contiguous()
                else:
                    with obj.device:
                        copy = obj.copy(order="C")
            except MemoryError as exc:
                raise MemoryError(f"{self.where(i)}, out of memory copying the strided array "
                                  f"to C order: {exc}") from exc
            held.append(copy)
            self.view_new(st, i, copy)
        return python_kernel

    cdef int view_new(self, CallState *st, int i, object array) except -1:
        """Puts `array`, a numpy, CuPy or torch array made by the dispatcher
        (a copy, an allocated output) on the call's device, in place i."""
        cdef mmd_tensor *t = &st.tensors[i]
        st.objects[i] = <PyObject *>array
        st.args[i] = t
        if cnp.PyArray_Check(array):
            st.kinds[i] = KIND_NUMPY
            _intake_numpy(self, i, <cnp.ndarray>array, t)
            t.device_type = MMD_DEVICE_CPU
            t.device_id = 0
        elif _is_torch_tensor(array):
            st.kinds[i] = KIND_TORCH
            if not _torch_view(array, t):
                _torch_device(array, t)
                _intake_torch(self, i, array, t)
        else:
            st.kinds[i] = KIND_CUPY
            t.device_type = MMD_DEVICE_CUDA
            t.device_id = array.data.device_id
            _intake_cupy(self, i, array, t)
        _byte_extent(t, &st.lo[i], &st.hi[i])
        return 0

    cdef object allocate(self, CallState *st, int k, int nd, Py_ssize_t *dims, int dtype,
                         bint zeros):
        """Allocates output k (array index) of shape dims[:nd], like the
        first array, puts it in the call and returns it: torch for torch
        tensors, CuPy for CuPy arrays (and other CUDA arrays), numpy for the
        rest (other CPU arrays get their outputs back through their
        library's from_dlpack); dtype an mmd_dtype code, or -1 for the
        first array's. The common case, numpy, is _allocate's, inline."""
        cdef int kind = st.kinds[0]
        cdef mmd_tensor *src = &st.tensors[0]
        cdef int code = src.dtype if dtype < 0 else dtype
        cdef int typenum = _numpy_typenum[code] if 0 <= code < MMD_NUM_DTYPES else -1
        shape = tuple([dims[d] for d in range(nd)])
        name = self.array_names[k]
        try:
            if kind == KIND_TORCH:
                like = <object>st.objects[0]
                torch_dtype = like.dtype if code == src.dtype else _torch_dtypes[code]
                array = (like.new_zeros if zeros else like.new_empty)(shape, dtype=torch_dtype)
            elif kind == KIND_CUPY or src.device_type != MMD_DEVICE_CPU:
                array = _cupy_allocate(self, name, src, shape, code, zeros)
            elif typenum < 0:
                raise TypeError(f"{self.name}: cannot allocate {name} with numpy: it has no "
                                f"{mmd_dtype_name(code).decode()} dtype")
            else:   # numpy's error for a size it refuses, or the array
                array = (np.zeros if zeros else np.empty)(shape, dtype=_numpy_dtypes[code])
        except MemoryError as exc:
            raise MemoryError(f"{self.name}: out of memory allocating {name} of shape "
                              f"{shape}: {exc}") from exc
        except (ValueError, OverflowError, RuntimeError) as exc:
            if str(exc).startswith(self.name):
                raise
            raise ValueError(f"{self.name}: {name} cannot have shape {shape}: {exc}") from exc
        self.view_new(st, k, array)
        return array

    cdef object view_pending(self, CallState *st, unsigned int pending, int device_type,
                             int device_id):
        """Views the arrays of bitmask `pending` (on the device's stream, for
        DLPack exports); returns the DLPack capsules to keep alive, or None."""
        cdef int i
        held = None
        dlpack_stream = None
        if device_type == MMD_DEVICE_CUDA:
            dlpack_stream = _cuda_launch_stream(st, self.n_arrays, device_id)
        for i in range(self.n_arrays):
            if pending & (1u << i):
                capsule = self.view(st, i, dlpack_stream)
                if capsule is not None:
                    if held is None:
                        held = [capsule]
                    else:
                        held.append(capsule)
        return held

    cdef int view_for_python(self, CallState *st, unsigned int pending) except -1:
        """Views the arrays of bitmask `pending` that need no export (numpy,
        CuPy, torch, __cuda_array_interface__) for a Python kernel's output
        checks: it takes the arrays themselves, so a DLPack-only array (a
        stand-in on a device the dispatcher cannot read) is not exported,
        and one the C layer cannot view (a complex or object dtype, a
        masked array) is not refused; such an array meets nothing in the
        checks and counts as writable."""
        cdef int i
        for i in range(self.n_arrays):
            if not pending & (1u << i):
                continue
            if st.kinds[i] != KIND_DLPACK:
                try:
                    self.view(st, i, None)
                    continue
                except (TypeError, ValueError):   # what only a C kernel refuses (a dtype,
                    pass                          # a layout): the Python kernel's to take
            st.tensors[i].writable = 1
            st.lo[i] = st.hi[i] = 0
        return 0

    cdef object view(self, CallState *st, int i, object dlpack_stream):
        """Views array i by its kind, with its byte extent; returns the
        DLPack capsule to keep alive (a DLPack export), or None."""
        cdef mmd_tensor *t = &st.tensors[i]
        cdef int kind = st.kinds[i]
        capsule = None
        if kind == KIND_NUMPY:
            _intake_numpy(self, i, <cnp.ndarray>st.objects[i], t)
        elif kind == KIND_CUPY:
            _intake_cupy(self, i, <object>st.objects[i], t)
        elif kind == KIND_TORCH:
            _intake_torch(self, i, <object>st.objects[i], t)
        elif kind == KIND_DLPACK:
            capsule = _intake_dlpack(self, i, <object>st.objects[i], dlpack_stream, t)
        else:
            _intake_cai(self, i, <object>st.objects[i], t)
        _byte_extent(t, &st.lo[i], &st.hi[i])
        return capsule

    cdef int check_outputs(self, CallState *st) except -1:
        """Outputs must be writable and must not overlap any other array
        (bounding byte ranges, like numpy.may_share_memory): the fast path's
        test, mmd_find_output_conflict, and its error."""
        cdef int j
        cdef int i = mmd_find_output_conflict(self.n_arrays, self.output_mask, st.tensors, st.lo,
                                              st.hi, &j)
        if i < 0:
            return 0
        if i == j:
            raise ValueError(f"{self.where(i)}, output array is read-only")
        raise ValueError(
            f"{self.where(i)}, output memory overlaps param {self.array_positions[j]} "
            f"({self.array_names[j]}); outputs must not share memory with other arguments")

    cdef int check_data(self, CallState *st) except -1:
        """An array of elements at address 0 (a DLPack export or a
        __cuda_array_interface__ may claim one; numpy and torch arrays
        cannot) is refused before a C kernel reads or writes it there. A
        Python kernel takes the objects themselves (stand-ins included)."""
        cdef int i
        for i in range(self.n_arrays):
            if (st.args[i] != NULL and st.tensors[i].data == NULL
                    and mmd_numel(&st.tensors[i]) != 0):
                raise TypeError(f"{self.where(i)}, the array's data pointer is NULL for "
                                f"{mmd_numel(&st.tensors[i])} elements")
        return 0

    cdef void activate(self, int slot):
        """Makes the newest kernel registered at run time for `slot` the one
        dispatch calls (the built-in C kernel when there is none)."""
        stack = self.runtime_stacks.get(slot)
        cdef KernelHandle top = stack[-1] if stack else None
        self.python_kernels[slot] = top.fn if top is not None and top.c_kernel == NULL else None
        self.runtime_c_kernels[slot] = top.c_kernel if top is not None else NULL

    cdef object no_such_device(self, int ref, int device_type, int device_id):
        """The arrays claim a device index its module does not know (a
        stand-in array, or one from another machine)."""
        type_name = DEVICE_TYPES.get(device_type, f"device{device_type}")
        count = _device_count[device_type]
        existing = ", ".join(f"{type_name}:{d}" for d in range(count)) or "none"
        return ValueError(f"{self.where(ref)}, the arrays are on {type_name}:{device_id}, "
                          f"which does not exist: this machine has {count} {type_name} "
                          f"device(s) ({existing})")

    cdef object not_found(self, int device_type, int device_id, int backend):
        device = device_name(device_type, device_id)
        type_name = DEVICE_TYPES.get(device_type, f"device{device_type}")
        backend_name = _backend_names[backend]
        head = f"{self.name}: implementation for device {device} not found."
        if backend != 0:
            head = (f"{self.name}: implementation for device {device} "
                    f"(backend '{backend_name}') not found.")
        registered = [f"{row['device']}/{row['backend']} ({row['kind']})"
                      for row in registry_table() if row["op"] == self.name]
        lines = [head, "Registered: " + (", ".join(registered) or "nothing") + "."]
        available, status, _ = _device_status.get(device_type, (False, None, None))
        if status is None:
            lines.append(f"mmdispatch has no built-in kernels for {type_name} devices.")
        elif not available:
            lines.append(f"{type_name} slots are empty: {status.rstrip('.')}.")
        else:
            lines.append(f"mmdispatch has no {type_name} kernel for this op and backend "
                         f"'{backend_name}'.")
        lines.append(f"To supply one: mmdispatch.register_impl({self.name!r}, "
                     f"{type_name!r}, fn{'' if backend == 0 else f', backend={backend_name!r}'}).")
        if device_type != MMD_DEVICE_CPU:
            lines.append(f"Or opt in to running the CPU kernels on host copies of the arrays "
                         f"(slow: every call copies its arrays to the host and its outputs "
                         f"back): mmdispatch.register_fallback({type_name!r}, "
                         f"mmdispatch.fallbacks.copy_to_cpu).")
        return KernelNotFoundError(" ".join(lines))

    cdef int raise_kernel_error(self, int status) except -1:
        return _raise_status(self.name, status)


cdef int _raise_status(str prefix, int status) except -1:
    raise _status_error(prefix, status)


cdef object _status_error(str prefix, int status):
    """The one place where kernel status codes become exceptions; the
    message is the calling thread's mmd_error, after `prefix` (the op). A
    deferred error's message names its own op."""
    detail = mmd_last_error().decode('utf-8', 'replace')
    if status == MMD_ERR_DEFERRED:
        return DeferredKernelError(detail)
    message = f"{prefix}: {detail}"
    if status == MMD_ERR_VALUE:
        return ValueError(message)
    if status == MMD_ERR_TYPE:
        return TypeError(message)
    if status == MMD_ERR_MEMORY:
        return MemoryError(message)
    return RuntimeError(message)


cdef OpRegistry _define_op(str name, str signature, void **c_table, const char **c_origin,
                           void *boxed_kernel, tuple param_names, tuple positions, tuple flags):
    cdef OpRegistry op = OpRegistry.__new__(OpRegistry)
    cdef int i
    op.name = name
    op.name_bytes = name.encode()
    op.c_name = op.name_bytes
    op.signature = signature
    op.param_names = param_names
    op.array_names = tuple(param_names[p] for p in positions)
    op.c_table = c_table
    op.c_origin = c_origin
    op.boxed_kernel = boxed_kernel
    op.python_kernels = [None] * MMD_TABLE_SIZE
    op.runtime_stacks = {}
    op.n_arrays = len(positions)
    op.output_mask = 0
    for i in range(op.n_arrays):
        op.array_positions[i] = positions[i]
        op.array_flags[i] = flags[i]
        if flags[i] & ARG_OUTPUT:
            op.output_mask |= 1u << i
    _ops[name] = op
    return op


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline object _find_kernel(OpRegistry op, CallState *st, int device_type, int device_id,
                                int backend):
    """Step 3 of a call: the Python kernel for the slot (returned, with
    st.python_kernel set), else its C kernel in st.kernel with st.ctx set for
    the device (None returned), else the device's fallback: a C one through
    the op's boxing function as st.kernel (st.c_fallback set, its function
    in st.ctx.fallback, its handle returned for the caller to hold during
    the call and to warn with once the outputs pass their checks), a
    Python one as the Python kernel (st.boxed set too); else
    KernelNotFoundError."""
    cdef int slot = device_type * MMD_MAX_BACKENDS + backend
    cdef FallbackHandle c_fallback = None
    st.boxed = st.c_fallback = False
    st.ctx.fallback = NULL
    python_kernel = op.python_kernels[slot]
    if python_kernel is not None:
        st.python_kernel = True
        return python_kernel
    st.python_kernel = False
    st.kernel = op.runtime_c_kernels[slot]
    if st.kernel == NULL:
        st.kernel = op.c_table[slot]
    if st.kernel == NULL:
        st.kernel = _kernel_after_probe(op, slot, device_type, device_id, backend)
        if st.kernel == NULL:   # the slot is empty: the device's fallback takes the call
            c_fallback = _c_fallback(device_type)
            if c_fallback is None:
                st.python_kernel = st.boxed = True
                return _boxed_kernel(op, device_type, device_id)
            st.kernel = op.boxed_kernel
            st.ctx.fallback = <void *>c_fallback.c_fn
            st.c_fallback = True
    st.ctx.device_id = device_id
    st.ctx.stream = NULL
    st.ctx.flags = _context_flags()
    st.ctx.op = op.c_name
    return c_fallback


cdef inline object _plain_numpy_kernel(OpRegistry op, CallState *st):
    """prepare() after mmd_intake_plain_numpy took every array (so the device
    is the CPU): only the kernel lookup is left. Inline in every entry point."""
    found = _find_kernel(op, st, MMD_DEVICE_CPU, 0,
                         mmd_thread_backends()[MMD_DEVICE_CPU] if _any_backend_selected else 0)
    if st.c_fallback:   # the intake has checked the outputs
        _warn_once(<FallbackHandle>found, op, "cpu")
    return found


# Scalar arguments: converted before dispatch; errors name the parameter.
cdef extern from "Python.h":
    long long _as_long_long "PyLong_AsLongLongAndOverflow"(object value, int *overflow) noexcept


cdef inline int64_t _int_arg(OpRegistry op, int pos, object value) except? -1:
    cdef int64_t result
    if type(value) is int and mmd_compact_int(value, &result):  # the common case, inline
        return result
    return _int_arg_slow(op, pos, value)


cdef int64_t _int_arg_slow(OpRegistry op, int pos, object value) except? -1:
    cdef long long result
    cdef int overflow
    if type(value) is not int:
        if isinstance(value, np.bool_):   # as True and False are taken
            return int(value)
        try:  # runs the caller's __index__, which may refuse or fail
            value = operator.index(value)
        except TypeError as exc:
            raise TypeError(f"{op.name}: at param {pos} ({op.param_names[pos]}), expected an "
                            f"int, got {type(value).__name__}{_index_said(value, exc)}") from exc
        except Exception as exc:
            raise TypeError(f"{op.name}: at param {pos} ({op.param_names[pos]}), expected an "
                            f"int, got {type(value).__name__} (its __index__ raised "
                            f"{type(exc).__name__}: {exc})") from exc
    result = _as_long_long(value, &overflow)  # an exact int: cannot fail otherwise
    if overflow:
        raise ValueError(f"{op.name}: at param {pos} ({op.param_names[pos]}), {value} does "
                         "not fit in int64")
    return result


cdef str _index_said(object value, object exc):
    """What the caller's own __index__ said when it raised TypeError (or
    returned a non-int, which operator.index reports so), for the op's
    message; nothing for a type without __index__."""
    if getattr(type(value), "__index__", None) is None:
        return ""
    return f" (its __index__: {exc})"


cdef inline double _float_arg(OpRegistry op, int pos, object value) except? -1.0:
    if type(value) is float:  # the common case, inline
        return value
    return _float_arg_slow(op, pos, value)


cdef double _float_arg_slow(OpRegistry op, int pos, object value) except? -1.0:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{op.name}: at param {pos} ({op.param_names[pos]}), expected a "
                        f"real number, got {type(value).__name__}")
    try:  # runs the caller's __float__, which may refuse or overflow
        return float(value)
    except OverflowError:
        raise ValueError(f"{op.name}: at param {pos} ({op.param_names[pos]}), {value!r:.60} "
                         "is beyond the float range") from None
    except Exception as exc:
        raise TypeError(f"{op.name}: at param {pos} ({op.param_names[pos]}), expected a "
                        f"real number, got {type(value).__name__} ({exc})") from exc


cdef inline int _bool_arg(OpRegistry op, int pos, object value) except -1:
    if value is True or value is False:  # the common case, inline
        return value is True
    return _bool_arg_slow(op, pos, value)


cdef int _bool_arg_slow(OpRegistry op, int pos, object value) except -1:
    try:  # runs the caller's __index__, which may refuse or fail
        return operator.index(value) != 0
    except TypeError as exc:
        if isinstance(value, np.bool_):  # numpy booleans have no __index__
            return bool(value)
        raise TypeError(f"{op.name}: at param {pos} ({op.param_names[pos]}), expected a "
                        f"bool, got {type(value).__name__}{_index_said(value, exc)}") from exc
    except Exception as exc:
        raise TypeError(f"{op.name}: at param {pos} ({op.param_names[pos]}), expected a "
                        f"bool, got {type(value).__name__} (its __index__ raised "
                        f"{type(exc).__name__}: {exc})") from exc


# Helpers of the generated allocating calls (_codegen._allocating_call).
# mmd_dtype code -> numpy dtype and type number (-1: numpy has none)
cdef dict _numpy_dtypes = {}
cdef int _numpy_typenum[MMD_NUM_DTYPES]
# mmd_dtype code -> a (0,) numpy array of that dtype: the (0,) outputs of
# allocating calls (roi_align's argmax pair in avg mode) share it, as a (0,)
# output has no element to write.
cdef list _numpy_unused = [None] * MMD_NUM_DTYPES
for _code in range(MMD_NUM_DTYPES):
    _numpy_typenum[_code] = -1
for _code, _name in [(MMD_BOOL, "bool"), (MMD_INT8, "int8"), (MMD_INT16, "int16"),
                     (MMD_INT32, "int32"), (MMD_INT64, "int64"), (MMD_UINT8, "uint8"),
                     (MMD_UINT16, "uint16"), (MMD_UINT32, "uint32"), (MMD_UINT64, "uint64"),
                     (MMD_FLOAT16, "float16"), (MMD_FLOAT32, "float32"),
                     (MMD_FLOAT64, "float64")]:
    _numpy_dtypes[_code] = np.dtype(_name)
    _numpy_typenum[_code] = np.dtype(_name).num
    _numpy_unused[_code] = np.empty((0,), _name)


cdef inline int64_t _dim(const mmd_tensor *t, int d) noexcept:
    """Size d of a view, 0 past its last axis (the kernel's checks then name
    the array of the wrong rank)."""
    return t.shape[d] if d < t.ndim else 0


cdef inline Py_ssize_t _size(int64_t value) noexcept:
    """A computed size; negative ones become 0 (the kernel's checks say why)."""
    return <Py_ssize_t>value if value > 0 else 0


cdef inline int64_t _floordiv(int64_t a, int64_t b) noexcept:
    """a // b rounded down as Python does; 0 where b is 0."""
    if b == 0:
        return 0
    cdef int64_t q = a / b
    if (a % b != 0) and ((a < 0) != (b < 0)):
        q -= 1
    return q


cdef extern from *:
    """
    /* numpy.empty / numpy.zeros of a built-in type number, or NULL with an
       error set. */
    static inline PyObject *mmd_numpy_new(int nd, Py_ssize_t *dims, int typenum, int zeros) {
        return zeros ? PyArray_ZEROS(nd, (npy_intp *)dims, typenum, 0)
                     : PyArray_EMPTY(nd, (npy_intp *)dims, typenum, 0);
    }
    static inline PyObject *mmd_steal(PyObject *obj) { return obj; }
    """
    PyObject *_numpy_new "mmd_numpy_new"(int nd, Py_ssize_t *dims, int typenum,
                                         int zeros) noexcept
    object _steal "mmd_steal"(PyObject *obj)


cdef inline object _allocate(OpRegistry op, CallState *st, int k, int nd, Py_ssize_t *dims,
                             int dtype, bint zeros):
    """OpRegistry.allocate, with its common case inline: a numpy output
    like a numpy array, (0,) ones shared per dtype (a (0,) output has no
    element to write: roi_align's argmax pair in avg mode)."""
    cdef int code = st.tensors[0].dtype if dtype < 0 else dtype
    cdef mmd_tensor *t = &st.tensors[k]
    cdef PyObject *made = NULL
    if st.kinds[0] == KIND_NUMPY and 0 <= code < MMD_NUM_DTYPES and _numpy_typenum[code] >= 0:
        if nd == 1 and dims[0] == 0:
            made = PyList_GET_ITEM(_numpy_unused, code)
            Py_INCREF(<object>made)
        elif _fits(nd, dims):
            made = _numpy_new(nd, dims, _numpy_typenum[code], zeros)
            if made == NULL:
                PyErr_Clear()   # allocate() tries again and raises the error
        if made != NULL:
            mmd_view_contiguous_numpy(made, t, &st.lo[k], &st.hi[k])
            t.device_type = MMD_DEVICE_CPU
            t.device_id = 0
            st.objects[k] = made
            st.kinds[k] = KIND_NUMPY
            st.args[k] = t
            return <object>_steal(made)
    return op.allocate(st, k, nd, dims, dtype, zeros)


cdef inline bint _fits(int nd, const Py_ssize_t *dims) noexcept:
    """Whether an array of shape dims[:nd] has fewer than 2**62 bytes (so
    numpy's C allocation takes it; larger ones take the path with errors)."""
    cdef int d
    cdef uint64_t total = 8
    for d in range(nd):
        if dims[d] and total > (<uint64_t>1 << 62) // <uint64_t>dims[d]:
            return False
        total *= <uint64_t>dims[d]
    return True


cdef inline int _copy_shape(const mmd_tensor *t, Py_ssize_t *dims) noexcept:
    cdef int d
    for d in range(t.ndim):
        dims[d] = <Py_ssize_t>t.shape[d]
    return t.ndim


cdef object _length(object counts):
    """counts[0] as an int: the length of a trimmed output (a read back from
    the device for a CUDA array)."""
    if cnp.PyArray_CheckExact(counts) and cnp.PyArray_TYPE(<cnp.ndarray>counts) == cnp.NPY_INT64:
        return (<int64_t *>cnp.PyArray_DATA(<cnp.ndarray>counts))[0]
    return int(counts[0])


cdef object _results(int kind, object like, object results):
    """An allocating call's outputs, in the library of the first array:
    numpy, CuPy and torch arrays as they are, other arrays' outputs through
    their library's from_dlpack where it has one."""
    if kind != KIND_DLPACK and kind != KIND_CAI:
        return results
    if type(results) is tuple:
        return tuple([_in_library_of(like, r) for r in results])
    return _in_library_of(like, results)


def _in_library_of(original, result):
    """result (numpy/CuPy) as an array of original's library, zero-copy."""
    get_namespace = getattr(original, "__array_namespace__", None)
    library = get_namespace() if get_namespace is not None else sys.modules.get(
        type(original).__module__.partition(".")[0])
    from_dlpack = getattr(library, "from_dlpack", None)
    return from_dlpack(result) if from_dlpack is not None else result


# What _cupy_allocate knows of the CuPy module it last used (both forgotten
# when another module is imported as cupy: a test's stand-in): the CUDA
# devices it reported (0 until asked; asked again for a device id beyond
# it, so a bad id is still an error), and shared (0,) outputs per (device,
# dtype), as _numpy_unused. On an H100 host each cupy.empty costs 4.3 us,
# getDeviceCount and a device switch about as much, so a tiny roi_align
# call (three outputs, two of them (0,)) paid 27 us. Its calls are looked
# up once per module: cupy.ndarray (all that cupy.empty does, behind a
# Python frame of its own), cupy.zeros and cupy.cuda.runtime.getDevice.
cdef object _cupy_module = None
cdef object _cupy_new = None
cdef object _cupy_zeros = None
cdef object _cupy_current_device = None
cdef int _cupy_device_count = 0
cdef dict _cupy_unused = {}


cdef object _cupy_allocate(OpRegistry op, str name, const mmd_tensor *src, tuple shape,
                           int code, bint zeros):
    """An output on src's CUDA device, with CuPy (imported if need be): a
    shared one for a (0,) shape, which has no element to write."""
    global _cupy_module, _cupy_new, _cupy_zeros, _cupy_current_device, _cupy_device_count
    if src.device_type != MMD_DEVICE_CUDA:
        raise TypeError(f"{op.name}: cannot allocate {name} on "
                        f"{device_name(src.device_type, src.device_id)}: the entry points "
                        f"allocate with numpy (CPU), torch or CuPy (CUDA); pass the outputs")
    try:
        import cupy
    except ImportError:
        raise TypeError(f"{op.name}: cannot allocate {name} like a CUDA array of another "
                        "library without CuPy; install CuPy or pass the outputs") from None
    typenum = _numpy_typenum[code] if 0 <= code < MMD_NUM_DTYPES else -1
    if typenum < 0:
        raise TypeError(f"{op.name}: cannot allocate {name} with CuPy: it has no "
                        f"{mmd_dtype_name(code).decode()} dtype")
    cdef int device = src.device_id
    if cupy is not _cupy_module:
        _cupy_new, _cupy_zeros = cupy.ndarray, cupy.zeros
        _cupy_current_device = cupy.cuda.runtime.getDevice
        _cupy_module, _cupy_device_count = cupy, 0
        _cupy_unused.clear()
    if not 0 <= device < _cupy_device_count:
        count = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= device < count:
            raise ValueError(f"{op.name}: the arrays are on cuda:{device}, which does not "
                             f"exist: this machine has {count} CUDA device(s)")
        _cupy_device_count = count
    unused = shape == (0,)
    if unused:
        array = _cupy_unused.get((device, code))
        if array is not None:
            return array
    make = _cupy_zeros if zeros else _cupy_new
    if _cupy_current_device() == device:   # no switch and back
        array = make(shape, dtype=_numpy_dtypes[code])
    else:
        with cupy.cuda.Device(device):
            array = make(shape, dtype=_numpy_dtypes[code])
    if unused:
        _cupy_unused[(device, code)] = array
    return array


include "_layers.pxi"
include "_dispatch_gen.pxi"


cdef bint _probe_device(int device_type) except -1:
    """Registers the built-in kernels of `device_type`'s module the first
    time that device type is needed (the CUDA module asks the driver for
    devices then, not at import). True when the registration ran now."""
    cdef int count, i, found
    cdef char status[1024]
    cdef const mmd_device_module *modules
    if not 0 <= device_type < MMD_MAX_DEVICE_TYPES or _device_probed[device_type]:
        return False
    with _registry_lock:
        if _device_probed[device_type]:
            return False
        modules = mmd_get_device_modules(&count)
        for i in range(count):
            if modules[i].device_type == device_type:
                status[0] = 0
                found = 0
                rc = modules[i].register_fn(status, sizeof(status), &found)
                _device_count[device_type] = found if rc == 0 else -1
                _device_status[device_type] = (
                    rc == 0, status.decode("utf-8", "replace"), modules[i].name.decode())
        _device_probed[device_type] = True
    return True


cdef int _probe_all_devices() except -1:
    cdef int count, i
    cdef const mmd_device_module *modules = mmd_get_device_modules(&count)
    for i in range(count):
        _probe_device(modules[i].device_type)
    return 0


cdef void *_kernel_after_probe(OpRegistry op, int slot, int device_type, int device_id,
                               int backend) except? NULL:
    """An empty slot on the first call for a device type: the device module
    registers now, and the slot is read again; else NULL where the device
    has a fallback, else KernelNotFoundError."""
    cdef void *kernel = NULL
    if _probe_device(device_type):
        kernel = op.runtime_c_kernels[slot]
        if kernel == NULL:
            kernel = op.c_table[slot]
    if kernel == NULL and _active_fallbacks[device_type] is None:
        raise op.not_found(device_type, device_id, backend)
    return kernel


_probe_device(MMD_DEVICE_CPU)
