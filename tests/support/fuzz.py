#!/usr/bin/env python3
"""Fuzzes mmdispatch's dispatch entry points (mmdispatch.<op>_impl) and user
functions (mmdispatch.ops.*) with arbitrary Python objects, for a fixed time.

    python tests/support/fuzz.py --seconds 600             # the long run (2 workers)
    python tests/support/fuzz.py --seconds 20 --json out   # what tests/test_fuzz.py runs

Arguments are drawn by hypothesis (one long sequence of fresh examples, no
shrinking): None, bools, ints up to 2**100, floats with NaN / inf, strings,
bytes, nested lists and dicts, numpy arrays of every dtype (object, str,
datetime, complex, byte-swapped...) and shape (zero-sized, 9-D), strided /
read-only / unaligned / broadcast / subclass views, memoryviews, and objects
whose __dlpack__, __dlpack_device__, __cuda_array_interface__, __index__,
__float__, __bool__ or __len__ return garbage or raise; half the time they
start from a plausible call of the op so that the kernels run too. A no-op
C kernel (mmdispatch._benchkit) is registered for roi_align_forward_impl on
cuda and vulkan, so CUDA-array and DLPack intake runs even without a GPU.

Outcomes per case: an answer; an allowed error (TypeError, ValueError,
KernelNotFoundError, DeviceMismatchError, MemoryError) whose message starts
with the op's name; or an exception raised by the fuzz objects' own methods,
passed through unchanged ("propagated"). Anything else is a failure: another
exception type or message, a changed input (or a changed output after an
error), an accepted output overlapping an input, or a crash. Cases run in
child processes, so a segfault or abort is recorded (with the case's
description) and the child restarted; a case running longer than --hang
seconds is recorded as a hang.

--known-bugs-off leaves out the argument kinds that trip known, reported
dispatcher bugs (see KNOWN_BUG_KINDS), so the rest of the run can show 0.
--dlpack-lies adds DLPack capsules whose metadata is inconsistent (negative
sizes, negative ndim); DLPack producers are trusted, so these are opt-in.
"""
import argparse
import collections
import ctypes
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from fractions import Fraction

CASE_FILE_SIZE = 8192  # the case being run: its bytes (hex) and a description

# Argument kinds that trip dispatcher bugs reported but not fixed in this
# tree (mmdispatch/_core.pyx, _intake.pxi): left out by --known-bugs-off.
KNOWN_BUG_KINDS = {}  # none open: the five kinds found so far are fixed


# --- the child: generate, call, classify ------------------------------------------------

def child_main(args):
    import numpy as np
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st

    import mmdispatch
    from mmdispatch import _benchkit, ops
    from mmdispatch._codegen import parse_signature

    if "asan" not in os.environ.get("LD_PRELOAD", ""):
        # A huge allocation must be a MemoryError here, not the OOM killer.
        # RLIMIT_DATA (private writable memory), not RLIMIT_AS: the CUDA
        # driver, CuPy and torch reserve far more address space than they
        # use (PROT_NONE ranges), which an address-space limit refuses.
        limit = 8 << 30
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    allowed = (TypeError, ValueError, mmdispatch.KernelNotFoundError,
               mmdispatch.DeviceMismatchError, MemoryError)
    signatures = {n: parse_signature(line) for n, line in mmdispatch.op_signatures().items()}
    noop = _benchkit.noop_roi_align_forward_kernel()
    for device in ("cuda", "vulkan"):
        mmdispatch.register_impl("roi_align_forward_impl", device, noop, override=True)
    skip = set(KNOWN_BUG_KINDS) if args.known_bugs_off else set()

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
        if args.dlpack_lies:
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
    def plausible(r, op_name, names):
        """Values of the parameters `names` for a roughly valid call."""
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
            "ious": lambda: np.zeros((m,) if aligned else (m, m), dtype),
            "mode": lambda: r.int(0, 1), "gamma": lambda: 2.0, "alpha": lambda: 0.25,
            "target": lambda: np.array([r.int(0, c) for _ in range(n)], np.int64),
            "weight": lambda: r.choice([None, np.ones(c, dtype)]),
            # user functions
            "output_size": lambda: r.choice([(oh, ow), oh]), "input_shape": lambda: (n, c, h, w),
            "reduction": lambda: r.choice(["mean", "sum", "none"]),
        }
        return {name: makers[name]() for name in names}

    def scalar_value(r, kind, plausible_value):
        choice = r.int(0, 9)
        if choice < 5:
            return plausible_value
        if choice < 8:
            return an_int(r) if kind in ("int", "bool") else a_float(r)
        if kind == "float":
            option = r.choice(["float_param_huge_int", "float_param_array",
                               "float_returns_garbage", "anything"])
            if option not in skip:
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
        params = signatures["roi_align_forward_impl"].params
        values = [a_protocol_object(r, (False, False, True)) if p.is_array
                  else scalar_value(r, p.type, 1) for p in params]
        return ("roi_align_forward_impl", mmdispatch.roi_align_forward_impl, values, set(),
                ("roi_align_forward_impl:",))

    def entry_call(r, op_name):
        params = signatures[op_name].params
        base = plausible(r, op_name, [p.name for p in params])
        values = [array_value(r, base[p.name]) if p.is_array
                  else scalar_value(r, p.type, base[p.name]) for p in params]
        if r.int(0, 9) == 0:   # the same array at two positions
            arrays = [i for i, p in enumerate(params) if p.is_array]
            values[r.choice(arrays)] = values[r.choice(arrays)]
        outputs = {i for i, p in enumerate(params) if p.is_output}
        return op_name, getattr(mmdispatch, op_name), values, outputs, (f"{op_name}:",)

    # user function -> the op names its errors may start with (the function
    # itself, the op it delegates to, the entry point it dispatches to)
    user_prefixes = {
        "roi_align": ("roi_align", "roi_align_forward", "roi_align_forward_impl"),
        "roi_align_forward": ("roi_align_forward", "roi_align_forward_impl"),
        "roi_align_backward": ("roi_align_backward", "roi_align_backward_impl"),
        "roi_pool": ("roi_pool_forward", "roi_pool_forward_impl"),
        "roi_pool_forward": ("roi_pool_forward", "roi_pool_forward_impl"),
        "roi_pool_backward": ("roi_pool_backward", "roi_pool_backward_impl"),
        "nms": ("nms", "nms_impl"), "batched_nms": ("batched_nms", "nms_impl"),
        "bbox_overlaps": ("bbox_overlaps", "bbox_overlaps_impl"),
        "sigmoid_focal_loss": ("sigmoid_focal_loss", "sigmoid_focal_loss_forward_impl"),
        "sigmoid_focal_loss_forward": ("sigmoid_focal_loss_forward",
                                       "sigmoid_focal_loss_forward_impl"),
        "sigmoid_focal_loss_backward": ("sigmoid_focal_loss_backward",
                                        "sigmoid_focal_loss_backward_impl"),
    }
    user_functions = sorted(user_prefixes)

    def user_call(r, name):
        function = getattr(ops, name)
        names = function.__code__.co_varnames[:function.__code__.co_argcount]
        base = plausible(r, user_prefixes[name][-1], [n for n in names if n not in
                                                     ("pool_mode", "mode", "argmax_y",
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
    targets = ([(entry_call, name) for name in sorted(signatures)] * 2
               + [(user_call, name) for name in user_functions]
               + [(lambda r, _: cuda_intake_call(r), None)] * 5)
    assert len(targets) <= 256

    def make_case(data):
        r = Reader(data)
        call, name = r.choice(targets)
        return call(r, name)

    # ---- run and classify ----
    def describe(value, depth=0):
        if isinstance(value, np.ndarray):
            flags = "".join(c for c, f in (("C", "C_CONTIGUOUS"), ("W", "WRITEABLE"),
                                           ("A", "ALIGNED")) if value.flags[f])
            return (f"{type(value).__name__}(shape={value.shape}, dtype={value.dtype.str}, "
                    f"strides={value.strides}, flags={flags})")
        if isinstance(value, (list, tuple)) and depth < 2:
            inner = ", ".join(describe(v, depth + 1) for v in value[:4])
            return f"{type(value).__name__}[{inner}{', ...' if len(value) > 4 else ''}]"
        text = re.sub(r" at 0x[0-9a-f]+", "", repr(value))  # the same in a replay
        return text if len(text) < 120 else text[:117] + "..."

    state = dict(cases=0, per_target=collections.Counter(), outcomes=collections.Counter(),
                 failures={}, propagated=collections.Counter())
    case_file = os.open(args.case_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    deadline = time.monotonic() + args.seconds

    def record_failure(signature, description):
        entry = state["failures"].setdefault(signature, {"count": 0, "example": description})
        entry["count"] += 1

    def run_case(data, target, fn, values, outputs, prefixes):
        description = f"{target}({', '.join(describe(v) for v in values)})"
        os.pwrite(case_file, (data.hex() + "\n" + description).encode("utf-8", "replace")
                  [:CASE_FILE_SIZE].ljust(CASE_FILE_SIZE), 0)
        snapshots = []
        for i, v in enumerate(values):
            for a in arrays_in(v):
                if a.dtype.kind != "O":
                    snapshots.append((i, a, a.tobytes()))
        state["cases"] += 1
        state["per_target"][target] += 1
        if state["cases"] == args.selftest_crash_at:   # proves crashes are caught
            ctypes.string_at(0)
        error = None
        try:
            with np.errstate(all="ignore"):
                fn(*values)
            state["outcomes"]["answer"] += 1
        except Boom as exc:
            state["propagated"][f"{target}: {exc}"] += 1
            state["outcomes"]["propagated"] += 1
            error = exc
        except allowed as exc:
            error = exc
            state["outcomes"][type(exc).__name__] += 1
            if not str(exc).startswith(prefixes):
                record_failure(f"{target}: {type(exc).__name__} without the op name: "
                               f"{normalise(str(exc))}", description)
        except Exception as exc:
            error = exc
            state["outcomes"]["other"] += 1
            record_failure(f"{target}: {type(exc).__name__}: {normalise(str(exc))}", description)
        output_arrays = [a for i, a, _ in snapshots if i in outputs]
        for i, a, before in snapshots:
            if a.tobytes() == before:
                continue
            if error is not None:
                record_failure(f"{target}: an argument was written by a call that raised",
                               description)
            elif i not in outputs:
                overlaps = any(o.size and a.size and np.may_share_memory(a, o)
                               for o in output_arrays)
                record_failure(f"{target}: " + ("an output overlapping an input was accepted"
                                                if overlaps else "an input was written"),
                               description)

    if args.replay:
        data = bytes.fromhex(open(args.replay).read().split()[0])
        case = make_case(data)
        print(f"replaying {case[0]}({', '.join(describe(v) for v in case[2])})", flush=True)
        run_case(data, *case)
        print(json.dumps(dict(outcomes=state["outcomes"], failures=state["failures"],
                              propagated=state["propagated"])))
        return

    @settings(max_examples=args.batch, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.binary(min_size=64, max_size=1024))
    def fuzz(data):
        if state["cases"] < len(targets):
            # each child starts with one case per target, so a short run
            # reaches every target whatever bytes hypothesis draws
            data = bytes([state["cases"]]) + data[1:]
        run_case(data, *make_case(data))

    def report():
        print(json.dumps(dict(cases=state["cases"], per_target=state["per_target"],
                              outcomes=state["outcomes"], failures=state["failures"],
                              propagated=state["propagated"])), flush=True)

    while time.monotonic() < deadline:
        try:
            fuzz()
        except Exception as exc:  # a bug in the generators themselves
            record_failure(f"harness: {type(exc).__name__}: {normalise(str(exc))}",
                           traceback.format_exc()[-1500:])
        report()
    os.close(case_file)


def normalise(message):
    """The message with numbers and reprs blurred, to group failures."""
    message = re.sub(r"0x[0-9a-f]+", "0x?", message)
    message = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", message)
    return message[:160]


# --- the parent: children, crash detection, summary ------------------------------------------

def run_worker(args, worker, seconds, totals):
    """Runs children until `seconds` have passed, restarting after a crash."""
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left < 1:
            return
        with tempfile.NamedTemporaryFile(prefix="mmd-fuzz-case-", delete=False) as f:
            case_file = f.name
        command = [sys.executable, os.path.abspath(__file__), "--child", "--seconds",
                   f"{left:.1f}", "--case-file", case_file, "--batch", str(args.batch)]
        if args.known_bugs_off:
            command.append("--known-bugs-off")
        if args.dlpack_lies:
            command.append("--dlpack-lies")
        if args.selftest_crash_at and not totals["crashes"]:
            command += ["--selftest-crash-at", str(args.selftest_crash_at)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        last, hung = None, False
        try:
            stdout, stderr = proc.communicate(timeout=left + args.hang)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            hung = True
        for line in stdout.splitlines():
            if line.startswith("{"):
                last = json.loads(line)
        if last:
            merge(totals, last)
        if proc.returncode != 0 or hung:
            with open(case_file, encoding="utf-8", errors="replace") as f:
                case = f.read().strip()
            os.makedirs(args.crash_dir, exist_ok=True)
            saved = os.path.join(args.crash_dir, f"case-{worker}-{len(totals['crashes'])}-"
                                                 f"{int(time.time())}.txt")
            with open(saved, "w") as f:
                f.write(case)
            kind = "hang" if hung else (f"signal {-proc.returncode}" if proc.returncode < 0
                                        else f"exit {proc.returncode}")
            totals["crashes"].append(dict(worker=worker, kind=kind,
                                          case=case.split("\n", 1)[-1], saved=saved,
                                          replay=f"python tests/support/fuzz.py --replay {saved}",
                                          stderr=stderr[-2000:]))
            totals["cases"] += 1
        os.unlink(case_file)
        if proc.returncode == 0 and not hung:
            return


def merge(totals, report):
    totals["cases"] += report["cases"]
    for key in ("per_target", "outcomes", "propagated"):
        totals[key].update(report[key])
    for signature, entry in report["failures"].items():
        mine = totals["failures"].setdefault(signature, {"count": 0, "example": entry["example"]})
        mine["count"] += entry["count"]


def parent_main(args):
    import threading

    totals = dict(cases=0, per_target=collections.Counter(), outcomes=collections.Counter(),
                  propagated=collections.Counter(), failures={}, crashes=[])
    lock = threading.Lock()
    per_worker = []

    def worker(index):
        mine = dict(cases=0, per_target=collections.Counter(), outcomes=collections.Counter(),
                    propagated=collections.Counter(), failures={}, crashes=[])
        run_worker(args, index, args.seconds, mine)
        with lock:
            per_worker.append(mine)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for mine in per_worker:
        merge(totals, dict(mine, failures=mine["failures"]))
        totals["crashes"].extend(mine["crashes"])
    elapsed = time.monotonic() - started
    failures = sum(e["count"] for e in totals["failures"].values()) + len(totals["crashes"])
    summary = dict(seconds=round(elapsed, 1), workers=args.workers, cases=totals["cases"],
                   failures=failures, crashes=totals["crashes"], failure_kinds=totals["failures"],
                   outcomes=dict(totals["outcomes"]), per_target=dict(totals["per_target"]),
                   propagated=sum(totals["propagated"].values()),
                   known_bugs_off=args.known_bugs_off, dlpack_lies=args.dlpack_lies)
    print(f"mmdispatch fuzz: {summary['cases']} cases in {summary['seconds']} s "
          f"({args.workers} workers), {failures} failures, {len(totals['crashes'])} crashes")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(totals["outcomes"].items())))
    print(f"exceptions from the fuzz objects' own methods passed through: "
          f"{summary['propagated']}")
    for signature, entry in sorted(totals["failures"].items(), key=lambda kv: -kv[1]["count"]):
        print(f"FAILURE x{entry['count']}: {signature}\n    e.g. {entry['example'][:600]}")
    for crash in totals["crashes"]:
        print(f"CRASH ({crash['kind']}): {crash['case'][:600]}\n    replay: {crash['replay']}"
              f"\n    {crash['stderr'][-600:]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=500, help="examples per hypothesis run")
    parser.add_argument("--hang", type=float, default=60,
                        help="seconds past the budget after which a child counts as hung")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--crash-dir", default="fuzz-crashes",
                        help="where the case of each crash or hang is saved")
    parser.add_argument("--known-bugs-off", action="store_true")
    parser.add_argument("--dlpack-lies", action="store_true")
    parser.add_argument("--replay", help="run the case saved in this file (a crash's case "
                        "file: its first line is the case's bytes in hex) in this process")
    parser.add_argument("--selftest-crash-at", type=int, default=0,
                        help="segfault on purpose at this case (once), to check that "
                        "crashes are caught, saved and replayable")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or args.replay:
        if args.replay and not args.case_file:
            args.case_file = os.devnull
        child_main(args)
        return 0
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
