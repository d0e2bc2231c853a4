"""The torch.library registrations of mmdispatch, derived from
signatures.txt and the ops' GRADIENTS tables; nothing here is written per op.

Each entry point `E(...)` becomes a functional custom op
`mmdispatch::<E without _impl>`:

- its schema takes E's input arrays and scalars in E's order, and for each
  output `name` the pair `SymInt[] name_shape, ScalarType name_dtype` in its
  place; it returns the outputs, except an output that only holds another's
  length (`keep[:num_kept]`: `keep` is returned trimmed, `num_kept` not);
- its implementation allocates the outputs with torch on the inputs' device
  (torch's caching allocator; zeros for `Tensor+` outputs, which kernels add
  into), makes strided inputs contiguous (one copy), and calls E, so the
  registry, backends and Python kernels apply; on the CPU, float16 and
  bfloat16 are computed in float32 (the C kernels take float32 and float64);
  under torch.use_deterministic_algorithms(True), CUDA calls take the
  `deterministic` backend;
- its fake implementation returns empty tensors of those shapes (a trimmed
  output gets a data-dependent length), so shapes propagate under
  FakeTensor and torch.compile;
- where an op module's GRADIENTS table says how (mmdispatch/ops/*.py), its
  autograd calls the backward op the table names.
"""
import importlib
import pkgutil

import torch

from mmdispatch import _core
from mmdispatch import ops as _ops
from mmdispatch._codegen import parse_signature

NAMESPACE = "mmdispatch"
_SCALAR_TYPES = {"int": "int", "float": "float", "bool": "bool"}
_LOW_PRECISION = (torch.float16, torch.bfloat16)

def torch_name(entry_point):
    """The op name of an entry point: roi_align_forward_impl -> roi_align_forward."""
    return entry_point[:-len("_impl")] if entry_point.endswith("_impl") else entry_point


class DerivedOp:
    """One entry point as a functional torch op (see the module docstring)."""

    def __init__(self, signature_line):
        sig = parse_signature(signature_line)
        self.signature = sig
        self.name = torch_name(sig.name)
        self.qualname = f"{NAMESPACE}::{self.name}"
        self.entry_point = getattr(_core, sig.name)
        lengths = {p.length for p in sig.params if p.length}
        args, self.arg_names = [], []
        # the entry point's call, built from this op's arguments: `arg_of[k]`
        # is the argument that entry-point parameter k takes as it is (an
        # output's shape argument stands in until it is allocated)
        self.arg_of, self.tensor_params, self.output_params = [], [], []
        for k, p in enumerate(sig.params):
            self.arg_of.append(len(self.arg_names))
            if p.is_output:
                self.output_params.append((k, len(self.arg_names), p.type == "Tensor+"))
                args += [f"SymInt[] {p.name}_shape", f"ScalarType {p.name}_dtype"]
                self.arg_names += [f"{p.name}_shape", f"{p.name}_dtype"]
                continue
            if p.is_array:
                self.tensor_params.append(k)
                args.append(f"Tensor{'?' if p.type == 'Tensor?' else ''} {p.name}")
            else:
                args.append(f"{_SCALAR_TYPES[p.type]} {p.name}")
            self.arg_names.append(p.name)
        outputs = [p for p in sig.params if p.is_output]
        position = {p.name: i for i, p in enumerate(outputs)}
        # (position among the outputs, its dtype argument, position of its length or -1)
        self.returns = [(position[p.name], self.arg_names.index(f"{p.name}_dtype"),
                         position[p.length] if p.length else -1)
                        for p in outputs if p.name not in lengths]
        self.output_names = [p.name for p in outputs if p.name not in lengths]
        self.first_input = self.arg_of[self.tensor_params[0]]
        self.tensor_args = tuple(self.arg_of[k] for k in self.tensor_params)
        self.empties = {}
        self.gradient = None   # set by Gradient
        returned = ", ".join(["Tensor"] * len(self.returns))
        self.schema = (f"({', '.join(args)}) -> "
                       f"{returned if len(self.returns) == 1 else f'({returned})'}")
        self.op = torch.library.custom_op(self.qualname, self.run, mutates_args=(),
                                          schema=self.schema)
        self.op.register_fake(self.fake)

    def __call__(self, *args):
        """The op; in eager code on plain tensors (no tracing, no subclass,
        no dispatch mode) its implementation straight away, through
        _EagerAutograd when a gradient is needed: torch.library's machinery
        costs ~20 us a call on the CPU, and its autograd wrapper ~100 us more
        for our schemas (it rebuilds the argument list per argument), several
        times what a tiny call's work costs."""
        needs_grad = _plain_eager(args, self.tensor_args)
        if needs_grad is None:
            return self.op(*args)
        if needs_grad and self.gradient is not None:
            return _EagerAutograd.apply(self, *args)
        return self.run(*args, eager=not needs_grad)

    def run(self, *args, eager=False):
        first = args[self.first_input]
        device = first.device
        call = [args[i] for i in self.arg_of]
        upcast = False
        for k in self.tensor_params:
            value = call[k]
            if value is None:
                continue
            if not value.is_contiguous():
                call[k] = value = value.contiguous()
            if value.dtype in _LOW_PRECISION and first.is_cpu:
                upcast = True
        if upcast:   # the CPU kernels take float32 and float64
            for k in self.tensor_params:
                if call[k] is not None and call[k].dtype in _LOW_PRECISION:
                    call[k] = call[k].float()
        outputs = []
        for k, i, accumulate in self.output_params:
            dtype = args[i + 1]
            if upcast and dtype in _LOW_PRECISION:
                dtype = torch.float32
            if eager and args[i] == _EMPTY_SHAPE:   # an output the call leaves unused
                call[k] = self.empty(k, dtype, device)
            else:
                call[k] = (torch.zeros if accumulate else torch.empty)(args[i], dtype=dtype,
                                                                        device=device)
            outputs.append(call[k])
        if first.is_cuda and torch.are_deterministic_algorithms_enabled():
            # torch.use_deterministic_algorithms(True): the CUDA backend that
            # gives the same bits on every run
            with _core.use_backend("cuda", "deterministic"):
                self.entry_point(*call)
        else:
            self.entry_point(*call)
        results = []
        for position, dtype_arg, length in self.returns:
            value = outputs[position]
            if length >= 0:   # reads the count back (a synchronisation on a GPU)
                value = value[:int(outputs[length][0])]
            if value.dtype != args[dtype_arg]:
                value = value.to(args[dtype_arg])
            results.append(value)
        return results[0] if len(results) == 1 else tuple(results)

    def empty(self, param, dtype, device):
        """A zero-size tensor for output `param`, made once per dtype and
        device: an unused output (roi_align's argmax pair in avg mode) costs
        an allocation otherwise. Only eager calls outside autograd take it:
        what torch.library returns gets autograd metadata attached."""
        key = (param, dtype, device)
        value = self.empties.get(key)
        if value is None:
            value = self.empties[key] = torch.empty(_EMPTY_SHAPE, dtype=dtype, device=device)
        return value

    def fake(self, *args):
        device = args[self.first_input].device
        outputs = [(args[i], args[i + 1]) for _, i, _ in self.output_params]
        results = []
        for position, dtype_arg, length in self.returns:
            shape = list(outputs[position][0])
            if length >= 0:
                shape[0] = torch.library.get_ctx().new_dynamic_size()
            results.append(torch.empty(shape, dtype=args[dtype_arg], device=device))
        return results[0] if len(results) == 1 else tuple(results)


_SAVED = object()
_EMPTY_SHAPE = (0,)
_Tensor = torch.Tensor
# private torch functions (present in every torch we support); without them
# every call goes through torch.library
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)


def _plain_eager(args, tensor_args):
    """None when a call needs torch's dispatch (traced by torch.compile, a
    tensor that is not a plain torch.Tensor, such as a FakeTensor, or a
    dispatch or torch-function mode active); else whether a tensor argument
    needs a gradient."""
    if _dispatch_modes is None or _function_modes is None or torch.compiler.is_compiling():
        return None
    grad, needs_grad = torch.is_grad_enabled(), False
    for i in tensor_args:
        value = args[i]
        if value is not None:
            if type(value) is not _Tensor:
                return None
            needs_grad = needs_grad or (grad and value.requires_grad)
    if _dispatch_modes() or _function_modes():
        return None
    return needs_grad


class _EagerAutograd(torch.autograd.Function):
    """A derived op's autograd in eager code: its implementation, with the
    setup and backward of its Gradient (those torch.library runs under
    torch.compile), without torch.library's per-call wrapper."""

    @staticmethod
    def forward(ctx, op, *args):
        output = op.run(*args)
        ctx.gradient = op.gradient
        op.gradient.setup_context(ctx, args, output)
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outputs)
                                      if i != op.gradient.grad_of])
        return output

    @staticmethod
    def backward(ctx, *grads):
        gradient = ctx.gradient   # needs_input_grad counts the op, argument 0
        return (None, *gradient.gradients(ctx, ctx.needs_input_grad[1 + gradient.wrt], grads))


class Gradient:
    """The autograd of a derived op, from its module's GRADIENTS entry: the
    gradient of forward argument `wrt` is the backward op's result (its one
    output, shaped like `wrt`); the backward op's `grad_output` is the
    gradient of the forward output the entry names, or the result is scaled
    by that gradient ("times_grad_of"); every other backward argument is
    the forward's argument or output of the same name."""

    def __init__(self, forward, backward, wrt, rule):
        self.forward, self.backward = forward, backward
        self.wrt = forward.arg_names.index(wrt)
        self.grad_output = rule.get("grad_output")
        self.times_grad_of = rule.get("times_grad_of")
        self.grad_of = forward.output_names.index(self.grad_output or self.times_grad_of)
        outputs = [p.name for p in backward.signature.params if p.is_output]
        if len(outputs) != 1:
            raise ValueError(f"{backward.name}: a backward op must have one output")
        result = outputs[0]
        # backward argument -> ("grad"), ("wrt", shape|dtype), ("input", index), ("output", index)
        self.sources = []
        for name in backward.arg_names:
            if name == "grad_output" and self.grad_output:
                self.sources.append(("grad", 0))
            elif name in (f"{result}_shape", f"{result}_dtype"):
                self.sources.append(("wrt", name.endswith("_dtype")))
            elif name in forward.arg_names:
                self.sources.append(("input", forward.arg_names.index(name)))
            elif name in forward.output_names:
                self.sources.append(("output", forward.output_names.index(name)))
            else:
                raise ValueError(f"{backward.name}: no forward value for {name!r}")
        self.saved_inputs = sorted({i for kind, i in self.sources if kind == "input"})
        self.saved_outputs = sorted({i for kind, i in self.sources if kind == "output"})
        forward.op.register_autograd(self.backward_fn, setup_context=self.setup_context)
        forward.gradient = self

    def setup_context(self, ctx, inputs, output):
        outputs = output if isinstance(output, tuple) else (output,)
        wrt = inputs[self.wrt]
        ctx.wrt_shape, ctx.wrt_dtype = tuple(wrt.shape), wrt.dtype
        values = [inputs[i] for i in self.saved_inputs] + [outputs[i] for i in self.saved_outputs]
        ctx.save_for_backward(*[v for v in values if isinstance(v, torch.Tensor)])
        # the rest (scalars, absent optional tensors) as they are; _SAVED marks a saved tensor
        ctx.others = [_SAVED if isinstance(v, torch.Tensor) else v for v in values]

    def backward_fn(self, ctx, *grads):
        return self.gradients(ctx, ctx.needs_input_grad[self.wrt], grads)

    def gradients(self, ctx, needed, grads):
        """The forward arguments' gradients: `wrt`'s when `needed`."""
        grad = grads[self.grad_of]
        result = [None] * len(self.forward.arg_names)
        if grad is None or not needed:
            return tuple(result)
        saved = iter(ctx.saved_tensors)
        values = [next(saved) if other is _SAVED else other for other in ctx.others]
        inputs = dict(zip(self.saved_inputs, values))
        outputs = dict(zip(self.saved_outputs, values[len(self.saved_inputs):]))
        args = []
        for kind, i in self.sources:
            if kind == "grad":
                args.append(grad.contiguous())
            elif kind == "wrt":
                args.append(ctx.wrt_dtype if i else ctx.wrt_shape)
            else:
                args.append(inputs[i] if kind == "input" else outputs[i])
        gradient = self.backward.op(*args)
        if self.times_grad_of:
            gradient = gradient * grad
        result[self.wrt] = gradient
        return tuple(result)


def _gradient_tables():
    """{forward entry point: {argument: rule}} from every op module."""
    tables = {}
    for info in pkgutil.iter_modules(_ops.__path__):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{_ops.__name__}.{info.name}")
            tables.update(getattr(module, "GRADIENTS", {}))
    return tables


def _register():
    derived = {name: DerivedOp(line) for name, line in _core.op_signatures().items()}
    gradients = []
    for forward, rules in _gradient_tables().items():
        for wrt, rule in rules.items():
            gradients.append(Gradient(derived[forward], derived[rule["backward"]], wrt, rule))
    return derived, gradients


# entry point -> DerivedOp, and the autograd registrations
DERIVED, GRADIENTS = _register()
