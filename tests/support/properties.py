"""Property-based tests (hypothesis) that every op gets from its own test
file: a class there, `class TestProperties(OpProperties)`, names the op's
module and lists its case generators; the tests below then run for every
dispatch entry point (signatures.txt) and every user function
(mmdispatch.ops.*) of that module.

Each generated call either gives the answer of a slow reference (the op's
test file holds them) or raises TypeError / ValueError / KernelNotFoundError /
DeviceMismatchError / MemoryError with a message that starts with the op's
name. Every array is placed in a buffer with guard bytes on both sides, so a
write outside an output, into an input, or into an output of a rejected call
is caught.

Case counts: pytest --hypothesis-show-statistics; HYPOTHESIS_PROFILE=thorough
for a long run (profiles in tests/conftest.py).
"""
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, event, given, note, strategies as st

import mmdispatch
from mmdispatch._codegen import parse_signature
from stand_ins import DLPackOnly, FakeDeviceArray

ALLOWED_ERRORS = (TypeError, ValueError, mmdispatch.KernelNotFoundError,
                  mmdispatch.DeviceMismatchError, MemoryError)
SIGNATURES = {name: parse_signature(line) for name, line in mmdispatch.op_signatures().items()}
FLOATS = (np.float32, np.float64)


# --- arrays in guarded buffers, and arrays from "other libraries" -----------------

GUARD = 64  # bytes of a fixed pattern on each side of every array


class Guarded:
    """An array in the middle of a byte buffer whose other bytes hold a fixed
    pattern (`view` may turn it into a strided view of the same values).
    BufferWatch snapshots such buffers: a write outside an output, into an
    input, or anywhere in a rejected call shows up."""

    def __init__(self, values, view=None):
        values = np.asarray(values)
        self.buffer = np.full(values.nbytes + 2 * GUARD, 0xA5, dtype=np.uint8)
        base = self.buffer[GUARD:GUARD + values.nbytes].view(values.dtype).reshape(values.shape)
        base[...] = values
        self.array = base if view is None else view(base)


def guarded(values):
    return Guarded(values).array


def strided_copy(values, how):
    """A non-contiguous view holding `values`, in a guarded buffer."""
    values = np.asarray(values)
    if values.ndim == 0:       # a 0-d array has no strides to change
        return Guarded(values)
    if how == "reversed":      # negative strides on every axis
        flip = tuple(slice(None, None, -1) for _ in values.shape)
        return Guarded(values[flip], view=lambda a: a[flip])
    if how == "every_other":   # step 2 along the last axis
        return Guarded(np.repeat(values, 2, axis=-1), view=lambda a: a[..., ::2])
    if how == "fortran":
        return Guarded(np.asfortranarray(values).T, view=lambda a: a.T)
    raise ValueError(how)


def in_signalling_guards(prefill, lead):
    """float32 `prefill`'s values in a buffer, `lead` floats (0 to 3) past a
    16-byte boundary, between guard cells holding a signalling NaN, which
    any add, even of -0.0 (a vector atomic's untouched lanes), makes quiet:
    the view, and a function that says whether every guard kept its bits."""
    signalling = np.array([0x7FA00000], np.uint32).view(np.float32)[0]
    buffer = np.full(prefill.size + 8, signalling, np.float32)
    offset = (-buffer.ctypes.data // 4) % 4 + lead   # 16-byte aligned, then the lead
    view = buffer[offset:offset + prefill.size].reshape(prefill.shape)
    view[...] = prefill

    def guards_untouched():
        bits = buffer.view(np.uint32)
        outside = np.r_[bits[:offset], bits[offset + prefill.size:]]
        return bool((outside == 0x7FA00000).all())
    return view, guards_untouched


class ArrayInterfaceOnly:
    """Only numpy's __array_interface__, which the dispatcher does not take."""

    def __init__(self, array):
        self.__array_interface__ = array.__array_interface__


class SubArray(np.ndarray):
    """A numpy subclass: goes through the dispatcher's general numpy path."""


def assert_clear_error(excinfo, prefixes):
    message = str(excinfo.value)
    assert message.startswith(prefixes), f"{type(excinfo.value).__name__}: {message!r}"


def guarded_buffers(args):
    """name -> the buffer behind every numpy array argument."""
    found = {}
    for name, value in args.items():
        array = value.array if isinstance(value, DLPackOnly) else value
        if isinstance(array, np.ndarray):
            owner = array
            while owner.base is not None and isinstance(owner.base, np.ndarray):
                owner = owner.base
            found[name] = owner
    return found


class BufferWatch:
    """Snapshots the buffers behind every array argument of a call."""

    def __init__(self, args):
        self.buffers = {name: (owner, owner.copy()) for name, owner in
                        guarded_buffers(args).items()}

    def unchanged(self, names=None):
        for name, (owner, before) in self.buffers.items():
            if names is None or name in names:
                assert owner.tobytes() == before.tobytes(), f"{name} was written"

    def guards_intact(self, name):
        owner, before = self.buffers[name]
        assert owner.tobytes()[:GUARD] == before.tobytes()[:GUARD], f"wrote before {name}"
        assert owner.tobytes()[-GUARD:] == before.tobytes()[-GUARD:], f"wrote after {name}"


# --- value strategies that op test files share ------------------------------------------

SPECIALS = [math.nan, math.inf, -math.inf]


@st.composite
def float_arrays(draw, shape, dtype, lo=-8.0, hi=8.0, specials=True):
    """Values on a grid of quarters (exact in float32), with a few NaN / inf."""
    size = int(np.prod(shape))
    quarters = draw(st.lists(st.integers(int(lo * 4), int(hi * 4)), min_size=size,
                             max_size=size))
    values = np.array(quarters, dtype=np.float64).reshape(shape) / 4
    if specials and size and draw(st.integers(0, 3)) == 0:
        flat = values.reshape(-1)
        for _ in range(draw(st.integers(1, 3))):
            flat[draw(st.integers(0, size - 1))] = draw(st.sampled_from(SPECIALS))
    return values.astype(dtype)


def sentinel(shape, dtype):
    """What an output holds before a call, so an untouched output is visible."""
    return np.full(shape, 77, dtype=dtype)


TOL = {np.float32: dict(rtol=2e-4, atol=2e-4), np.float64: dict(rtol=1e-9, atol=1e-9),
       np.float16: dict(rtol=2e-2, atol=2e-2)}   # float16 storage computed in float32 (CUDA)


def assert_close(got, expected, dtype):
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), expected, equal_nan=True,
                               **TOL[np.dtype(dtype).type])


def assert_same(got, expected):
    """Equal arrays: floats to the rounding of their dtype, others exactly."""
    if expected.dtype.kind == "f":
        assert_close(got, expected, expected.dtype)
    else:
        np.testing.assert_array_equal(got, expected)


@st.composite
def rois_for(draw, k, batch, height, width, scale, aligned, dtype):
    """(k, 5) rois on a quarter grid in map units (exact in float32 after
    scaling by a power of two), around and across the map."""
    rows = []
    for _ in range(k):
        ys = sorted(draw(st.integers(-8, 4 * height + 8)) / 4 for _ in range(2))
        xs = sorted(draw(st.integers(-8, 4 * width + 8)) / 4 for _ in range(2))
        if not aligned and draw(st.booleans()):
            ys.reverse()   # legacy mode clamps malformed rois to 1x1
        rows.append([draw(st.integers(0, batch - 1)), xs[0] / scale, ys[0] / scale,
                     xs[1] / scale, ys[1] / scale])
    return np.array(rows, dtype=dtype).reshape(k, 5)


@st.composite
def roi_problem_sizes(draw):
    """(n, c, h, w) of the feature map, k rois (none without an image), the
    out_h x out_w output and the spatial scale of a roi op's case."""
    n, c = draw(st.integers(0, 2)), draw(st.integers(0, 3))
    h, w = draw(st.integers(0, 5)), draw(st.integers(0, 5))
    k = draw(st.integers(0, 3)) if n else 0
    out_h, out_w = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    scale = draw(st.sampled_from([0.25, 0.5, 1.0, 2.0]))
    return n, c, h, w, k, out_h, out_w, scale


def bad_rois(draw, args, batch, more=()):
    """args with one roi value the kernels must refuse: (bad args, what).
    `batch` is the map's batch size; `more` adds (column, value) choices."""
    assume(args["rois"].shape[0] > 0)
    rois = args["rois"].copy()
    row = draw(st.integers(0, rois.shape[0] - 1))
    col, value = draw(st.sampled_from(
        [(c, v) for c in range(5) for v in SPECIALS] + [(0, -1), (0, 0.5), (0, batch)]
        + list(more)))
    rois[row, col] = value(rois[row]) if callable(value) else value
    return dict(args, rois=guarded(rois)), f"data: rois[{row}, {col}] = {rois[row, col]}"


def small_map_and_rois():
    """A (2, 3, 4, 5) float64 map and two rois on it: a small valid call."""
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float64).reshape(2, 3, 4, 5)
    return x, np.array([[0, 0, 0, 3, 3], [1, 1, 1, 4, 2]], dtype=np.float64)


@st.composite
def boxes_for(draw, n, dtype):
    """(n, 4) boxes on a quarter grid, some empty or reversed, some NaN / inf."""
    x1 = draw(float_arrays((n, 2), np.float64, -4, 8, specials=False))
    size = draw(float_arrays((n, 2), np.float64, -1, 6, specials=False))
    boxes = np.concatenate([x1, x1 + size], axis=1)
    if n and draw(st.integers(0, 3)) == 0:
        boxes[draw(st.integers(0, n - 1)), draw(st.integers(0, 3))] = draw(
            st.sampled_from(SPECIALS))
    return boxes.astype(dtype)


@st.composite
def extreme_case(draw, properties, entry_point):
    """A valid case of `properties` (an OpProperties) for `entry_point` whose
    input arrays and scalars are then pushed to extreme values."""
    dtype = draw(st.sampled_from(FLOATS), label="dtype")
    args, _ = draw(properties.entry_cases[entry_point](dtype), label="case")
    for p in SIGNATURES[entry_point].params:
        value = args[p.name]
        if p.is_array and value is not None and value.dtype.kind == "f" and value.size \
                and not p.is_output and draw(st.booleans()):
            a = value.copy()
            for _ in range(draw(st.integers(1, 4))):
                with np.errstate(over="ignore"):
                    a.reshape(-1)[draw(st.integers(0, a.size - 1))] = draw(
                        st.sampled_from(EXTREME_FLOATS))
            args[p.name] = guarded(a)
        elif p.type == "int" and draw(st.integers(0, 3)) == 0:
            args[p.name] = draw(st.sampled_from(EXTREME_INTS))
        elif p.type == "float" and draw(st.integers(0, 3)) == 0:
            args[p.name] = draw(st.sampled_from(EXTREME_FLOATS))
    note({name: v for name, v in args.items() if not isinstance(v, np.ndarray)})
    return args


def answer_or_clear_error(entry_point, args, wrap=None):
    """Calls the entry point (its arrays through `wrap`, e.g. as device
    arrays): an answer, or an allowed error naming the op (a wrapped call's
    kernel message is the emulator's, so only its type is checked); inputs
    unchanged and nothing written around the outputs either way."""
    watch = BufferWatch(args)
    wrapped = args if wrap is None else {
        name: wrap(a) if isinstance(a, np.ndarray) else a for name, a in args.items()}
    try:
        call(entry_point, wrapped)
        event("answered")
    except ALLOWED_ERRORS as exc:
        assert wrap is not None or str(exc).startswith(f"{entry_point}:"), \
            f"{type(exc).__name__}: {exc}"
        event(f"refused: {type(exc).__name__}")
    watch.unchanged(inputs_of(entry_point))
    for name in outputs_of(entry_point):
        if args[name] is not None:
            watch.guards_intact(name)


# --- calls of entry points ------------------------------------------------------------------

def call(op_name, args):
    op = SIGNATURES[op_name]
    return getattr(mmdispatch, op_name)(*(args[p.name] for p in op.params))


def cpu_backends(op_name):
    """The CPU backends with a kernel for op_name (every op has "default")."""
    return sorted({row["backend"] for row in mmdispatch.registry_table()
                   if row["op"] == op_name and row["device"] == "cpu"})


def outputs_of(op_name):
    return [p.name for p in SIGNATURES[op_name].params if p.is_output]


def inputs_of(op_name):
    return [p.name for p in SIGNATURES[op_name].params if p.type in ("Tensor", "Tensor?")]


# Ways to hand over a valid array that must not change the result.
NEUTRAL_WRAPS = ["plain", "dlpack", "subclass", "odd_unit_strides"]


def neutral_wrap(array, how):
    if array is None or how == "plain":
        return array
    if how == "dlpack":
        return DLPackOnly(array)
    if how == "subclass":
        return array.view(SubArray)
    if how == "odd_unit_strides":   # size-1 axes may have any stride and stay C-contiguous
        strides = tuple(s if n != 1 else 12345 * array.itemsize
                        for n, s in zip(array.shape, array.strides))
        return np.lib.stride_tricks.as_strided(array, strides=strides, writeable=True)
    raise ValueError(how)


def neutral_scalar(draw, kind, value):
    """A scalar of another type that must mean the same thing."""
    if kind == "int":
        return draw(st.sampled_from([value, np.int64(value), np.int32(value)]
                                    + ([bool(value)] if value in (0, 1) else [])))
    if kind == "float":
        return draw(st.sampled_from([value, np.float64(value)]
                                    + ([Fraction(value)] if math.isfinite(value) else [])
                                    + ([int(value)] if float(value).is_integer() else [])))
    return draw(st.sampled_from([value, np.bool_(value), int(value)]))


BAD_TYPES = ["list", "tuple", "memoryview", "array_interface", "int", "str", "bytes",
             "object", "numpy_scalar", "none"]
OTHER_DEVICES = [(2, 0), (2, 1), (4, 0), (7, 0), (14, 3), (1, 1)]


def bad_type(array, how):
    return {"list": lambda: array.tolist(), "tuple": lambda: tuple(array.reshape(-1).tolist()),
            "memoryview": lambda: memoryview(array),
            "array_interface": lambda: ArrayInterfaceOnly(array), "int": lambda: 3,
            "str": lambda: "array", "bytes": lambda: b"\x00" * 8, "object": object,
            "numpy_scalar": lambda: array.dtype.type(1), "none": lambda: None}[how]()


def wrong_dtypes(array):
    if array.dtype == np.int64:
        return [np.int32, np.float64, np.uint64, np.bool_, np.dtype(">i8")]
    return [np.float16, np.int32, np.int64, np.uint8, np.bool_, np.complex64, np.dtype(">f8"),
            np.float32 if array.dtype == np.float64 else np.float64]


NOT_INT = [1.5, "2", None, [1], np.float64(2.0), 2j]
NOT_FLOAT = ["0.5", None, [1.0], 2j, b"1", object()]
NOT_BOOL = ["yes", 1.5, None, [1], object()]
OUTSIDE_INT64 = [2 ** 63, -2 ** 63 - 1, 2 ** 100]


def overlapping(args, out_name, other_name):
    """(output, other) sharing bytes: views of one buffer, values copied."""
    out, other = args[out_name], args[other_name]
    other_bytes = other.nbytes
    start = max(0, (other_bytes - 1) // 8 * 8)  # the output begins inside `other`
    buffer = np.zeros(start + out.nbytes + 16, np.uint8)
    other_view = buffer[:other_bytes].view(other.dtype).reshape(other.shape)
    other_view[...] = other
    out_view = buffer[start:start + out.nbytes].view(out.dtype).reshape(out.shape)
    return out_view, other_view


EXTREME_FLOATS = [0.0, -0.0, 1e-300, -1e-300, 1e30, -1e30, 3.4e38, -3.4e38, 1e308, -1e308,
                  math.nan, math.inf, -math.inf, 0.5, 2 ** 31, 2 ** 53 + 1]
EXTREME_INTS = [0, 1, -1, 2 ** 31, -2 ** 31, 2 ** 62, -2 ** 63, 2 ** 63 - 1, 32768, 32767]


# --- calls of user functions ------------------------------------------------------------------

LAYOUTS = ["plain", "reversed", "every_other", "fortran", "dlpack", "read_only", "subclass"]


def in_layout(array, how):
    """`array`'s values, handed over another way; the guarded buffer behind
    it is what BufferWatch snapshots."""
    if array is None:
        return None
    if how in ("reversed", "every_other", "fortran"):
        return strided_copy(array, how).array
    array = guarded(array)
    if how == "dlpack":
        return DLPackOnly(array)
    if how == "read_only":
        array.flags.writeable = False
        return array
    if how == "subclass":
        return array.view(SubArray)
    return array


# --- bad calls ------------------------------------------------------------------------------

@st.composite
def bad_entry_call(draw, spec, op_name):
    """A valid case with exactly one thing made wrong: (args, description)."""
    dtype = draw(st.sampled_from(FLOATS))
    args, _ = draw(spec.entry_cases[op_name](dtype))
    params = SIGNATURES[op_name].params
    arrays = [p for p in params if p.is_array and args[p.name] is not None
              and not spec.ignores(op_name, args, p.name)]
    scalars = [p for p in params if not p.is_array]
    outputs = [p for p in arrays if p.is_output]
    kind = draw(st.sampled_from(["type", "device", "all_devices", "dtype", "ndim", "strided",
                                 "shape", "read_only", "overlap", "scalar_type",
                                 "scalar_value", "data"]))
    bad = dict(args)
    if kind in ("type", "device", "dtype", "ndim", "strided", "shape", "read_only",
                "overlap"):
        assume(arrays)
    if kind == "type":
        p = draw(st.sampled_from(arrays))
        # None is valid for an optional input and for an output the entry
        # point allocates (an allocation line in signatures.txt)
        allocated = {a.name for a in SIGNATURES[op_name].allocations}
        none_valid = p.type == "Tensor?" or p.name in allocated
        how = draw(st.sampled_from(BAD_TYPES[:-1] if none_valid else BAD_TYPES))
        bad[p.name] = bad_type(args[p.name], how)
        return bad, f"{kind}: {p.name} as {how}"
    if kind == "device":
        p = draw(st.sampled_from(arrays))
        device = draw(st.sampled_from(OTHER_DEVICES))
        bad[p.name] = FakeDeviceArray(*device)
        return bad, f"{kind}: {p.name} on device {device}"
    if kind == "all_devices":
        assume(arrays)
        device = draw(st.sampled_from(OTHER_DEVICES[:-1]))
        for p in arrays:
            bad[p.name] = FakeDeviceArray(*device)
        return bad, f"{kind}: every array on {device}"
    if kind == "dtype":
        p = draw(st.sampled_from(arrays))
        new = draw(st.sampled_from(wrong_dtypes(args[p.name])))
        with np.errstate(invalid="ignore"):   # NaN to an integer dtype
            bad[p.name] = guarded(args[p.name].astype(new))
        return bad, f"{kind}: {p.name} as {np.dtype(new).str}"
    if kind == "ndim":
        p = draw(st.sampled_from(arrays))
        a = args[p.name]
        bad[p.name] = guarded(a.reshape((1,) + a.shape) if a.ndim == 1 or draw(st.booleans())
                              else a.reshape(-1))
        return bad, f"{kind}: {p.name} with shape {bad[p.name].shape}"
    if kind == "strided":
        candidates = [p for p in arrays if max(args[p.name].shape, default=0) >= 2]
        assume(candidates)
        p = draw(st.sampled_from(candidates))
        how = draw(st.sampled_from(["reversed", "every_other", "fortran"]))
        view = strided_copy(args[p.name], how).array
        assume(not view.flags.c_contiguous)
        bad[p.name] = view
        return bad, f"{kind}: {p.name} as a {how} view"
    if kind == "shape":
        fixed = spec.fixed_axes.get(op_name, {})
        candidates = [p for p in arrays if p.name in fixed
                      and any(axis < args[p.name].ndim for axis in fixed[p.name])]
        assume(candidates)
        p = draw(st.sampled_from(candidates))
        a = args[p.name]
        axis = draw(st.sampled_from([axis for axis in fixed[p.name] if axis < a.ndim]))
        shape = list(a.shape)
        shape[axis] += draw(st.sampled_from([1, 2]))
        bad[p.name] = guarded(np.zeros(shape, a.dtype))
        return bad, f"{kind}: {p.name} with shape {tuple(shape)}"
    if kind == "read_only":
        assume(outputs)
        p = draw(st.sampled_from(outputs))
        view = args[p.name].view()
        view.flags.writeable = False
        bad[p.name] = view if draw(st.booleans()) else DLPackOnly(view)
        return bad, f"{kind}: {p.name} read-only"
    if kind == "overlap":
        pairs = [(o, p) for o in outputs for p in arrays
                 if p is not o and args[o.name].size and args[p.name].size]
        assume(pairs)
        o, p = draw(st.sampled_from(pairs))
        bad[o.name], bad[p.name] = overlapping(args, o.name, p.name)
        return bad, f"{kind}: {o.name} overlapping {p.name}"
    if kind == "scalar_type":
        assume(scalars)
        p = draw(st.sampled_from(scalars))
        bad[p.name] = draw(st.sampled_from({"int": NOT_INT + OUTSIDE_INT64,
                                            "float": NOT_FLOAT, "bool": NOT_BOOL}[p.type]))
        return bad, f"{kind}: {p.name} = {bad[p.name]!r}"
    if kind == "scalar_value":
        candidates = [p for p in scalars if spec.bad_scalar_values(p.name, dtype)]
        assume(candidates)
        p = draw(st.sampled_from(candidates))
        bad[p.name] = draw(st.sampled_from(spec.bad_scalar_values(p.name, dtype)))
        return bad, f"{kind}: {p.name} = {bad[p.name]!r}"
    found = spec.bad_data(draw, op_name, args)
    assume(found is not None)
    return found


@st.composite
def bad_user_call(draw, spec, name):
    """A small valid call of user function `name` with one thing made wrong:
    (positional args, description)."""
    args = spec.good_user_args[name]()
    array_positions = [i for i, v in enumerate(args) if isinstance(v, np.ndarray)]
    kind = draw(st.sampled_from(["value", "array_type", "device", "dtype", "ndim"]))
    if kind == "ndim":
        array_positions = [i for i in array_positions if i not in spec.any_ndim.get(name, ())]
    if kind == "value":
        positions = [i for (n, i) in spec.user_bad_values if n == name]
        assume(positions)
        i = draw(st.sampled_from(positions))
        args[i] = draw(st.sampled_from(spec.user_bad_values[name, i]))
        return args, f"{kind}: arg {i} = {args[i]!r}"
    assume(array_positions)
    i = draw(st.sampled_from(array_positions))
    a = args[i]
    if kind == "array_type":
        how = draw(st.sampled_from(BAD_TYPES[:-1]))
        args[i] = bad_type(a, how)
        return args, f"{kind}: arg {i} as {how}"
    if kind == "device":
        device = draw(st.sampled_from(OTHER_DEVICES[:-1]))
        args[i] = FakeDeviceArray(*device)
        return args, f"{kind}: arg {i} on {device}"
    if kind == "dtype":
        new = draw(st.sampled_from([np.float16, np.complex64, np.bool_, np.dtype(">f8")]
                                   + ([np.int32] if a.dtype.kind == "f" else [np.float32])))
        if a.dtype.kind in "iu" and np.dtype(new).kind in "iub":
            new = np.float64  # any integer dtype is fine for index arrays
        args[i] = a.astype(new)
        return args, f"{kind}: arg {i} as {np.dtype(new).str}"
    args[i] = a.reshape(-1) if a.ndim > 1 and draw(st.booleans()) else a[None]
    return args, f"{kind}: arg {i} with shape {args[i].shape}"


# --- the tests ------------------------------------------------------------------------------------

class OpProperties:
    """The property tests of one op module. A subclass named TestProperties
    in the op's test file sets:

    - module: the op module (mmdispatch.ops.<op>);
    - entry_cases: entry point -> case(dtype), a strategy of (args, check):
      args maps every parameter of the signature to a value (arrays are
      guarded numpy arrays), check(args) asserts the outputs;
    - fixed_axes: entry point -> {array parameter: the axes that the other
      arguments fix (a different size there is an error)};
    - bad_scalars: scalar parameter -> values refused there (beyond wrong
      types, and values outside int64 for every int);
    - user_cases: user function -> case(draw, name, dtype, layout), giving
      (run, inputs, verify): run() makes the call, inputs are its arrays
      (each put through layout(), which hands it over in a random way),
      verify(result) asserts the result;
    - good_user_args: user function -> a function giving the positional
      arguments of a small valid call;
    - user_bad_values: (user function, argument position) -> values refused
      there;
    - any_ndim: user function -> positions of arrays it takes with any number
      of dimensions (others get one more or fewer as a bad argument);

    - torch_calls: entry point -> calls(torch, device), a list of argument
      tuples for the entry point's derived PyTorch op (mmdispatch.torch), each
      run through torch.library.opcheck on the CPU and, where there is a GPU,
      on CUDA (tensors that need grad exercise the autograd registration);

    and may override bad_data (values inside arrays that the kernels must
    refuse) and ignores (arrays a call does not read)."""

    module = None
    entry_cases = {}
    fixed_axes = {}
    bad_scalars = {}
    user_cases = {}
    good_user_args = {}
    user_bad_values = {}
    any_ndim = {}
    torch_calls = {}

    def bad_data(self, draw, op_name, args):
        """(args with a value inside an array that the kernels refuse, what);
        None when the entry point checks no array's values."""
        return None

    def ignores(self, op_name, args, name):
        """Whether the call reads nothing of array argument `name`."""
        return False

    def bad_scalar_values(self, name, dtype):
        return self.bad_scalars.get(name, [])

    def user_prefixes(self):
        """What a user function's error may start with: any function of its
        module (one may delegate to another) and the module's entry points."""
        return tuple(f"{name}:" for name in (*self.module.__all__, *self.module.ENTRY_POINTS))

    def pytest_generate_tests(self, metafunc):
        if "entry_point" in metafunc.fixturenames:
            metafunc.parametrize("entry_point", sorted(self.entry_cases))
        if "function" in metafunc.fixturenames:
            metafunc.parametrize("function", sorted(self.user_cases))

    def test_every_entry_point_and_user_function_of_the_module_has_cases(self):
        assert set(self.entry_cases) == set(self.module.ENTRY_POINTS)
        assert set(self.user_cases) == set(self.module.__all__)
        assert set(self.good_user_args) == set(self.module.__all__)
        assert set(self.torch_calls) == set(self.module.ENTRY_POINTS)
        assert set(self.fixed_axes) <= set(self.entry_cases)
        for op_name, axes in self.fixed_axes.items():
            assert set(axes) <= {p.name for p in SIGNATURES[op_name].params if p.is_array}
        for name, position in self.user_bad_values:
            assert position < len(self.good_user_args[name]()), (name, position)

    # 1. entry points: valid calls match the slow references

    @given(data=st.data())
    def test_entry_point_matches_reference(self, entry_point, data):
        dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
        args, check = data.draw(self.entry_cases[entry_point](dtype), label="case")
        watch = BufferWatch(args)
        wrapped = dict(args)
        for p in SIGNATURES[entry_point].params:
            if p.is_array:
                wrapped[p.name] = neutral_wrap(args[p.name], data.draw(
                    st.sampled_from(NEUTRAL_WRAPS), label=f"{p.name} as"))
            else:
                wrapped[p.name] = neutral_scalar(data.draw, p.type, args[p.name])
        backend = data.draw(st.sampled_from(cpu_backends(entry_point)), label="backend")
        event(f"{entry_point} {np.dtype(dtype).name}")
        try:
            with mmdispatch.use_backend("cpu", backend):
                call(entry_point, wrapped)
        except ALLOWED_ERRORS as exc:
            raise AssertionError(f"a valid call was refused: {type(exc).__name__}: {exc}")
        watch.unchanged(inputs_of(entry_point))
        for name in outputs_of(entry_point):
            watch.guards_intact(name)
        check(args)

    # 2. entry points: every kind of bad argument is a clear error, nothing written

    @given(data=st.data())
    def test_entry_point_rejects_bad_arguments_and_writes_nothing(self, entry_point, data):
        bad, what = data.draw(bad_entry_call(self, entry_point), label="bad call")
        note(what)
        event(what.split(":")[0])
        watch = BufferWatch(bad)
        backend = data.draw(st.sampled_from(cpu_backends(entry_point)), label="backend")
        with pytest.raises(ALLOWED_ERRORS) as excinfo:
            with mmdispatch.use_backend("cpu", backend):
                call(entry_point, bad)
        assert_clear_error(excinfo, f"{entry_point}:")
        event(f"error {type(excinfo.value).__name__}")
        watch.unchanged()

    # 3. entry points: extremes give an answer or a clear error, never a crash or a write

    @given(data=st.data())
    def test_extreme_values_give_an_answer_or_a_clear_error(self, entry_point, data):
        """A valid case whose arrays and scalars are then pushed to extreme
        values: any outcome but a crash or a write to an input is fine."""
        args = data.draw(extreme_case(self, entry_point), label="extreme case")
        answer_or_clear_error(entry_point, args)

    # 4. user functions: any layout or library gives the reference answer

    @given(data=st.data())
    def test_user_function_matches_reference_for_any_layout(self, function, data):
        dtype = data.draw(st.sampled_from(FLOATS), label="dtype")

        def layout(array):
            return in_layout(array, data.draw(st.sampled_from(LAYOUTS), label="layout"))

        run, inputs, verify = self.user_cases[function](data.draw, function, dtype, layout)
        watch = BufferWatch(inputs)
        try:
            result = run()
        except ALLOWED_ERRORS as exc:
            raise AssertionError(f"a valid call was refused: {type(exc).__name__}: {exc}")
        watch.unchanged()
        verify(result)

    # 5. user functions: bad arguments are clear errors

    @given(data=st.data())
    def test_user_function_rejects_bad_arguments(self, function, data):
        args, what = data.draw(bad_user_call(self, function), label="bad call")
        note(what)
        event(what.split(":")[0])
        watch = BufferWatch({str(i): a for i, a in enumerate(args)})
        with pytest.raises(ALLOWED_ERRORS) as excinfo:
            getattr(self.module, function)(*args)
        assert_clear_error(excinfo, self.user_prefixes())
        event(f"error {type(excinfo.value).__name__}")
        watch.unchanged()


    # 6. the CUDA kernels, emulated on the CPU (tests/support/cuda_emu), give the CPU's answers

    @given(data=st.data())
    def test_emulated_cuda_kernel_matches_the_cpu_kernel(self, entry_point, cuda_emulator, data):
        """A valid case on cuda:0 arrays, each CUDA backend: the CPU kernel's
        outputs (to rounding), inputs untouched, and outside strict mode no
        wait for the device, no device memory kept and no deferred error."""
        from cuda_emu import DeviceView

        if not cuda_emulator.backends(entry_point):
            pytest.skip(f"{entry_point} has no CUDA kernel")
        dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
        args, _ = data.draw(self.entry_cases[entry_point](dtype), label="case")
        backend = data.draw(st.sampled_from(cuda_emulator.backends(entry_point)), label="backend")
        strict = data.draw(st.booleans(), label="strict")
        on_cpu = {name: a.copy() if isinstance(a, np.ndarray) else a for name, a in args.items()}
        on_gpu = {name: a.copy() if isinstance(a, np.ndarray) else a for name, a in args.items()}
        call(entry_point, on_cpu)
        with cuda_emulator.active():
            before = cuda_emulator.counters()
            with mmdispatch.strict(strict), mmdispatch.use_backend("cuda", backend):
                cuda_emulator.clear_error()
                try:
                    call(entry_point, {name: DeviceView(a) if isinstance(a, np.ndarray) else a
                                       for name, a in on_gpu.items()})
                except ALLOWED_ERRORS as exc:
                    raise AssertionError(f"a valid call was refused on CUDA: {exc} "
                                         f"({cuda_emulator.last_error()})")
            after = cuda_emulator.counters()
            assert cuda_emulator.synchronize() == (0, "")
        assert after["live_allocations"] == before["live_allocations"], "device memory kept"
        if not strict:
            assert after["host_waits"] == before["host_waits"], "the call waited for the device"
        for name, expected in on_cpu.items():
            if isinstance(expected, np.ndarray):
                note(name)
                assert_same(on_gpu[name], expected)

    @given(data=st.data())
    def test_emulated_cuda_kernel_survives_extreme_values(self, entry_point, cuda_emulator, data):
        """test_extreme_values_give_an_answer_or_a_clear_error on the emulated
        CUDA kernels, with the op's bad data (bad_data) too, strict or with
        the data errors deferred (synchronize takes them): never a crash or
        a write outside the outputs, and under CUDA_EMU_SANITIZE=address
        never an access out of bounds."""
        from cuda_emu import DeviceView

        if not cuda_emulator.backends(entry_point):
            pytest.skip(f"{entry_point} has no CUDA kernel")
        args = data.draw(extreme_case(self, entry_point), label="extreme case")
        bad = self.bad_data(data.draw, entry_point, args) if data.draw(
            st.booleans(), label="bad data") else None
        if bad is not None:
            args, what = bad
            note(what)
        backend = data.draw(st.sampled_from(cuda_emulator.backends(entry_point)), label="backend")
        strict = data.draw(st.booleans(), label="strict")
        with cuda_emulator.active():
            with mmdispatch.strict(strict), mmdispatch.use_backend("cuda", backend):
                answer_or_clear_error(entry_point, args, DeviceView)
            event(f"deferred: {cuda_emulator.synchronize()[0] != 0}")

    # 7. the derived PyTorch op of every entry point passes torch's opcheck

    def test_derived_torch_op_passes_opcheck_on_the_cpu(self, entry_point):
        torch = pytest.importorskip("torch", reason="torch is not installed (the test extra has it)")
        import mmdispatch.torch  # noqa: F401 (the calls may use other derived ops, in any test order)
        opcheck_all(torch, entry_point, self.torch_calls[entry_point](torch, "cpu"))

    def test_derived_torch_ops_generated_run_gives_what_its_general_run_gives(self, entry_point):
        """DerivedOp.run (code generated for the op) and run_general give
        equal outputs, in and outside autograd (eager or not), for the
        opcheck calls as they are (the generated path) and with every
        tensor strided (the general one, through the generated run)."""
        torch = pytest.importorskip("torch", reason="torch is not installed (the test extra has it)")
        from mmdispatch.torch._library import DERIVED
        derived = DERIVED[entry_point]

        def strided(value):
            if not isinstance(value, torch.Tensor):
                return value
            wide = torch.zeros((*value.shape, 2), dtype=value.dtype, device=value.device)
            wide[..., 0] = value.detach()
            return wide[..., 0].requires_grad_(value.requires_grad)

        for args in self.torch_calls[entry_point](torch, "cpu"):
            for call in (args, tuple(strided(a) for a in args)):
                for eager in (False, True):
                    got, expected = (derived.run(*call, eager=eager),
                                     derived.run_general(*call, eager=eager))
                    got = got if isinstance(got, tuple) else (got,)
                    expected = expected if isinstance(expected, tuple) else (expected,)
                    assert len(got) == len(expected)
                    for g, e in zip(got, expected):
                        assert g.dtype == e.dtype and g.shape == e.shape
                        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)

    def test_derived_torch_op_passes_opcheck_on_cuda(self, entry_point, torch_cuda):
        import mmdispatch.torch  # noqa: F401 (the calls may use other derived ops)
        if not any(row["op"] == entry_point and row["device"] == "cuda"
                   for row in mmdispatch.registry_table()):
            pytest.skip(f"{entry_point} has no CUDA kernel")
        opcheck_all(torch_cuda, entry_point, self.torch_calls[entry_point](torch_cuda, "cuda"))


def torch_map_and_rois(torch, device, channels=3):
    """A float64 map (2, channels, 8, 8) that needs grad and three rois on it,
    as torch tensors for the derived ops' opcheck calls."""
    x = torch.randn(2, channels, 8, 8, dtype=torch.float64, device=device, requires_grad=True)
    rois = torch.tensor([[0, 0.5, 0.5, 5, 6], [1, 1, 1, 6, 5], [0, 2, 1, 7, 7]],
                        dtype=torch.float64, device=device)
    return x, rois


def opcheck_all(torch, entry_point, calls):
    """torch.library.opcheck (schema, fake tensor, autograd registration,
    aot_dispatch_dynamic) of the op derived from `entry_point`, per call."""
    from mmdispatch.torch._library import DERIVED
    op = getattr(torch.ops.mmdispatch, DERIVED[entry_point].name)
    assert calls
    for args in calls:
        torch.library.opcheck(op, args)
