"""Case generation for the fuzz harness (fuzz.py), imported by its child
processes only: arbitrary Python objects (arrays of every dtype and layout,
objects speaking the array protocols badly, scalars whose conversions fail)
and plausible calls of every entry point (signatures.txt) and user function
(the op modules' __all__), all decoded from one byte string, so that a case
is replayed from its bytes."""
import collections
import ctypes
import math
import random
import types
from fractions import Fraction

import numpy as np

import mmdispatch
from mmdispatch import ops
from mmdispatch._codegen import parse_signature

SIGNATURES = {n: parse_signature(line) for n, line in mmdispatch.op_signatures().items()}
# Set by the harness: --dlpack-lies, and the argument kinds --known-bugs-off skips.
OPTIONS = types.SimpleNamespace(dlpack_lies=False, skip=set())


class Boom(Exception):
    """Raised by the fuzz objects' own methods."""

# ---- objects ----
pycapsule_new = ctypes.pythonapi.PyCapsule_New
pycapsule_new.restype = ctypes.py_object
pycapsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
keep_alive = collections.deque(maxlen=64)

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16)]

class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]

class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]

def crafted_capsule(array, shape, ndim, code, bits, lanes, device):
    """A DLPack capsule over `array`'s memory with the given metadata
    (no deleter: the memory stays owned by `array`)."""
    shape_buf = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed = DLManagedTensor()
    managed.dl_tensor.data = array.ctypes.data
    managed.dl_tensor.device = DLDevice(*device)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = DLDataType(code, bits, lanes)
    managed.dl_tensor.shape = shape_buf
    keep_alive.append((array, shape_buf, managed))
    return pycapsule_new(ctypes.addressof(managed), b"dltensor", None)

class Protocol:
    """An object speaking (some of) the array protocols, badly or not."""

    def __init__(self, device, export, cai, array=None):
        self._device, self._export, self._cai, self.array = device, export, cai, array

    def __repr__(self):
        export = getattr(self._export, "__name__", self._export)
        return f"Protocol(device={self._device!r}, export={export!r}, cai={self._cai!r})"

def protocol_class(has_device, has_export, has_cai):
    namespace = {}
    if has_device:
        def __dlpack_device__(self):
            if self._device == "raise":
                raise Boom("__dlpack_device__")
            return self._device
        namespace["__dlpack_device__"] = __dlpack_device__
    if has_export:
        def __dlpack__(self, **kwargs):
            export = self._export
            if export == "raise":
                raise Boom("__dlpack__")
            return export() if callable(export) else export
        namespace["__dlpack__"] = __dlpack__
    if has_cai:
        def cai(self):
            if self._cai == "raise":
                raise Boom("__cuda_array_interface__")
            return self._cai
        namespace["__cuda_array_interface__"] = property(cai)
    return type("Protocol", (Protocol,), namespace)

class BadScalar:
    """Has one conversion method (__index__, __float__, __bool__, __len__
    or __iter__), which returns garbage or raises."""

    def __repr__(self):
        return f"BadScalar({self.kind}, {self.result!r})"

def bad_scalar(kind, result):
    def give(self):
        if result == "raise":
            raise Boom(kind)
        return result
    method = {"index": "__index__", "float": "__float__", "bool": "__bool__",
              "len": "__len__", "iter": "__iter__"}[kind]
    obj = type("BadScalar", (BadScalar,), {method: give})()
    obj.kind, obj.result = kind, result
    return obj

class SubArray(np.ndarray):
    pass

class LyingDuck:
    """Claims to be an array through attributes only."""
    ndim, shape, dtype = 4, (1, 1, 1, 1), np.dtype(np.float32)

def arrays_in(value):
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, Protocol) and isinstance(value.array, np.ndarray):
        return [value.array]
    return []


# ---- generators: everything is decoded from one byte string ----
class Reader:
    """Decodes a case from bytes (like atheris' FuzzedDataProvider): the
    bytes come from hypothesis, which mutates them, and the same bytes
    give the same case, so a crash is replayed from its bytes."""

    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, n):
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk + bytes(n - len(chunk))

    def int(self, lo, hi):
        span = hi - lo + 1
        size = 1 if span <= 256 else (2 if span <= 65536 else 8)
        return lo + int.from_bytes(self.take(size), "little") % span

    def choice(self, options):
        return options[self.int(0, len(options) - 1)]

    def bool(self):
        return self.int(0, 1) == 1

huge_ints = [2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 63 - 1, 2 ** 63, -2 ** 63, -2 ** 63 - 1,
             2 ** 64, -2 ** 100, 32768, 32769]
big_ints = [2 ** 1024, -2 ** 2000]  # beyond float
curated_floats = [0.0, -0.0, 0.5, 1.0, -1.0, 2.0, 0.25, 7.25, 1e-300, 5e-324, 1e300,
                  3.4e38, -3.4e38, 1e6, -1e6, 2.0 ** 31, 2.0 ** 53, math.nan, -math.nan,
                  math.inf, -math.inf, 1e-8, 100.0, -37.5]
small_floats = [0.0, 1.0, -1.0, 2.0, 3.0, 0.5, -0.25, 4.0]
dtypes = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
          np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64, np.complex128,
          np.longdouble, object, "U3", "S2", "M8[s]", ">f4", ">f8", ">i8", "<f8",
          [("a", "<f4"), ("b", "<f4")]]
numeric = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
           np.uint8, np.uint16, np.uint32, np.uint64, np.bool_]

def an_int(r):
    return r.int(-4, 8) if r.int(0, 3) else r.choice(huge_ints)

def a_float(r):
    return r.choice(curated_floats) if r.bool() else r.int(-4000, 4000) / 40

def a_shape(r):
    ndim = r.choice([0, 1, 1, 2, 2, 3, 4, 4, 4, 5, 9])
    shape = [r.int(0, 4) for _ in range(ndim)]
    if ndim and 0 in shape and r.int(0, 5) == 0:
        shape[r.int(0, ndim - 1)] = r.choice([2 ** 20, 2 ** 40])
        if 0 not in shape:
            shape[0] = 0
    return tuple(shape)

def fill(r, shape, dtype):
    dtype = np.dtype(dtype)
    array = np.zeros(shape, dtype)
    if dtype.kind in "fcuib" and array.size:
        how = r.int(0, 2)
        flat = array.reshape(-1)
        if how == 0:   # raw bits: NaN payloads, subnormals, anything
            flat.view(np.uint8)[:] = np.frombuffer(r.take(array.nbytes), np.uint8)
        else:
            pool = np.array(curated_floats if how == 1 else small_floats)
            picks = np.frombuffer(r.take(flat.size), np.uint8) % len(pool)
            with np.errstate(all="ignore"):
                try:
                    flat[:] = pool[picks].astype(dtype)
                except (ValueError, OverflowError, TypeError):
                    pass
    return array

def layout(r, array):
    how = r.choice(["plain"] * 4 + ["reversed", "step", "transpose", "read_only",
                                    "unaligned", "broadcast", "subclass", "fortran",
                                    "masked", "internal_overlap"])
    if how == "reversed" and array.ndim:
        return array[::-1]
    if how == "step" and array.ndim:
        return np.repeat(array, 2, axis=-1)[..., ::2]
    if how == "transpose":
        return array.T
    if how == "read_only":
        array = array.copy()
        array.flags.writeable = False
        return array
    if how == "unaligned" and array.dtype.itemsize > 1 and array.dtype.kind != "O":
        raw = np.zeros(array.nbytes + 1, np.uint8)[1:]
        view = raw.view(array.dtype).reshape(array.shape)
        view[...] = array
        return view
    if how == "broadcast" and array.ndim and array.size:
        return np.broadcast_to(array[:1], (3,) + array.shape[1:])
    if how == "internal_overlap" and array.ndim and array.size:
        return np.lib.stride_tricks.as_strided(array, strides=(0,) + array.strides[1:],
                                               writeable=True)
    if how == "subclass":
        return array.view(SubArray)
    if how == "fortran":
        return np.asfortranarray(array)
    if how == "masked" and array.dtype.kind in "fiu":
        return np.ma.masked_array(array, mask=np.zeros(array.shape, bool))
    return array

def a_numpy_array(r, dtype=None):
    dtype = r.choice(dtypes) if dtype is None else dtype
    try:
        array = fill(r, a_shape(r), dtype)
    except (ValueError, MemoryError):
        array = np.zeros((0,), np.float64)
    return layout(r, array)

devices = [(1, 0), (1, 0), (2, 0), (7, 0), (1, 1), (0, 0), (-1, 0), (40, 0), (2 ** 40, 0),
           (1, 2 ** 40), (1.5, 0), ("1", 0), None, "cpu", (1,), (1, 0, 0), 3, "raise",
           (True, False)]
typestrs = ["<f4", "<f8", ">f8", "|b1", "<c8", "", "f", "<f", "<fx", 3]

def a_cai(r):
    """A __cuda_array_interface__ dict, well-formed or not."""
    if r.int(0, 2) == 0:
        return r.choice(["raise", None, 5, "x", {}, {"data": 5}])
    else:
        cai = {"data": (r.choice([0, 1, 8, 2 ** 40, -1, 2 ** 70, "x"]), r.bool()),
               "shape": r.choice([(an_int(r), an_int(r)), "ab", None, (2,), (1.5,)]),
               "typestr": r.choice(typestrs + ["<f99999999999999999999"]), "version": 3}
        if r.bool():
            cai["strides"] = r.choice([None, (an_int(r), an_int(r)), (1,), ("x",)])
    if r.int(0, 3) == 0:
        cai["mask"] = r.choice([None, 1])
    return cai

def a_protocol_object(r, kinds=None):
    cls = protocol_class(*(kinds or (r.bool(), r.bool(), r.bool())))
    device = r.choice(devices) if r.int(0, 3) else (an_int(r), an_int(r))
    inner = a_numpy_array(r, dtype=r.choice(numeric))
    def inner_capsule():
        return inner.__dlpack__()

    def other_capsule():
        return np.zeros(4).__dlpack__()

    def not_a_capsule():
        return object()

    def misnamed_capsule():
        return pycapsule_new(inner.ctypes.data or 1, b"not_dltensor", None)

    exports = ["raise", None, 3, "capsule", inner_capsule, inner_capsule, other_capsule,
               not_a_capsule, misnamed_capsule]
    if OPTIONS.dlpack_lies:
        base = np.zeros(16)
        shape = [r.choice([-1, -2 ** 62, 0, 2, 2 ** 62]) for _ in range(2)]
        ndim = r.choice([2, -1, 0, 9, 100])

        def lying_capsule():
            return crafted_capsule(base, shape, ndim, 2, 64, 1, (1, 0))
        exports.append(lying_capsule)
    export = r.choice(exports)
    return cls(device, export, a_cai(r), inner)

def a_bad_scalar(r):
    return bad_scalar(r.choice(["index", "float", "bool", "len", "iter"]),
                      r.choice(["raise", "x", None, 1.5, 2 ** 70, math.nan, 1, True]))

def anything(r, depth=0):
    kind = r.int(0, 19 if depth < 2 else 15)
    if kind == 0:
        return None
    if kind == 1:
        return r.bool()
    if kind == 2:
        return an_int(r)
    if kind == 3:
        return a_float(r)
    if kind == 4:
        return r.take(r.int(0, 4)).decode("latin-1")
    if kind == 5:
        return r.take(r.int(0, 6))
    if kind == 6:
        return complex(a_float(r), a_float(r))
    if kind == 7:
        return Fraction(r.int(-9, 9), r.int(1, 9))
    if kind in (8, 9):
        return a_numpy_array(r)
    if kind == 10:
        return a_protocol_object(r)
    if kind == 11:
        return a_bad_scalar(r)
    if kind == 12:
        return r.choice([LyingDuck(), object(), print, np.float64(1.5), np.int64(3),
                         np.bool_(True), np.float32(math.nan)])
    if kind == 13:
        return memoryview(np.ascontiguousarray(a_numpy_array(r, np.float64)))
    if kind in (14, 15):
        return np.array(a_float(r))
    if kind in (16, 17):
        return [anything(r, depth + 1) for _ in range(r.int(0, 3))]
    if kind == 18:
        return tuple(anything(r, depth + 1) for _ in range(r.int(0, 3)))
    return {r.take(1).decode("latin-1"): anything(r, depth + 1) for _ in range(r.int(0, 2))}

# ---- plausible calls, then mutated ----
def plausible(r, op_name, names, types=None):
    """Values of the parameters `names` for a roughly valid call: values
    sized for each other where the name is known (shared by every op that
    uses it), else one of the parameter's type from `types` (signatures.txt
    types; None for a user function's parameters)."""
    dtype = r.choice([np.float32, np.float64])
    n, c, h, w = r.int(0, 2), r.int(0, 3), r.int(0, 5), r.int(0, 5)
    k = r.int(0, 3) if n else 0
    oh, ow = r.int(1, 3), r.int(1, 3)
    m = r.int(0, 6)
    focal = op_name.startswith("sigmoid_focal_loss")
    aligned = r.bool()

    def rois():
        out = np.zeros((k, 5), dtype)
        for i in range(k):
            out[i] = [r.int(0, n - 1)] + [r.choice([-2.0, 0.0, 0.5, 1.0, 2.5, 4.0, 9.0, 1e6,
                                                     math.nan]) for _ in range(4)]
        return out

    makers = {
        "input": lambda: fill(r, (n, c) if focal else (n, c, h, w), dtype),
        "rois": rois,
        "output": lambda: np.zeros((n, c) if focal else (k, c, oh, ow), dtype),
        "argmax_y": lambda: np.zeros((k, c, oh, ow) if r.bool() else (0,), dtype),
        "argmax_x": lambda: np.zeros((k, c, oh, ow) if r.bool() else (0,), dtype),
        "aligned_height": lambda: oh, "aligned_width": lambda: ow,
        "pooled_height": lambda: oh, "pooled_width": lambda: ow,
        "spatial_scale": lambda: r.choice([0.5, 1.0, 0.25]),
        "convention": lambda: (r.int(0, 1) if op_name.endswith("_impl")
                               else r.choice(["torchvision", "mmcv"])),
        "sampling_ratio": lambda: r.int(-3, 3), "pool_mode": lambda: r.int(0, 1),
        "aligned": lambda: aligned,
        "grad_output": lambda: fill(r, (k, c, oh, ow), dtype),
        "grad_input": lambda: np.zeros((n, c) if focal else (n, c, h, w), dtype),
        "argmax": lambda: np.full((k, c, oh, ow), r.int(-1, 3), np.int64),
        "boxes": lambda: fill(r, (m, 4), dtype), "scores": lambda: fill(r, (m,), dtype),
        "idxs": lambda: r.choice([None, np.zeros(m, np.int64)]),
        "keep": lambda: np.zeros(m, np.int64), "num_kept": lambda: np.zeros(1, np.int64),
        "iou_threshold": lambda: r.choice([0.5, 0.0, -1.0, 1.0]),
        "offset": lambda: r.int(0, 1), "bboxes1": lambda: fill(r, (m, 4), dtype),
        "bboxes2": lambda: fill(r, (m, 4), dtype),
        "boxes1": lambda: fill(r, (m, 5), dtype), "boxes2": lambda: fill(r, (m, 5), dtype),
        "clockwise": r.bool,
        "ious": lambda: np.zeros((m,) if aligned else (m, m), dtype),
        "mode": lambda: r.int(0, 1), "gamma": lambda: 2.0, "alpha": lambda: 0.25,
        "target": lambda: np.array([r.int(0, c) for _ in range(n)], np.int64),
        "weight": lambda: r.choice([None, np.ones(c, dtype)]),
        # user functions
        "output_size": lambda: r.choice([(oh, ow), oh]), "input_shape": lambda: (n, c, h, w),
        "reduction": lambda: r.choice(["mean", "sum", "none"]),
    }
    def of_type(kind):
        if kind is not None and kind.startswith("Tensor"):
            return fill(r, a_shape(r), dtype)
        return {"int": lambda: r.int(0, 3), "float": lambda: r.choice(small_floats),
                "bool": r.bool}.get(kind, lambda: None)()

    if op_name.startswith("roi_align_rotated"):
        def rotated_rois():
            out = np.zeros((k, 6), dtype)
            for i in range(k):
                out[i] = [r.int(0, n - 1)] + [r.choice([-2.0, 0.0, 0.5, 1.0, 2.5, 4.0, 9.0, 1e6,
                                                         math.nan]) for _ in range(5)]
            return out
        makers["rois"] = rotated_rois

    if op_name.startswith("binary_focal_loss"):
        # elements of any shape, target and gradients alike
        shape = r.choice([(n, c), (n, c, h), (m,)])
        for name in ("input", "target", "grad_output"):
            makers[name] = lambda: fill(r, shape, dtype)
        for name in ("output", "grad_input", "grad_target"):
            makers[name] = lambda: np.zeros(shape, dtype)
        makers["alpha"] = lambda: r.choice([0.25, -1.0, 1.0])

    if op_name.startswith("multi_scale_deformable_attn"):
        # levels of up to 3 x 3 cells, consistent unless the mutation breaks them
        shapes = np.array([[r.int(0, 3), r.int(0, 3)] for _ in range(r.int(0, 3))],
                          np.int64).reshape(-1, 2)
        sizes = [int(a) * int(b) for a, b in shapes]
        levels, keys = len(shapes), sum(sizes)
        q, heads, dims, points = r.int(0, 3), r.int(1, 2), r.int(0, 3), r.int(1, 2)
        samples = (n, q, heads, levels, points)
        makers.update({
            "value": lambda: fill(r, (n, keys, heads, dims), dtype),
            "spatial_shapes": lambda: shapes,
            "level_start_index": lambda: np.array([sum(sizes[:i]) for i in range(levels)],
                                                  np.int64),
            "sampling_locations": lambda: fill(r, samples + (2,), dtype),
            "attention_weights": lambda: fill(r, samples, dtype),
            "output": lambda: np.zeros((n, q, heads * dims), dtype),
            "grad_output": lambda: fill(r, (n, q, heads * dims), dtype),
            "grad_value": lambda: np.zeros((n, keys, heads, dims), dtype),
            "grad_sampling_locations": lambda: np.zeros(samples + (2,), dtype),
            "grad_attention_weights": lambda: np.zeros(samples, dtype),
            "im2col_step": lambda: r.choice([64, 1, 0]),
        })

    for name in ("stride_h", "stride_w", "dilation_h", "dilation_w", "groups", "offset_groups"):
        makers[name] = lambda: r.int(1, 2)
    makers["pad_h"] = makers["pad_w"] = lambda: r.int(0, 2)

    def value(name, kind):
        """The maker's value where it fits the parameter's type (names such
        as `offset` and `weight` are arrays in one op, scalars in another)."""
        if name in makers:
            made = makers[name]()
            is_array = isinstance(made, np.ndarray) or made is None
            if kind is None or kind.startswith("Tensor") == is_array:
                return made
        return of_type(kind)

    types = types or {}
    return {name: value(name, types.get(name)) for name in names}

def plausible_call(op_name, seed):
    """A roughly valid call of entry point `op_name`, the same for a seed:
    (positional arguments, signature)."""
    sig = SIGNATURES[op_name]
    r = Reader(random.Random(seed).randbytes(256))
    values = plausible(r, op_name, [p.name for p in sig.params],
                       {p.name: p.type for p in sig.params})
    return [values[p.name] for p in sig.params], sig


def scalar_value(r, kind, plausible_value):
    choice = r.int(0, 9)
    if choice < 5:
        return plausible_value
    if choice < 8:
        return an_int(r) if kind in ("int", "bool") else a_float(r)
    if kind == "float":
        option = r.choice(["float_param_huge_int", "float_param_array",
                           "float_returns_garbage", "anything"])
        if option not in OPTIONS.skip:
            if option == "float_param_huge_int":
                return r.choice(big_ints)
            if option == "float_param_array":
                return np.ones(r.choice([(2,), (0,), (1, 2), (1,)]))
            if option == "float_returns_garbage":
                return bad_scalar("float", r.choice(["x", None, 2 ** 70]))
    return anything(r)

def array_value(r, plausible_value):
    choice = r.int(0, 9)
    if plausible_value is not None and choice < 5:
        return layout(r, plausible_value) if choice == 4 else plausible_value
    if choice < 7:
        return a_numpy_array(r)
    if choice < 9:
        return a_protocol_object(r)
    return anything(r)

def cuda_intake_call(r):
    """roi_align_forward_impl with __cuda_array_interface__ objects only:
    a no-op C kernel is registered for cuda, so their intake runs."""
    params = SIGNATURES["roi_align_forward_impl"].params
    values = [a_protocol_object(r, (False, False, True)) if p.is_array
              else scalar_value(r, p.type, 1) for p in params]
    return ("roi_align_forward_impl", mmdispatch.roi_align_forward_impl, values, set(),
            ("roi_align_forward_impl:",))

def entry_call(r, op_name):
    params = SIGNATURES[op_name].params
    base = plausible(r, op_name, [p.name for p in params], {p.name: p.type for p in params})
    values = [array_value(r, base[p.name]) if p.is_array
              else scalar_value(r, p.type, base[p.name]) for p in params]
    if r.int(0, 9) == 0:   # the same array at two positions
        arrays = [i for i, p in enumerate(params) if p.is_array]
        values[r.choice(arrays)] = values[r.choice(arrays)]
    outputs = {i for i, p in enumerate(params) if p.is_output}
    return op_name, getattr(mmdispatch, op_name), values, outputs, (f"{op_name}:",)

# user function -> the op names its errors may start with: any function of
# its op module (a function may delegate to another) and the module's entry
# points (mmdispatch/ops/<op>.py: __all__, ENTRY_POINTS)
user_prefixes = {name: tuple(module.__all__) + tuple(module.ENTRY_POINTS)
                 for module in ops._MODULES for name in module.__all__}
user_functions = sorted(user_prefixes)

def user_call(r, name):
    function = getattr(ops, name)
    names = function.__code__.co_varnames[:function.__code__.co_argcount]
    base = plausible(r, name, [n for n in names if n not in ("pool_mode", "mode", "argmax_y",
                                                            "argmax_x")])
    base.update(pool_mode=r.choice(["avg", "max"]), mode=r.choice(["iou", "iof"]),
                argmax_y=None, argmax_x=None)
    values = []
    for pname in names:
        plausible_value = base[pname]
        if isinstance(plausible_value, np.ndarray) or pname in ("weight", "idxs"):
            values.append(array_value(r, plausible_value))
        else:
            kind = "float" if isinstance(plausible_value, float) else "int"
            values.append(scalar_value(r, kind, plausible_value))
    prefixes = tuple(f"{p}:" for p in user_prefixes[name])
    return f"ops.{name}", function, values, set(), prefixes

# the first byte picks the target: every entry point twice (so entry
# points get about 2/3 of the cases, as user functions delegate to them),
# every user function once, and the CUDA-intake call five times
targets = ([(entry_call, name) for name in sorted(SIGNATURES)] * 2
           + [(user_call, name) for name in user_functions]
           + [(lambda r, _: cuda_intake_call(r), None)] * 5)
assert len(targets) <= 256


def make_case(data):
    """(target, function, argument values, output positions, allowed error
    prefixes) of the case these bytes decode to."""
    r = Reader(data)
    call, name = r.choice(targets)
    return call(r, name)
