"""The torch.library registrations of mmdispatch, derived from
signatures.txt and the ops' GRADIENTS tables; nothing here is written per op.

Each entry point `E(...)` becomes a functional custom op
`mmdispatch::<E without _impl>`:

- its schema takes E's input arrays and scalars in E's order; its outputs
  are allocated as E's allocation lines in signatures.txt say (the same
  shapes and dtypes as E's own allocation), and an output without one (the
  backward ops' grad_input, shaped like the forward's input) takes the pair
  `SymInt[] name_shape, ScalarType name_dtype` in its place; it returns the
  outputs, except an output that only holds another's length
  (`keep[:num_kept]`: `keep` is returned trimmed, `num_kept` not);
- its implementation allocates the outputs with torch on the inputs' device
  (torch's caching allocator; zeros for `Tensor+` outputs, which kernels add
  into; large CPU outputs in 2 MB pages where Linux has them, see
  _host_output), makes strided inputs contiguous (one copy), and calls E, so the
  registry, backends and Python kernels apply; on the CPU, float16 and
  bfloat16 are computed in float32 (the C kernels take float32 and float64);
  under torch.use_deterministic_algorithms(True), CUDA calls take the
  `deterministic` backend; a call in a backward pass takes the backends
  and strict mode of the thread that started the pass
  (mmdispatch.use_backend and strict are thread-local, and autograd runs
  CUDA backwards in a thread per device: see _publish_selection);
- its fake implementation returns empty tensors of those shapes (a trimmed
  output gets a data-dependent length), so shapes propagate under
  FakeTensor and torch.compile;
- where an op module's GRADIENTS table says how (mmdispatch/ops/*.py), its
  autograd calls the backward op the table names;
- inside torch.autocast (CPU or CUDA) it runs as torchvision's ops do
  there: floating inputs in float32, the outputs that take the first
  array's dtype cast back to it (DerivedOp.autocast).
"""
import builtins
import ctypes
import functools
import inspect
import itertools
import mmap
import re
import sys
import threading

import torch

from mmdispatch import _core
from mmdispatch import ops as _ops
from mmdispatch._codegen import SHAPE_SCOPE, parse_signature, shape_function, shape_lines

NAMESPACE = "mmdispatch"


def torch_release():
    """torch's (major, minor) release: a pre-release or a vendor's build of
    2.7 ('2.7.0a0+git...', '2.7.0a0+79aa174.nv25.04') counts as 2.7, where
    torch.__version__'s own comparison puts it below 2.7."""
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return int(major), int(minor)


# torch.compile through an op whose output size depends on its data: torch
# 2.4's inductor computed wrong values from such outputs (dets[:, 4] of
# soft_nms's dets), 2.7, 2.11 and 2.14 right (our tests, 2026-11-27)
_DATA_DEPENDENT_COMPILE = torch_release() >= (2, 7)
_SCALAR_TYPES = {"int": "int", "float": "float", "bool": "bool"}
_LOW_PRECISION = (torch.float16, torch.bfloat16)
# Linux's advice that a range be backed by 2 MB pages (None elsewhere), and
# the smallest output that takes it (numpy's threshold for its own arrays)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None) if sys.platform == "linux" else None
_HUGE_PAGE = 1 << 21
_HUGE_PAGE_MIN = 4 << 20


@functools.lru_cache(maxsize=None)
def _madvise():
    """libc's madvise, or None where it cannot be had."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _host_output(shape, dtype, device, zeros):
    """A CPU output, as numpy allocates its large arrays: torch's CPU
    allocator gives a large tensor fresh 4 KB pages, and their faults on
    the first write cost more than the kernels that write them (a 124 MB
    zeroed grad_input: 54 ms with torch.zeros, 13 ms with 2 MB pages), so
    the pages inside a tensor of 4 MB or more are advised into 2 MB ones
    before anything touches them. Only advice: where the kernel declines,
    nothing changes."""
    value = torch.empty(shape, dtype=dtype, device=device)
    nbytes = value.nbytes
    if nbytes >= _HUGE_PAGE_MIN and _MADV_HUGEPAGE is not None:
        madvise = _madvise()
        start = -(-value.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        end = (value.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if madvise is not None and end > start:
            madvise(start, end - start, _MADV_HUGEPAGE)
    return value.zero_() if zeros else value


def _device_output(shape, dtype, device, zeros):
    """An output on a device: from torch's caching allocator."""
    return (torch.zeros if zeros else torch.empty)(shape, dtype=dtype, device=device)


def torch_name(entry_point):
    """The op name of an entry point: roi_align_forward_impl -> roi_align_forward."""
    return entry_point[:-len("_impl")] if entry_point.endswith("_impl") else entry_point


class DerivedOp:
    """One entry point as a functional torch op (see the module docstring)."""

    def __init__(self, signature_text):
        sig = parse_signature(signature_text)
        self.signature = sig
        self.name = torch_name(sig.name)
        self.qualname = f"{NAMESPACE}::{self.name}"
        self.entry_point = getattr(_core, sig.name)
        lengths = {p.length for p in sig.params if p.length}
        allocations = {a.name: a for a in sig.allocations}
        args, self.arg_names = [], []
        # the entry point's call, built from this op's arguments: `arg_of[k]`
        # is the argument that entry-point parameter k takes as it is (None
        # for an output, which run() allocates)
        self.arg_of, self.tensor_params = [], []
        undeclared = {}   # output name -> position of its shape argument (its dtype's next)
        for k, p in enumerate(sig.params):
            if p.is_output:
                self.arg_of.append(None)
                if p.name not in allocations:
                    undeclared[p.name] = len(self.arg_names)
                    args += [f"SymInt[] {p.name}_shape", f"ScalarType {p.name}_dtype"]
                    self.arg_names += [f"{p.name}_shape", f"{p.name}_dtype"]
                continue
            self.arg_of.append(len(self.arg_names))
            if p.is_array:
                self.tensor_params.append(k)
                args.append(f"Tensor{'?' if p.type == 'Tensor?' else ''} {p.name}")
            else:
                args.append(f"{_SCALAR_TYPES[p.type]} {p.name}")
            self.arg_names.append(p.name)
        # how each output is made: a declared one (in allocation-line order;
        # a line may read an output allocated on an earlier one) by its
        # shape function, its dtype (None: the first array's) and zeros;
        # another by its (shape, dtype) arguments
        params = {p.name: k for k, p in enumerate(sig.params)}
        self.shapes = shape_function(sig, {p.name: self.arg_of[k]
                                           for k, p in enumerate(sig.params) if not p.is_output})
        self.declared = [(params[a.name], None if a.dtype is None else getattr(torch, a.dtype),
                          a.zeros) for a in sig.allocations]
        self.undeclared = [(params[name], position, sig.params[params[name]].type == "Tensor+")
                           for name, position in undeclared.items()]
        self.returns = [(params[p.name], params[p.length] if p.length else -1)
                        for p in sig.params if p.is_output and p.name not in lengths]
        self.output_names = [sig.params[k].name for k, _ in self.returns]
        # an output whose length is read back from the device (the nms
        # family): the op cannot be captured into a CUDA graph, and says so
        # to torch.compile's CUDA graphs where this torch has the tag
        self.counted = any(length >= 0 for _, length in self.returns)
        self.first_input = self.arg_of[self.tensor_params[0]]
        self.tensor_args = tuple(self.arg_of[k] for k in self.tensor_params)
        # whether its float32 products follow torch's matmul precision
        self.products = sig.name in _FLOAT32_PRODUCTS
        self.empties = {}
        self.empty_ids = set()   # id() of every tensor in empties (they live as long as the op)
        self.gradient = None   # set by Gradient
        self.run = self.compile_run()
        returned = ", ".join(["Tensor"] * len(self.returns))
        self.schema = (f"({', '.join(args)}) -> "
                       f"{returned if len(self.returns) == 1 else f'({returned})'}")
        tags = {"tags": (_CUDAGRAPH_UNSAFE,)} if self.counted and _CUDAGRAPH_UNSAFE else {}
        self.op = torch.library.custom_op(self.qualname, self.run, mutates_args=(),
                                          schema=self.schema, **tags)
        self.op.register_fake(self.fake)
        # outputs whose dtype is the first array's: autocast casts them back to it
        self.follow_first = {k for k, dtype, _ in self.declared if dtype is None}
        for device_type, key in _AUTOCAST_KEYS:
            _AUTOCAST_LIBRARY.impl(self.name, functools.partial(self.autocast, device_type), key)

    def __call__(self, *args):
        """The op; in eager code on plain tensors (no tracing, no subclass,
        no dispatch mode) its implementation straight away, through its
        Gradient's apply when a gradient is needed (an op without a
        gradient, nms or bbox_overlaps, then gives outputs that need none,
        as MMCV's do): torch.library's machinery, and even more its autograd
        wrapper (which rebuilds the argument list per argument), costs
        several times what a tiny call's work does (the bench's torch rows
        measure it). Under torch's profiler the call is recorded by the
        op's name, as a dispatched op. Traced by torch.onnx.export,
        the ONNX_EXPORTS form of the call."""
        needs_grad = _plain_eager(args, self.tensor_args)
        if needs_grad is None:
            if _onnx_tracing(args[self.first_input]):
                return self.export_onnx(args)
            if _tracing is not None and _tracing() is not None:
                # torch.jit.trace: torch.onnx.export may translate the graph later
                _ON_JIT_TRACE[0]()
            return self.op(*args)
        if _profiling():   # torch.profiler shows the call as it shows a dispatched op's
            with _record_function(self.qualname):
                return self.eager(args, needs_grad)
        return self.eager(args, needs_grad)

    def eager(self, args, needs_grad):
        """__call__'s eager call (_plain_eager's answer `needs_grad`)."""
        if needs_grad > 1:   # _AUTOCAST or _AUTOCAST_GRAD
            return self.eager_autocast(args, needs_grad == _AUTOCAST_GRAD)
        if needs_grad and self.gradient is not None:
            return self.gradient.apply(*args)
        return self.run(*args, eager=not needs_grad)

    def export_onnx(self, args):
        """The call as torch.onnx.export records it (ONNX_EXPORTS)."""
        export = ONNX_EXPORTS.get(self.signature.name)
        if export is None:
            raise sys.modules["torch.onnx"].errors.OnnxExporterError(
                f"{self.name}: torch.onnx.export cannot export it: ONNX has no operator for it "
                f"(the ops that export: {', '.join(sorted(map(torch_name, ONNX_EXPORTS)))})")
        return export(self, args)

    def output_specs(self, args):
        """((parameter index, dtype or None for the first array's, zeros),
        shape) of every output of a call: from the allocation lines of
        signatures.txt, evaluated on the arguments (tensors or FakeTensors),
        or from the call's (shape, dtype) arguments for an output without
        one."""
        specs = zip(self.declared, self.shapes(args))
        if not self.undeclared:
            return specs
        return itertools.chain(specs, [((k, args[i + 1], zeros), args[i])
                                       for k, i, zeros in self.undeclared])

    def compile_run(self):
        """The implementation, `run(*args, eager=False)`: Python code
        generated for this op, which takes the common call (contiguous
        inputs, none in float16 or bfloat16 on the CPU, no deterministic
        CUDA backend to select) to the entry point with a few attribute
        reads, the shapes computed inline and the outputs allocated
        directly; every other call goes to run_general, which the result
        equals. A tiny roi_align call's implementation takes 3.7 µs this
        way and 5.2 µs through run_general's loops over the signature (the
        2-core build machine, 2026-11-26)."""
        sig = self.signature
        a = [f"a{i}" for i in range(len(self.arg_names))]
        names = {}
        for k, p in enumerate(sig.params):
            if self.arg_of[k] is not None:
                names[p.name] = a[self.arg_of[k]] + (".shape" if p.is_array else "")
        tensors = [(a[self.arg_of[k]], sig.params[k].type == "Tensor?")
                   for k in self.tensor_params]
        contiguous = " and ".join(f"({t} is None or {t}.is_contiguous())" if optional
                                  else f"{t}.is_contiguous()" for t, optional in tensors)
        first = a[self.first_input]
        low = " or ".join(f"({t} is not None and {t}.dtype in _LOW)" if optional
                          else f"{'_dtype' if t == first else f'{t}.dtype'} in _LOW"
                          for t, optional in tensors)
        general = f"return _general({''.join(f'{x}, ' for x in a)}eager=eager)"
        lines = [f"def run({''.join(f'{x}, ' for x in a)}eager=False):",
                 f"    if not ({contiguous}) or (_published[0] and _node() is not None"
                 f" and _handed_over() is not _OWN):",
                 f"        {general}",
                 f"    _dtype = {first}.dtype",
                 f"    _device = {first}.device",
                 f"    if {first}.is_cpu:",
                 f"        if {low}:",
                 f"            {general}",
                 "        _new = _host_output",
                 f"    elif {first}.is_cuda and _deterministic():",
                 f"        {general}",
                 "    else:",
                 "        _new = _device_output",
                 *shape_lines(sig, names, target="_s")]
        scope = dict(SHAPE_SCOPE, _general=self.run_general, _LOW=_LOW_PRECISION,
                     _host_output=_host_output, _device_output=_device_output,
                     _deterministic=torch.are_deterministic_algorithms_enabled,
                     _handed_over=_handed_over, _OWN=_OWN, _published=_SELECTION_PUBLISHED,
                     _node=_current_node,
                     _empty=self.empty, _EMPTY=_EMPTY_SHAPE, _entry=self.entry_point)
        call = [None if i is None else a[i] for i in self.arg_of]
        for j, (k, dtype, zeros) in enumerate(self.declared):
            call[k] = f"o{k}"
            dtype_code = "_dtype" if dtype is None else f"_D{k}"
            if dtype is not None:
                scope[dtype_code] = dtype
            lines.append(f"    o{k} = (_empty({k}, {dtype_code}, _device) if eager and _s{j} == _EMPTY"
                         f" else _new(_s{j}, {dtype_code}, _device, {zeros}))")
        for k, position, zeros in self.undeclared:
            call[k] = f"o{k}"
            lines.append(f"    o{k} = (_empty({k}, {a[position + 1]}, _device)"
                         f" if eager and tuple({a[position]}) == _EMPTY"
                         f" else _new({a[position]}, {a[position + 1]}, _device, {zeros}))")
        if self.counted:
            lines.append(f"    if {first}.is_cuda and _capturing(): _refuse_capture()")
            scope.update(_capturing=torch.cuda.is_current_stream_capturing,
                         _refuse_capture=self.refuse_capture)
        if self.products:   # torch's float32 matmul precision for the call's products
            lines += ["    _previous = _swap_tf32(_torch_tf32())",
                      "    try:",
                      f"        _entry({', '.join(call)})",
                      "    finally:",
                      "        _swap_tf32(_previous)"]
            scope.update(_swap_tf32=_core._swap_thread_tf32, _torch_tf32=_torch_tf32)
        else:
            lines.append(f"    _entry({', '.join(call)})")
        results = [f"o{k}[:int(o{length}[0])]" if length >= 0 else f"o{k}"
                   for k, length in self.returns]
        lines.append(f"    return {results[0] if len(results) == 1 else '(' + ', '.join(results) + ')'}")
        scope["__builtins__"] = {"tuple": tuple, "int": int, "bool": bool}
        scope["__name__"] = __name__
        exec(compile("\n".join(lines), f"<mmdispatch.torch run of {sig.name}>", "exec"), scope)
        run = scope["run"]
        run.source = "\n".join(lines)
        return run

    def run_general(self, *args, eager=False):
        """The implementation for any call (see compile_run)."""
        first = args[self.first_input]
        device, cpu = first.device, first.is_cpu
        call = [None if i is None else args[i] for i in self.arg_of]
        upcast = False
        for k in self.tensor_params:
            value = call[k]
            if value is None:
                continue
            if not value.is_contiguous():
                call[k] = value = value.contiguous()
            if cpu and value.dtype in _LOW_PRECISION:
                upcast = True
        if upcast:   # the CPU kernels take float32 and float64
            for k in self.tensor_params:
                if call[k] is not None and call[k].dtype in _LOW_PRECISION:
                    call[k] = call[k].float()
        wanted = {}   # output -> its dtype, where the kernel computes it in float32
        first_dtype = first.dtype
        for (k, dtype, zeros), shape in self.output_specs(args):
            dtype = dtype or first_dtype
            if upcast and dtype in _LOW_PRECISION:
                wanted[k], dtype = dtype, torch.float32
            if eager and tuple(shape) == _EMPTY_SHAPE:   # an output the call leaves unused
                call[k] = self.empty(k, dtype, device)
            else:
                call[k] = (_host_output if cpu else _device_output)(shape, dtype, device, zeros)
        if self.counted and first.is_cuda and torch.cuda.is_current_stream_capturing():
            self.refuse_capture()
        self.call_entry_point(call, first.is_cuda)
        results = []
        for k, length in self.returns:
            value = call[k]
            if length >= 0:   # reads the count back (a synchronisation on a GPU)
                value = value[:int(call[length][0])]
            if wanted and k in wanted:
                value = value.to(wanted[k])
            results.append(value)
        return results[0] if len(results) == 1 else tuple(results)

    def refuse_capture(self):
        """The error of an op whose output length is read back from the
        device, called while torch's current CUDA stream captures a graph
        (before anything is launched: the capture goes on)."""
        raise RuntimeError(
            f"{self.name}: its output's length depends on the data and is read back from the "
            f"device, so it cannot be captured into a CUDA graph: call it outside the capture, "
            f"or capture mmdispatch.{self.signature.name} with outputs of your own (the count "
            f"stays on the device)")

    def call_entry_point(self, call, cuda):
        """The entry point: in a thread of torch's autograd, with the
        backends and strict mode of the thread that started the backward
        pass (_published_selection); on CUDA arrays under
        torch.use_deterministic_algorithms(True), with the CUDA backend that
        gives the same bits on every run; with torch's float32 matmul
        precision for an op with float32 products."""
        if self.products:
            previous = _core._swap_thread_tf32(_torch_tf32())
            try:
                return self.call_selected(call, cuda)
            finally:
                _core._swap_thread_tf32(previous)
        return self.call_selected(call, cuda)

    def call_selected(self, call, cuda):
        """call_entry_point's call, with the backends it takes."""
        handed_over = _handed_over()
        elsewhere = handed_over is not _OWN
        if elsewhere:
            previous = _core._set_thread_selection(handed_over)
        try:
            if cuda and torch.are_deterministic_algorithms_enabled():
                _THREAD.paused = True   # the call's own choice, not the thread's
                try:
                    with _core.use_backend("cuda", "deterministic"):
                        self.entry_point(*call)
                finally:
                    _THREAD.paused = False
            else:
                self.entry_point(*call)
        finally:
            if elsewhere:
                _core._set_thread_selection(previous)

    def autocast(self, device_type, *args):
        """The op inside torch.autocast(device_type), as torchvision's ops
        behave there: its floating inputs on that device (float64 aside)
        run in float32, so boxes keep their precision beside float16
        features, and the outputs that take the first array's dtype are
        cast back to it (an output whose dtype is an argument, to that
        dtype). The casts are ordinary torch ops, so gradients flow. (The
        kernel torch's dispatcher runs for AutocastCPU and AutocastCUDA;
        eager calls on plain tensors do the same in eager_autocast.)"""
        call, wanted = self.autocast_arguments(device_type, args)
        with torch.autocast(device_type, enabled=False):
            return self.autocast_results(self.op(*call), wanted)

    def eager_autocast(self, args, needs_grad):
        """An eager call on plain tensors while autocast is on: as the
        autocast kernel (autocast) where it is on for the first tensor's
        device type (the dispatch key torch would take): the casts, then
        the implementation straight away, as __call__'s, with autocast off
        for that device type meanwhile (a Python kernel's torch ops compute
        as they would in the autocast kernel's `autocast(enabled=False)`
        block); torch.library's dispatch through the autocast kernel cost
        about 40 us more a call than torchvision's C++ autocast kernels
        (2026-11-28). Where autocast is on for another device type only,
        the plain call. The casts keep requires_grad, so needs_grad holds
        for the cast arguments."""
        device_type = args[self.first_input].device.type
        if device_type not in _AUTOCAST_TYPES or not _autocast_on(device_type):
            return self.eager(args, needs_grad)
        call, wanted = self.autocast_arguments(device_type, args)
        _set_autocast(device_type, False)
        try:
            result = self.eager(call, needs_grad)
        finally:
            _set_autocast(device_type, True)
        return self.autocast_results(result, wanted)

    def autocast_arguments(self, device_type, args):
        """(the call's arguments, {output parameter: dtype it is cast to})
        under autocast (see autocast)."""
        first_dtype = args[self.first_input].dtype
        call = list(args)
        for i in self.tensor_args:
            value = call[i]
            if (value is not None and value.is_floating_point() and value.dtype != torch.float64
                    and value.device.type == device_type):
                call[i] = value.float()
        wanted = {k: first_dtype for k in self.follow_first}
        for k, i, _ in self.undeclared:
            if call[i + 1] in _LOW_PRECISION:
                wanted[k], call[i + 1] = call[i + 1], torch.float32
        return call, wanted

    def autocast_results(self, result, wanted):
        """The outputs of a call under autocast, cast to `wanted`."""
        results = list(result) if isinstance(result, tuple) else [result]
        for r, (k, _) in enumerate(self.returns):
            if k in wanted and results[r].dtype != wanted[k]:
                results[r] = results[r].to(wanted[k])
        return results[0] if len(results) == 1 else tuple(results)

    def empty(self, param, dtype, device):
        """A zero-size tensor for output `param`, made once per dtype and
        device: an unused output (roi_align's argmax pair in avg mode) costs
        an allocation otherwise. Only eager calls take it (Gradient.apply
        too, which returns it untouched): what torch.library returns gets
        autograd metadata attached."""
        key = (param, dtype, device)
        value = self.empties.get(key)
        if value is None:   # one tensor kept per key, whichever thread makes it first
            # not an inference tensor, though the first call runs in
            # inference_mode: later calls outside it return it too (nms's
            # keep of no boxes), and an inference tensor cannot be saved
            # for backward (boxes[keep] with boxes that need a gradient)
            with torch.inference_mode(False):
                made = torch.empty(_EMPTY_SHAPE, dtype=dtype, device=device)
            value = self.empties.setdefault(key, made)
            self.empty_ids.add(id(value))
        return value

    def fake(self, *args):
        device = args[self.first_input].device
        first_dtype = args[self.first_input].dtype
        specs = {k: (shape, dtype or first_dtype)
                 for (k, dtype, _), shape in self.output_specs(args)}
        results = []
        sizes = {}   # one data-dependent size per length output (soft_nms: dets and keep)
        for k, length in self.returns:
            shape, dtype = specs[k]
            shape = list(shape)
            if length >= 0:
                if not _DATA_DEPENDENT_COMPILE:
                    raise RuntimeError(
                        f"{self.name}: tracing an op whose output size depends on its data "
                        f"needs torch 2.7 or newer (torch {torch.__version__}'s inductor "
                        f"computed wrong values from such outputs); call {self.name} outside "
                        f"the compiled region")
                if length not in sizes:
                    sizes[length] = torch.library.get_ctx().new_dynamic_size()
                shape[0] = sizes[length]
            results.append(torch.empty(shape, dtype=dtype, device=device))
        return results[0] if len(results) == 1 else tuple(results)


# entry points whose float32 products follow torch's float32 matmul
# precision (their modules' FLOAT32_PRODUCTS: deform_conv2d's cuBLAS
# products, as torchvision's, whose at::addmm follows it)
def _float32_product_ops():
    return frozenset(name for module in _ops._MODULES
                     for name in getattr(module, "FLOAT32_PRODUCTS", ()))


_FLOAT32_PRODUCTS = _float32_product_ops()
_fp32_precision = getattr(torch._C, "_get_fp32_precision_getter", None)


def _torch_tf32():
    """1 where torch's float32 matmul precision lets its CUDA products run
    in TF32, else 0: torch.backends.cuda.matmul.fp32_precision, falling
    back to torch.backends.cuda.fp32_precision and then
    torch.backends.fp32_precision where "none" (torch 2.9 and later, whose
    torch.set_float32_matmul_precision and matmul.allow_tf32 set the first;
    read through the getter, which does not raise where a program mixed
    the old and the new settings), or matmul.allow_tf32 (earlier torch)."""
    if _fp32_precision is not None:
        for backend, op in _PRECISION_CHAIN:
            precision = _fp32_precision(backend, op)
            if precision != "none":
                return int(precision == "tf32")
        return 0
    return int(torch.backends.cuda.matmul.allow_tf32)


_PRECISION_CHAIN = (("cuda", "matmul"), ("cuda", "all"), ("generic", "all"))


# the autocast kernels (DerivedOp.autocast), in a library of their own
_AUTOCAST_LIBRARY = torch.library.Library(NAMESPACE, "IMPL")
_AUTOCAST_KEYS = (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA"))
_EMPTY_SHAPE = (0,)
# torch.compile's CUDA graphs leave ops with this tag out (torch 2.8 and
# later; custom_op takes tags from 2.5)
_CUDAGRAPH_UNSAFE = (getattr(torch.Tag, "cudagraph_unsafe", None)
                     if "tags" in inspect.signature(torch.library.custom_op).parameters else None)


# The thread's backend selection and strict mode (_core._thread_selection)
# in torch's thread-local Python objects, which torch's autograd hands to
# the threads it runs a backward pass in (its ThreadLocalState, taken when
# the pass starts): the CUDA backward ops of a pass started inside
# `use_backend("cuda", "deterministic")` run in a thread of autograd's own,
# where the selection made in the caller's thread is otherwise not seen.
_SELECTION_KEY = "mmdispatch.selection"
_stash_in_tls = getattr(torch._C, "_stash_obj_in_tls", None)
_get_from_tls = getattr(torch._C, "_get_obj_in_tls", None)
_is_in_tls = getattr(torch._C, "_is_key_in_tls", None)
# the node autograd runs in this thread (None outside a backward pass): only
# calls there look for a selection handed over (65 ns, where reading torch's
# thread-local objects takes 400)
_current_node = getattr(torch._C, "_current_autograd_node", None)
_SELECTION_TLS = None not in (_stash_in_tls, _get_from_tls, _is_in_tls, _current_node)
# [whether any thread ever published a selection]: until one does, calls
# do not look (a list, read by the generated implementations)
_SELECTION_PUBLISHED = [False]
# .paused: whether the hook leaves this thread's selection unpublished,
# while a call takes the deterministic backend for
# torch.use_deterministic_algorithms (the call's own choice)
_THREAD = threading.local()


def _publish_selection():
    """The calling thread's selection into torch's thread-local objects
    (mmdispatch's hook: called after each change of it)."""
    if getattr(_THREAD, "paused", False):
        return
    selection = _core._thread_selection()
    if selection is not None:
        _SELECTION_PUBLISHED[0] = True
    elif not _SELECTION_PUBLISHED[0]:
        return
    _stash_in_tls(_SELECTION_KEY, selection)


def _published_selection():
    """The selection torch's thread-local objects hold here (None: the
    defaults, or none published): in a thread of autograd's, that of the
    thread that started the backward pass."""
    if not _SELECTION_PUBLISHED[0] or not _is_in_tls(_SELECTION_KEY):
        return None
    return _get_from_tls(_SELECTION_KEY)


_OWN = object()   # _handed_over's answer where the thread's own selection holds


def _handed_over():
    """The selection a call here must take instead of its own thread's (in
    a backward pass that autograd runs in a thread of its own: the
    selection handed over, None for the defaults), or _OWN."""
    if not _SELECTION_PUBLISHED[0] or _current_node() is None:
        return _OWN
    published = _published_selection()
    return _OWN if published == _core._thread_selection() else published


if _SELECTION_TLS:
    _core._set_selection_hook(_publish_selection)
    _publish_selection()   # a selection made before this import
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
# whether torch's profiler records (eager calls then record the op's name,
# as torch's dispatcher does for a dispatched op: 0.1 us a call otherwise)
_profiling = getattr(torch._C._autograd, "_profiler_enabled", lambda: False)
_record_function = torch.autograd.profiler.record_function
# private torch functions (present in every torch we support); without them
# every call goes through torch.library
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)
# _plain_eager's answers for a call under autocast (DerivedOp.eager_autocast),
# without and with a gradient needed: above True
_AUTOCAST, _AUTOCAST_GRAD = 2, 3
_AUTOCAST_TYPES = frozenset(device_type for device_type, _ in _AUTOCAST_KEYS)


def _autocast_on(device_type):
    """Whether autocast is on for `device_type` ("cpu" or "cuda")."""
    return torch.is_autocast_enabled(device_type)


def _set_autocast(device_type, enabled):
    """Autocast on or off for `device_type` (its flag only, as the
    autocast context manager sets it)."""
    torch.set_autocast_enabled(device_type, enabled)


try:
    _autocast_on("cpu")
except TypeError:   # a torch without is_autocast_enabled(device_type)
    def _autocast_on(device_type):
        return (torch.is_autocast_enabled() if device_type == "cuda"
                else torch.is_autocast_cpu_enabled())

    def _set_autocast(device_type, enabled):
        (torch.set_autocast_enabled if device_type == "cuda"
         else torch.set_autocast_cpu_enabled)(enabled)
_tracing = getattr(torch._C, "_get_tracing_state", None)
_functorch = getattr(torch._C, "_are_functorch_transforms_active", None)


# entry point -> how a call of it that torch.onnx.export traces is recorded
# (mmdispatch.torch._onnx fills it: our op with a symbolic function for
# the TorchScript exporter, ONNX operators or torchvision's nms for the
# torch.export-based one, or torch's own operators for both)
ONNX_EXPORTS: dict = {}
# called when torch.jit.trace records one of our ops (mmdispatch.torch._onnx
# sets it: the TorchScript exporter's symbolic functions of our ops)
_ON_JIT_TRACE = [lambda: None]


def _onnx_exporting():
    """Whether torch.onnx.export is tracing the call (either exporter);
    never before something imported torch.onnx (torch imports it lazily).
    torch.export's strict mode (TorchDynamo) takes is_in_onnx_export() for
    False: it calls this function instead, outside its trace."""
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and onnx.is_in_onnx_export()


# what torch.compiler.assume_constant_result(_onnx_exporting) does: calling
# it imports TorchDynamo (over a second at `import mmdispatch.torch`)
setattr(_onnx_exporting, "_dynamo_marked_constant", True)
# True only in code TorchDynamo traces (torch.compiler.is_compiling() is
# also true in every other thread while one runs torch.export)
_dynamo_tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def _onnx_tracing(tensor):
    """Whether torch.onnx.export is tracing this call: the exporter's flag
    is the process's, so a call of another thread (plain tensors, no trace
    of its own) must not take it for itself. Evidence of this thread's
    trace first (cheaper than the flag): torch.jit.trace's (thread-local),
    TorchDynamo's (true only in the code it traces), or the FakeTensors of
    torch.export's non-strict trace."""
    return ((_tracing is not None and _tracing() is not None) or _dynamo_tracing()
            or type(tensor) is not _Tensor) and _onnx_exporting()


def _plain_eager(args, tensor_args):
    """None when a call needs torch's dispatch (traced by torch.compile or
    torch.jit.trace, whose tracer records only what reaches the dispatcher:
    a call straight to the kernel would leave the traced graph returning
    the outputs' uninitialised memory; a tensor that is not a plain
    torch.Tensor or nn.Parameter (a module's weight, as deform_conv2d's,
    with no torch-function override), such as a FakeTensor; a dispatch or
    torch-function mode active; or a torch.func transform (vmap, grad,
    jacrev) active, whose wrapped tensors are of type torch.Tensor but hold no
    storage for the kernel to read), or a first array on the meta device
    (torch's dispatch runs the fake implementation, whose outputs are meta
    tensors; a meta tensor after a real first array goes to the kernel,
    which refuses it, where the fake implementation would return
    uninitialised memory on the real device); else whether a tensor
    argument needs a gradient, as _AUTOCAST_GRAD or _AUTOCAST (both above
    True) where autocast is on for some device type."""
    if (_dispatch_modes is None or _function_modes is None or _autocast is None
            or _tracing is None or _functorch is None or _dynamo_tracing()
            or _tracing() is not None or _functorch()):
        return None
    first = args[tensor_args[0]]
    if (type(first) is not _Tensor and type(first) is not _Parameter) or first.is_meta:
        return None   # meta: the fake implementation
    grad, needs_grad = torch.is_grad_enabled(), False
    for i in tensor_args:
        value = args[i]
        if value is not None:
            if type(value) is not _Tensor and type(value) is not _Parameter:
                return None
            needs_grad = needs_grad or (grad and value.requires_grad)
    if _dispatch_modes() or _function_modes():
        return None
    if _autocast():
        return _AUTOCAST_GRAD if needs_grad else _AUTOCAST
    return needs_grad


def _one_value(grad):
    """A gradient that is one value broadcast (every stride 0, as torch's
    backward of a sum or a mean hands it over) as that value, 0-d, for a
    backward op that takes it so ("broadcast_grad"); any other, contiguous."""
    if grad.dim() and grad.numel() and not any(grad.stride()):
        return grad.as_strided((), ())
    return grad.contiguous()


class _BackwardCall:
    """One call of a backward op, giving the gradients of one or more
    forward arguments: its arguments come from the forward's (see
    Gradient), and each gradient is one of its outputs."""

    def __init__(self, forward, backward, rule):
        self.backward = backward
        self.grad_output = rule.get("grad_output")
        self.times_grad_of = rule.get("times_grad_of")
        self.broadcast_grad = rule.get("broadcast_grad", False)
        self.grad_of = forward.output_names.index(self.grad_output or self.times_grad_of)
        self.results = {}   # forward argument index -> position among the backward's returns

    def add(self, forward, wrt, rule):
        outputs = self.backward.output_names
        result = rule.get("result")
        if result is None:
            if len(outputs) != 1:
                raise ValueError(f"{self.backward.name}: name the output that is the gradient "
                                 f"of {wrt!r} (\"result\")")
            result = outputs[0]
        self.results[forward.arg_names.index(wrt)] = outputs.index(result)

    def resolve(self, forward):
        """Where each backward argument comes from: ("grad"), ("wrt", (forward
        argument, dtype?)), ("needed", forward argument) for a bool
        `with_<result>` (whether that gradient is wanted), ("input", index)
        or ("output", index)."""
        by_result = {self.backward.output_names[r]: wrt for wrt, r in self.results.items()}
        self.sources = []
        for name in self.backward.arg_names:
            base = name.rsplit("_", 1)[0]
            if name == "grad_output" and self.grad_output:
                self.sources.append(("grad", 0))
            elif name.startswith("with_") and name[5:] in by_result:
                self.sources.append(("needed", by_result[name[5:]]))
            elif base in by_result and name in (f"{base}_shape", f"{base}_dtype"):
                self.sources.append(("wrt", (by_result[base], name.endswith("_dtype"))))
            elif name in forward.arg_names:
                self.sources.append(("input", forward.arg_names.index(name)))
            elif name in forward.output_names:
                self.sources.append(("output", forward.output_names.index(name)))
            else:
                raise ValueError(f"{self.backward.name}: no forward value for {name!r}")


class Gradient:
    """The autograd of a derived op, from its module's GRADIENTS entry
    {wrt: rule}: the gradient of forward argument `wrt` is an output of the
    backward op the rule names (its "result", or its only output); the
    backward op's `grad_output` is the gradient of the forward output the
    rule names, or the result is scaled by that gradient ("times_grad_of");
    every other backward argument is the forward's argument or output of
    the same name, the shape/dtype of `wrt` (`<result>_shape`,
    `<result>_dtype`), or whether `wrt` needs a gradient (a bool
    `with_<result>`: the backward then computes only the gradients asked
    for). "broadcast_grad": the backward op takes a 0-d grad_output as the
    gradient of every element, and gets one where torch broadcast it.
    Rules naming the same backward op share one call of it, made only when
    one of their arguments needs a gradient."""

    def __init__(self, forward, rules, derived):
        self.forward = forward
        calls = {}
        for wrt, rule in rules.items():
            key = (rule["backward"], rule.get("grad_output"), rule.get("times_grad_of"))
            if key not in calls:
                calls[key] = _BackwardCall(forward, derived[rule["backward"]], rule)
            calls[key].add(forward, wrt, rule)
        self.calls = list(calls.values())
        for call in self.calls:
            call.resolve(forward)
        self.wrts = sorted(wrt for call in self.calls for wrt in call.results)
        self.grads_of = {call.grad_of for call in self.calls}
        sources = [source for call in self.calls for source in call.sources]
        saved_inputs = {i for kind, i in sources if kind == "input"}
        # saved as tensors (an absent optional one as None), and as they are
        self.saved_tensors = sorted(saved_inputs & set(forward.tensor_args))
        self.saved_scalars = sorted(saved_inputs - set(forward.tensor_args))
        self.saved_outputs = sorted({i for kind, i in sources if kind == "output"})
        self.non_differentiable = [r for r in range(len(forward.returns))
                                   if r not in self.grads_of]
        self.gradients = self.compile_gradients()
        self.setup_context, self.apply = self.compile_autograd()
        forward.op.register_autograd(self.backward_fn, setup_context=self.setup_context)
        forward.gradient = self

    def compile_autograd(self):
        """(setup_context, apply): Python code generated for this op, as
        DerivedOp.compile_run's. setup_context(ctx, inputs, output) is what
        torch.library runs (torch.compile, export) and apply(*args) the op
        with its autograd in eager code (DerivedOp.__call__ on plain
        tensors): a torch.autograd.Function of the op's own whose forward
        is the implementation and the same setup, without torch.library's
        per-call wrapper. Unrolled, the setup of a tiny roi_align call took
        about 1.5 us where the loops over the saved values took 4 (the
        2-core build machine, 2026-11-28).

        The setup keeps the shapes and dtypes of the arguments it gives
        gradients to (ctx.wrt_specs), the inputs and outputs the backward
        reads (ctx.saved_tensors, ctx.scalars), and as it is, not saved
        (ctx.kept), an eager call's unused (0,) output: one tensor shared by
        every call (DerivedOp.empty: roi_align's argmax pair in avg mode),
        in which nothing can change, and an in-place op of one caller on
        it must not fail another call's backward (a size test would guard
        on a data-dependent size under torch.compile). An output found by
        identity among the op's empties."""
        forward = self.forward
        a = [f"a{i}" for i in range(len(forward.arg_names))]
        o = [f"o{r}" for r in range(len(forward.returns))]
        unpack = f"    {', '.join(o)}, = output" if len(o) > 1 else "    o0 = output"
        specs = ", ".join(f"{i}: None if {a[i]} is None else (tuple({a[i]}.shape), {a[i]}.dtype)"
                          for i in self.wrts)
        setup = [f"    ctx.wrt_specs = {{{specs}}}"]
        kept = [f"k{j}" for j in range(len(self.saved_outputs))]
        for k, r in zip(kept, self.saved_outputs):
            setup.append(f"    {k} = o{r} if id(o{r}) in _empty_ids else None")
        saved = [a[i] for i in self.saved_tensors] + [
            f"None if {k} is not None else o{r}" for k, r in zip(kept, self.saved_outputs)]
        setup += [f"    ctx.kept = ({''.join(f'{k}, ' for k in kept)})",
                  f"    ctx.save_for_backward({', '.join(saved)})",
                  f"    ctx.scalars = ({''.join(f'{a[i]}, ' for i in self.saved_scalars)})"]
        lines = [f"def setup_context(ctx, inputs, output):",
                 f"    {''.join(f'{x}, ' for x in a)}= inputs", unpack, *setup,
                 f"def forward(ctx, {', '.join(a)}):",
                 f"    output = _run({''.join(f'{x}, ' for x in a)}eager=True)", unpack]
        # eager: an unused (0,) output is the op's shared one, not allocated
        # (autograd leaves a non-differentiable output that is not an input
        # as it is), but a differentiable one gets its own tensor: autograd
        # attaches its history to it
        for r in sorted(self.grads_of):
            lines.append(f"    if id(o{r}) in _empty_ids: o{r} = o{r}.clone()")
        # no zero-filled gradients for the outputs that got none (argmax
        # outputs, marked non-differentiable below): a (1024, 256, 7, 7)
        # roi_pool argmax's zeros took 20 ms of a 270 ms forward+backward;
        # gradients() skips a backward call whose output's gradient is None
        lines += ["    ctx.set_materialize_grads(False)", *setup]
        if self.non_differentiable:
            lines.append(f"    ctx.mark_non_differentiable("
                         f"{', '.join(o[r] for r in self.non_differentiable)})")
        lines.append(f"    return ({', '.join(o)},)" if len(o) > 1 else "    return o0")
        lines += ["def backward(ctx, *grads):",
                  "    return _gradients(ctx, ctx.needs_input_grad, grads)"]
        scope = {"_run": forward.run, "_empty_ids": forward.empty_ids,
                 "_gradients": self.gradients,
                 "__builtins__": builtins, "__name__": __name__}
        exec(compile("\n".join(lines), f"<mmdispatch.torch autograd of {forward.signature.name}>",
                     "exec"), scope)
        function = type(f"{forward.name}_autograd", (torch.autograd.Function,),
                        {"forward": staticmethod(scope["forward"]),
                         "backward": staticmethod(scope["backward"]),
                         "__module__": __name__, "source": "\n".join(lines)})
        return scope["setup_context"], function.apply

    def backward_fn(self, ctx, *grads):
        return self.gradients(ctx, ctx.needs_input_grad, grads)

    def compile_gradients(self):
        """gradients(ctx, needed, grads): the forward arguments' gradients,
        those `needed` says, as Python code generated for this op (see
        compile_autograd). Each backward call runs where the gradient of
        the output it takes is not None and an argument it gives a
        gradient to needs one; the backward op goes straight to its
        implementation in eager code (DerivedOp.__call__ decides), through
        torch.library when a graph of the backward is recorded
        (create_graph=True), whose outputs refuse a second backward. A
        gradient that is the backward op's shared (0,) output is copied:
        hooks may write into it."""
        forward = self.forward
        names = {i: f"t{i}" for i in self.saved_tensors}
        names.update({i: f"c{i}" for i in self.saved_scalars})
        outputs = {i: f"u{i}" for i in self.saved_outputs}
        result = [f"r{i}" if i in self.wrts else "None" for i in range(len(forward.arg_names))]
        lines = ["def gradients(ctx, needed, grads):",
                 *(f"    r{i} = None" for i in self.wrts)]
        runs = []
        for n, call in enumerate(self.calls):
            wanted = " or ".join(f"needed[{wrt}]" for wrt in call.results)
            lines.append(f"    g{n} = grads[{call.grad_of}]")
            lines.append(f"    run{n} = g{n} is not None and ({wanted})")
            runs.append(f"run{n}")
        lines.append(f"    if {' or '.join(runs)}:")
        saved = [names[i] for i in self.saved_tensors] + [outputs[i] for i in self.saved_outputs]
        if saved:
            lines.append(f"        {''.join(f'{x}, ' for x in saved)}= ctx.saved_tensors")
        if self.saved_scalars:
            lines.append(f"        {''.join(f'{names[i]}, ' for i in self.saved_scalars)}"
                         f"= ctx.scalars")
        for j, i in enumerate(self.saved_outputs):
            lines.append(f"        if ctx.kept[{j}] is not None: {outputs[i]} = ctx.kept[{j}]")
        if not saved and not self.saved_scalars:   # a backward of nothing saved
            lines.append("        pass")
        # the whole builtins: torch.compile traces this code (and looks up
        # __import__ in its globals' builtins)
        scope = {"_grad_enabled": torch.is_grad_enabled, "_one_value": _one_value,
                 "__builtins__": builtins, "__name__": __name__}
        for n, call in enumerate(self.calls):
            args = []
            for kind, i in call.sources:
                if kind == "grad":
                    args.append(f"_one_value(g{n})" if call.broadcast_grad
                                else f"g{n}.contiguous()")
                elif kind == "needed":
                    args.append(f"needed[{i}]")
                elif kind == "wrt":
                    wrt, is_dtype = i
                    args.append(f"ctx.wrt_specs[{wrt}][{1 if is_dtype else 0}]")
                else:
                    args.append(names[i] if kind == "input" else outputs[i])
            scope[f"_op{n}"], scope[f"_eager{n}"] = call.backward.op, call.backward
            scope[f"_empty{n}"] = call.backward.empty_ids
            lines += [f"    if run{n}:",
                      f"        ret = (_op{n} if _grad_enabled() else _eager{n})({', '.join(args)})"]
            if len(call.backward.returns) == 1:
                lines.append("        ret = (ret,)")
            for wrt, position in call.results.items():
                lines += [f"        if needed[{wrt}]:",
                          f"            r{wrt} = ret[{position}]",
                          f"            if id(r{wrt}) in _empty{n}: r{wrt} = r{wrt}.clone()"]
                if call.times_grad_of:
                    lines.append(f"            r{wrt} = r{wrt} * g{n}")
        lines.append(f"    return ({''.join(f'{x}, ' for x in result)})")
        exec(compile("\n".join(lines), f"<mmdispatch.torch gradients of {forward.signature.name}>",
                     "exec"), scope)
        gradients = scope["gradients"]
        gradients.source = "\n".join(lines)
        return gradients


def _gradient_tables():
    """{forward entry point: {argument: rule}} from every op module."""
    tables = {}
    for module in _ops._MODULES:
        tables.update(getattr(module, "GRADIENTS", {}))
    return tables


def _register():
    derived = {name: DerivedOp(line) for name, line in _core.op_signatures().items()}
    gradients = [Gradient(derived[forward], rules, derived)
                 for forward, rules in _gradient_tables().items()]
    return derived, gradients


# entry point -> DerivedOp, and the autograd registrations
DERIVED, GRADIENTS = _register()
