# The layers around a kernel call, besides the device table: boxed fallbacks
# for empty slots, and hooks that see every dispatched call.
#
# Order within one call (fixed):
#   1. intake checks (arrays, devices, writable outputs overlapping no
#      other argument), then kernel selection: the slot of (device type,
#      the thread's backend): a Python kernel, else a C kernel, else the
#      device's fallback (register_fallback), else KernelNotFoundError;
#   2. hooks' begin(call), in the order they were added;
#   3. the kernel (or the fallback), whose own checks of shapes, dtypes,
#      scalars and rois come first;
#   4. hooks' end(call), in reverse order, also when the kernel raised.
# Hooks come after selection because they observe: the record names the
# backend and kind of kernel that really runs (a fallback included). A call
# refused at intake or with no kernel never reaches one, so hooks do not
# see it; one refused by the kernel's own checks ends with call.error set.
#
# Hooks are process-wide (a hook added in one thread sees the calls of every
# thread). The exclusion guard is per thread: the calls a hook makes from
# its begin/end, and the calls a fallback makes to run the op, are not
# shown to hooks. With no hook added, a call pays one test of _hooks_on.

from cpython.pythread cimport PyThread_get_thread_ident

import warnings


class FallbackWarning(UserWarning):
    """An op ran through its device's fallback (register_fallback) instead
    of a kernel of that device. Warned once per op and device."""


cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clock, timespec *ts)
    enum:
        CLOCK_MONOTONIC


cdef inline int64_t _now_ns() noexcept nogil:
    """time.perf_counter_ns()'s clock on Linux (CLOCK_MONOTONIC), from C."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


# ---------------------------------------------------------------- fallbacks

# device type -> the active FallbackHandle, or None; and every registered
# one, newest (active) last. Changed under _registry_lock.
cdef list _active_fallbacks = [None] * MMD_MAX_DEVICE_TYPES
cdef dict _fallback_stacks = {}


cdef class FallbackHandle:
    """Returned by register_fallback; ``remove()`` (or leaving a ``with``
    block) unregisters the fallback and restores the one it replaced.
    ``kind``: "python" for a callable, "C" for a capsule."""
    cdef readonly str device
    cdef readonly object fn
    cdef readonly str origin
    cdef readonly str kind
    cdef readonly object cost   # what its FallbackWarning names, or None
    cdef int code
    cdef mmd_boxed_fn c_fn   # a C fallback's function, else NULL
    cdef set warned   # (op, device) pairs this fallback has warned about

    def remove(self):
        """Unregisters this fallback; calling it again does nothing."""
        with _registry_lock:
            stack = _fallback_stacks.get(self.code)
            if stack is None or self not in stack:
                return
            stack.remove(self)
            if not stack:
                del _fallback_stacks[self.code]
            _active_fallbacks[self.code] = stack[-1] if stack else None

    @property
    def active(self):
        """True while this fallback is the one its device's empty slots use."""
        return _active_fallbacks[self.code] is self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def __repr__(self):
        return f"<FallbackHandle {self.device} {self.origin}>"


def register_fallback(device, fn, *, bint override=False, cost=None):
    """Installs ``fn`` as the fallback of a device type: it is called for any
    op whose slot on that device (for the thread's backend) is empty, as
    ``fn(op_name, call)`` with ``call`` a BoxedCall (the arrays by name with
    their devices, the scalars by name), and returns what the op's entry
    point returns. mmdispatch.fallbacks.copy_to_cpu is a ready one.

    ``fn`` may instead be a C function: a PyCapsule named
    "mmdispatch.boxed_fallback" holding an ``mmd_boxed_fn`` (see
    include/mmdispatch/boxed.h). The dispatcher then views and checks the
    arrays as for a kernel, allocates the outputs left as None where it can,
    and calls it without the GIL with the arguments boxed as C values.

    Nothing falls back unless registered. The first call of each op on
    each device through it warns (FallbackWarning), naming its cost:
    ``cost`` (a string) where given, else the fallback's ``cost`` attribute
    where it has one (a capsule has none). Registering where a
    fallback is raises ValueError unless ``override=True``; the returned
    handle's ``remove()`` restores the previous one."""
    cdef int code = parse_device_type(device)
    cdef FallbackHandle handle
    cdef bint is_capsule = PyCapsule_CheckExact(fn)
    cdef void *c_fn = NULL
    if is_capsule:
        if not PyCapsule_IsValid(fn, _BOXED_FALLBACK_NAME):
            raise TypeError(f"register_fallback: a C fallback capsule must be named "
                            f"{_BOXED_FALLBACK_NAME.decode()!r}, got "
                            f"{(PyCapsule_GetName(fn) or b'').decode(errors='replace')!r}")
        c_fn = PyCapsule_GetPointer(fn, _BOXED_FALLBACK_NAME)
    elif not callable(fn):
        raise TypeError(f"register_fallback: fn must be callable or a C fallback capsule, got "
                        f"{type(fn).__name__}")
    if cost is None:
        cost = getattr(fn, "cost", None)
    if cost is not None and not isinstance(cost, str):
        raise TypeError(f"register_fallback: cost must be a string, got {type(cost).__name__}")
    _probe_device(code)   # built-in kernels fill their slots first
    with _registry_lock:
        stack = _fallback_stacks.get(code)
        if stack and not override:
            raise ValueError(f"register_fallback: {DEVICE_TYPES.get(code, code)} already has a "
                             f"fallback ({stack[-1].origin}); pass override=True to replace it")
        handle = FallbackHandle.__new__(FallbackHandle)
        handle.device = DEVICE_TYPES.get(code, str(code))
        handle.fn = fn
        handle.kind = "C" if is_capsule else "python"
        handle.cost = cost
        handle.origin = (f"capsule:{_BOXED_FALLBACK_NAME.decode()} at {<uintptr_t>c_fn:#x}"
                         if is_capsule else _origin_of(fn))
        handle.code = code
        handle.c_fn = <mmd_boxed_fn>c_fn
        handle.warned = set()
        _fallback_stacks.setdefault(code, []).append(handle)
        _active_fallbacks[code] = handle
    return handle


cdef bytes _BOXED_FALLBACK_NAME = b"mmdispatch.boxed_fallback"   # boxed.h's capsule name


cdef inline FallbackHandle _c_fallback(int device_type):
    """The device type's active fallback where it is a C one, else None."""
    cdef FallbackHandle handle = _active_fallbacks[device_type]
    return handle if handle is not None and handle.c_fn != NULL else None


def _remove_fallbacks(device):
    """Unregisters every fallback of a device type (the tests' clean-up)."""
    cdef int code = parse_device_type(device)
    with _registry_lock:
        _fallback_stacks.pop(code, None)
        _active_fallbacks[code] = None


def registered_fallbacks():
    """{device type name: origin of its active fallback}."""
    return {handle.device: handle.origin for handle in _active_fallbacks if handle is not None}


cdef dict _signature_cache = {}


cdef tuple _op_outputs(OpRegistry op):
    """(output names, names an allocating call returns, {output: its length
    array}, names of the outputs an allocation line can make) of an op,
    from its signature; computed once per op."""
    cached = _signature_cache.get(op.name)
    if cached is None:
        from mmdispatch._codegen import parse_signature
        sig = parse_signature(op.signature)
        outputs = tuple(p.name for p in sig.params if p.is_output)
        lengths = {p.name: p.length for p in sig.params if p.is_output and p.length}
        returns = tuple(name for name in outputs if name not in lengths.values())
        cached = _signature_cache[op.name] = (
            outputs, returns, lengths, tuple(a.name for a in sig.allocations))
    return cached


cdef class BoxedCall:
    """One call of an op, boxed, as a fallback receives it.

    - ``op``: the entry point's name; ``device``: the arrays' device
      (``"rocm:0"``);
    - ``arrays``: {name: array or None} for every array parameter, in
      order (None: an absent optional input, or an output the caller left
      for the entry point to allocate); ``devices``: {name: device};
    - ``scalars``: {name: value as the caller passed it};
    - ``outputs``: the output parameters; ``returns``: what the entry point
      returns when it allocates (``allocating``), in order; ``lengths``:
      {output: the array holding its length} (nms's keep[:num_kept]).

    ``redispatch(arrays)`` calls the op's entry point with some arrays
    replaced (e.g. by host copies) and the same scalars: the fallback's way
    to run another device's kernel. Hooks do not see that call."""
    cdef readonly str op
    cdef readonly str device
    cdef readonly dict arrays
    cdef readonly dict devices
    cdef readonly dict scalars
    cdef readonly tuple outputs
    cdef readonly tuple returns
    cdef readonly dict lengths
    cdef readonly bint allocating
    cdef OpRegistry registry

    def redispatch(self, arrays=None):
        """The entry point's result for the same call with the arrays named
        in ``arrays`` replaced."""
        values = dict(self.arrays)
        values.update(self.scalars)
        if arrays:
            unknown = set(arrays) - set(self.arrays)
            if unknown:
                raise ValueError(f"{self.op}: redispatch got unknown arrays {sorted(unknown)}")
            values.update(arrays)
        entry = getattr(sys.modules[__name__], self.op)
        return entry(*[values[name] for name in self.registry.param_names])

    def __repr__(self):
        return f"<BoxedCall {self.op} on {self.device}>"


cdef class _BoxedKernel:
    """The Python kernel dispatch calls for an empty slot whose device has
    a fallback: boxes the call and hands it to the fallback, warning once
    per op and device."""
    cdef OpRegistry op
    cdef FallbackHandle handle
    cdef str device

    def __call__(self, *args):
        cdef OpRegistry op = self.op
        cdef int *guard
        cdef int i
        cdef BoxedCall call = BoxedCall.__new__(BoxedCall)
        outputs, returns, lengths, allocated = _op_outputs(op)
        call.op = op.name
        call.device = self.device
        call.registry = op
        call.arrays = {name: args[op.array_positions[i]] for i, name in enumerate(op.array_names)}
        call.devices = {name: (None if array is None else self.device)
                        for name, array in call.arrays.items()}
        arrays = set(op.array_names)
        call.scalars = {name: value for name, value in zip(op.param_names, args)
                        if name not in arrays}
        call.outputs = outputs
        call.allocating = any(call.arrays[name] is None for name in allocated)
        call.returns = returns if call.allocating else ()
        call.lengths = lengths
        _warn_once(self.handle, op, self.device)
        guard = mmd_thread_hook_guard()
        guard[0] += 1   # the fallback's own calls are not shown to hooks
        try:
            return self.handle.fn(op.name, call)
        finally:
            guard[0] -= 1


cdef int _warn_once(FallbackHandle handle, OpRegistry op, str device) except -1:
    """The FallbackWarning of the first call of an op on a device through
    `handle`."""
    key = (op.name, device)
    if key in handle.warned:
        return 0
    handle.warned.add(key)
    cost = handle.cost or f"each call goes through {handle.origin} instead of a kernel"
    warnings.warn(f"{op.name}: no kernel for {device}; running it through the "
                  f"{handle.device} fallback, which costs: {cost}",
                  FallbackWarning, stacklevel=_caller_stacklevel())
    return 0


cdef int _caller_stacklevel():
    """warnings.warn's stacklevel of the first frame outside mmdispatch (the
    Cython code has no frames of its own)."""
    cdef int level = 1
    try:
        frame = sys._getframe(0)
    except ValueError:   # called from C, with no Python frame at all
        return 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == \
            "mmdispatch":
        frame = frame.f_back
        level += 1
    return level


cdef object _boxed_kernel(OpRegistry op, int device_type, int device_id):
    cdef _BoxedKernel kernel = _BoxedKernel.__new__(_BoxedKernel)
    kernel.op = op
    kernel.handle = _active_fallbacks[device_type]
    kernel.device = device_name(device_type, device_id)
    return kernel


# -------------------------------------------------------------------- hooks

# Whether any hook is added: the one test a call pays without hooks. The
# hooks themselves, in the order added, as a tuple (a call iterates over the
# tuple it read, so adding or removing one from another thread is safe), and
# their bound begin and end methods, looked up once.
cdef bint _hooks_on = False
cdef tuple _hook_list = ()
cdef tuple _hook_begins = ()
cdef tuple _hook_ends = ()


cdef class HookHandle:
    """Returned by add_hook (and trace); ``remove()`` (or leaving a
    ``with`` block) removes the hook. A call that began before the removal
    still ends in it."""
    cdef readonly object hook

    def remove(self):
        """Removes the hook; calling it again does nothing."""
        _remove_hook(self.hook)

    @property
    def active(self):
        return any(h is self.hook for h in _hook_list)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def __repr__(self):
        return f"<HookHandle {self.hook!r}>"


def add_hook(hook):
    """Adds a hook: an object with ``begin(call)`` and ``end(call)``
    methods, which every dispatched call, in every thread, passes through
    (``call`` a CallRecord): begin just before the kernel, end just after,
    also when the kernel raised (``call.error``). Hooks run in the order
    added; their ends in reverse. A hook's own calls, and a fallback's, are
    not shown to hooks. An exception from a hook propagates from the op's
    call (begin: the kernel does not run) after every hook that began has
    ended. Returns a HookHandle."""
    if not callable(getattr(hook, "begin", None)) or not callable(getattr(hook, "end", None)):
        raise TypeError(f"add_hook: a hook needs begin(call) and end(call) methods, got "
                        f"{type(hook).__name__}")
    cdef HookHandle handle = HookHandle.__new__(HookHandle)
    handle.hook = hook
    with _registry_lock:
        if any(h is hook for h in _hook_list):
            raise ValueError(f"add_hook: {hook!r} is already added")
        _set_hooks(_hook_list + (hook,))
    return handle


cdef _set_hooks(tuple hooks):
    global _hook_list, _hook_begins, _hook_ends, _hooks_on
    _hook_begins = tuple([hook.begin for hook in hooks])
    _hook_ends = tuple([hook.end for hook in hooks])
    _hook_list = hooks
    _hooks_on = len(hooks) > 0


def _remove_hook(hook):
    with _registry_lock:
        _set_hooks(tuple([h for h in _hook_list if h is not hook]))


def hooks():
    """The hooks added, in the order they run."""
    return list(_hook_list)


class _Tracer:
    """The hook of trace(): callback("begin", call) and callback("end", call)."""

    def __init__(self, callback):
        self.callback = callback

    def begin(self, call):
        self.callback("begin", call)

    def end(self, call):
        self.callback("end", call)

    def __repr__(self):
        return f"<trace {_origin_of(self.callback)}>"


def trace(callback):
    """Calls ``callback("begin", call)`` before and ``callback("end",
    call)`` after every dispatched call (``call`` a CallRecord), until the
    returned HookHandle is removed or its ``with`` block ends."""
    if not callable(callback):
        raise TypeError(f"trace: callback must be callable, got {type(callback).__name__}")
    return add_hook(_Tracer(callback))


cdef class CallRecord:
    """One dispatched call, as hooks see it.

    - ``op``, ``device`` (``"cuda:0"``), ``backend`` (the thread's backend
      for the device), ``kernel`` ("C", "python" or "fallback");
    - ``names``, ``dtypes``, ``shapes``: per array parameter (None where an
      optional input is absent, or an output the fallback allocates);
    - ``scalars``: {name: value}, while the call runs (from begin to end);
    - ``thread``: threading.get_ident() of the caller; ``start_ns``,
      ``end_ns``: time.perf_counter_ns() around the kernel (after the begin
      hooks, before the end hooks); ``host_ns`` their difference;
    - ``stream``: the CUDA stream the kernel launches on (an int), or None;
    - ``error``: the exception the kernel (or a begin hook) raised, or None;
    - ``notes``: a dict free for hooks (the profiler's CUDA events)."""
    cdef readonly str op
    cdef readonly str device
    cdef readonly str backend
    cdef readonly str kernel
    cdef readonly tuple names
    cdef readonly unsigned long thread
    cdef readonly int64_t start_ns
    cdef readonly int64_t end_ns
    cdef readonly object stream
    cdef readonly object error
    cdef dict _notes
    cdef object _args        # the call's arguments, until end
    cdef tuple _param_names
    cdef tuple _ends          # the end methods of the hooks that began
    cdef int n
    cdef bint from_views      # shapes and dtypes were copied from the views
    cdef int ndims[MAX_ARRAY_ARGS]    # -1: absent
    cdef int dtype_codes[MAX_ARRAY_ARGS]
    cdef int64_t dims[MAX_ARRAY_ARGS][MMD_MAX_NDIM]
    cdef tuple _py_shapes     # when not from_views
    cdef tuple _py_dtypes

    @property
    def host_ns(self):
        return self.end_ns - self.start_ns

    @property
    def notes(self):
        if self._notes is None:
            self._notes = {}
        return self._notes

    @property
    def shapes(self):
        cdef int i
        if not self.from_views:
            return self._py_shapes
        return tuple([None if self.ndims[i] < 0 else
                      tuple([self.dims[i][d] for d in range(self.ndims[i])])
                      for i in range(self.n)])

    @property
    def dtypes(self):
        cdef int i
        if not self.from_views:
            return self._py_dtypes
        return tuple([None if self.ndims[i] < 0 else mmd_dtype_name(self.dtype_codes[i]).decode()
                      for i in range(self.n)])

    @property
    def scalars(self):
        """The scalar arguments by name; None once the call has ended (the
        record keeps no reference to the call's arguments)."""
        if self._args is None:
            return None
        names = set(self.names)
        return {name: value for name, value in zip(self._param_names, self._args)
                if name not in names}

    def __repr__(self):
        return f"<CallRecord {self.op} {self.device}/{self.backend} {self.kernel}>"


cdef object _hook_begin(OpRegistry op, CallState *st, tuple args):
    """Step 2 of a hooked call: a CallRecord after every hook's begin, or
    None where this thread's calls are hidden from hooks (the caller then
    runs the kernel as without hooks)."""
    cdef int *guard = mmd_thread_hook_guard()
    cdef tuple begins = _hook_begins
    cdef tuple ends = _hook_ends
    cdef CallRecord record
    cdef const mmd_tensor *t
    cdef int i, d, ref = -1
    cdef Py_ssize_t begun = 0
    if guard[0] > 0 or not begins:
        return None
    record = CallRecord.__new__(CallRecord)
    record.op = op.name
    record.names = op.array_names
    record._param_names = op.param_names
    record._args = args
    record.n = op.n_arrays
    record.thread = PyThread_get_thread_ident()
    record.kernel = ("fallback" if st.boxed or st.c_fallback
                     else "python" if st.python_kernel else "C")
    # The views exist for every C kernel call and every allocating one;
    # a Python kernel's arrays may not have been viewed.
    record.from_views = not st.python_kernel
    for i in range(op.n_arrays):
        if st.args[i] != NULL and ref < 0:
            ref = i
    if ref >= 0:
        t = &st.tensors[ref]
        record.device = "cpu" if t.device_type == MMD_DEVICE_CPU else device_name(
            t.device_type, t.device_id)
        record.backend = _backend_names[mmd_thread_backends()[t.device_type]
                                        if _any_backend_selected else 0]
        if t.device_type == MMD_DEVICE_CUDA and not st.python_kernel:
            record.stream = <uintptr_t>st.ctx.stream
    if record.from_views:
        for i in range(op.n_arrays):
            t = st.args[i]
            if t == NULL:
                record.ndims[i] = -1
                continue
            record.ndims[i] = t.ndim
            record.dtype_codes[i] = t.dtype
            for d in range(t.ndim):
                record.dims[i][d] = t.shape[d]
    else:
        arrays = [args[op.array_positions[i]] for i in range(op.n_arrays)]
        record._py_shapes = tuple([None if a is None else tuple(getattr(a, "shape", ()))
                                   for a in arrays])
        record._py_dtypes = tuple([None if a is None else str(getattr(a, "dtype", "?"))
                                   for a in arrays])
    guard[0] += 1
    try:
        for begin in begins:
            begin(record)
            begun += 1
    except BaseException as exc:
        record.error = exc
        record.start_ns = record.end_ns = _now_ns()
        record._ends = ends[:begun]
        guard[0] -= 1
        _hook_end(record, exc)   # the hooks that began see the end
        raise
    guard[0] -= 1
    record._ends = ends
    record.start_ns = _now_ns()
    return record


cdef int _hook_end(CallRecord record, object error) except -1:
    """Step 4: every hook that began sees the end, in reverse order; the
    first exception a hook raises is raised after all of them ran."""
    cdef int *guard = mmd_thread_hook_guard()
    cdef tuple ends = record._ends
    cdef Py_ssize_t i
    if record.end_ns == 0:
        record.end_ns = _now_ns()
    record.error = error
    raised = None
    guard[0] += 1
    for i in range(len(ends) - 1, -1, -1):
        try:
            ends[i](record)
        except BaseException as exc:
            if raised is None:
                raised = exc
    guard[0] -= 1
    record._args = None
    record._ends = ()
    if raised is not None:
        raise raised
    return 0


cdef object _hooked_python(OpRegistry op, CallState *st, object fn, tuple args):
    """A Python kernel's (or fallback's) call with hooks around it."""
    record = _hook_begin(op, st, args)
    if record is None:
        return fn(*args)
    try:
        result = fn(*args)
    except BaseException as exc:
        _hook_end(record, exc)
        raise
    _hook_end(record, None)
    return result


cdef int _hooked_status(OpRegistry op, object record, int status) except -1:
    """The end of a hooked C kernel call: hooks see the kernel's error (or
    None), then that error is raised (a hook's first, if one raised)."""
    error = None if status == 0 else _status_error(op.name, status)
    _hook_end(record, error)
    if error is not None:
        raise error
    return 0
