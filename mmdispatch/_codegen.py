"""Generates the per-op dispatch code from ``signatures.txt``.

h5py-style: one declarative line per op; the typed C kernel signature, the
op's fixed-size kernel table, the per-device registration functions and the
Cython entry point are all derived from it, so adding an op never means
editing the dispatcher. Run by setup.py (no import of the package needed).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

# The array-argument flags and limits: their one source. generate_header
# writes them into mmdispatch_generated.h as MMD_*, which _core.pxd reads,
# and asserts MAX_NDIM against tensor.h's MMD_MAX_NDIM (the kernel ABI).
ARG_OUTPUT = 1
ARG_OPTIONAL = 2
ARG_ACCUMULATE = 4   # an output the kernel adds into: callers pass it initialised
MAX_ARRAY_ARGS = 16
MAX_NDIM = 8

_ARRAY_TYPES = {"Tensor": 0, "Tensor!": ARG_OUTPUT, "Tensor+": ARG_OUTPUT | ARG_ACCUMULATE,
                "Tensor?": ARG_OPTIONAL}
_SCALAR_TYPES = {  # signature type -> (C type, Cython converter in _core.pyx)
    "int": ("int64_t", "_int_arg"),
    "float": ("double", "_float_arg"),
    "bool": ("int", "_bool_arg"),
}
# signature type -> (mmd_boxed_kind, the mmd_boxed_arg field its value goes in)
_BOXED = {"int": ("MMD_BOXED_INT", "int_value"), "float": ("MMD_BOXED_FLOAT", "float_value"),
          "bool": ("MMD_BOXED_BOOL", "int_value")}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# an output whose valid part is its first `length` elements: keep[:num_kept]
_TRIMMED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\[:([A-Za-z_][A-Za-z0-9_]*)\]$")


@dataclass(frozen=True)
class Param:
    type: str
    name: str
    length: str | None = None   # output trimmed to the value of this (1,) output

    @property
    def is_array(self) -> bool:
        return self.type in _ARRAY_TYPES

    @property
    def flags(self) -> int:
        return _ARRAY_TYPES[self.type]

    @property
    def is_output(self) -> bool:
        return self.is_array and bool(self.flags & ARG_OUTPUT)


@dataclass(frozen=True)
class Allocation:
    """How the entry point allocates output `name` when it is given as
    None: `empty(shape[, dtype])` or `zeros(...)`, shape an expression over
    the arrays' shapes and the int/bool parameters (see signatures.txt),
    dtype a dtype name or None for the first array's dtype."""

    name: str
    shape: ast.expr
    dtype: str | None
    zeros: bool
    text: str


@dataclass(frozen=True)
class Op:
    name: str
    params: tuple
    line: str
    allocations: tuple = ()
    text: str = ""   # the signature line and its allocation lines

    @property
    def arrays(self):
        return [(i, p) for i, p in enumerate(self.params) if p.is_array]

    def array_index(self, name):
        """Position of array parameter `name` among the array parameters."""
        return [p.name for _, p in self.arrays].index(name)


# dtypes an allocation line may name; the generated code uses their mmd_dtype
# names (MMD_INT64, ... in mmdispatch/tensor.h), so the codes have one source
ALLOCATION_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "float16", "bfloat16",
                     "float32", "float64")


def parse_signature(text: str) -> Op:
    """An op from its signature line, optionally followed by its indented
    allocation lines (as op_signatures() and signatures.txt give them)."""
    line, *rest = [raw for raw in text.strip("\n").splitlines() if raw.strip()]
    op = _parse_line(line)
    allocations = tuple(_parse_allocation(op, raw.strip()) for raw in rest)
    declared = [a.name for a in allocations]
    if len(set(declared)) != len(declared):
        raise ValueError(f"{op.name}: an output is allocated twice")
    if allocations:
        first = op.arrays[0][1]
        if first.is_output or first.type == "Tensor?":
            raise ValueError(f"{op.name}: allocating outputs needs the first array parameter "
                             "to be a required input (outputs are allocated like it)")
    for a in allocations:
        _check_shape(op, a, declared[:declared.index(a.name)])
    body = "\n".join([line.strip()] + ["    " + a.text for a in allocations])
    return Op(op.name, op.params, op.line, allocations, body)


def _parse_allocation(op, text):
    """`name = empty(shape)`, `name = zeros(shape, int64)`."""
    where = f"{op.name}: allocation {text!r}"
    try:
        node = ast.parse(text, mode="exec").body
    except SyntaxError as exc:
        raise ValueError(f"{where}: {exc.msg}") from None
    if (len(node) != 1 or not isinstance(node[0], ast.Assign) or len(node[0].targets) != 1
            or not isinstance(node[0].targets[0], ast.Name)):
        raise ValueError(f"{where}: expected `output = empty(shape[, dtype])`")
    name, call = node[0].targets[0].id, node[0].value
    param = next((p for p in op.params if p.name == name), None)
    if param is None or not param.is_output:
        raise ValueError(f"{where}: {name!r} is not an output of the op")
    if (not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name)
            or call.func.id not in ("empty", "zeros") or call.keywords
            or len(call.args) not in (1, 2)):
        raise ValueError(f"{where}: expected empty(shape[, dtype]) or zeros(shape[, dtype])")
    dtype = None
    if len(call.args) == 2:
        if not isinstance(call.args[1], ast.Name) or call.args[1].id not in ALLOCATION_DTYPES:
            raise ValueError(f"{where}: the dtype must be one of "
                             f"{', '.join(ALLOCATION_DTYPES)}")
        dtype = call.args[1].id
    zeros = call.func.id == "zeros"
    if param.type == "Tensor+" and not zeros:
        raise ValueError(f"{where}: {name} is a Tensor+ output (the kernel adds into it): "
                         "allocate it with zeros")
    return Allocation(name, call.args[0], dtype, zeros, text)


def _check_shape(op, alloc, earlier):
    """The shape grammar: a tuple of sizes, `x.shape`, or `a if cond else
    b` of shapes; a size is an int literal, an int parameter, `x.shape[i]`
    or +, -, * and // of sizes, or `a if cond else b`; a condition compares
    sizes (==, !=, <, <=, >, >=), or is a bool/int parameter, joined by
    and/or/not. x is a required input array or an output allocated above."""
    params = {p.name: p for p in op.params}

    def fail(node, why):
        raise ValueError(f"{op.name}: allocation {alloc.text!r}: {why} "
                         f"({ast.unparse(node)!r})")

    def array(node):
        if not (isinstance(node, ast.Attribute) and node.attr == "shape"
                and isinstance(node.value, ast.Name)):
            fail(node, "expected x.shape")
        p = params.get(node.value.id)
        if p is None or not p.is_array or p.type == "Tensor?" or (
                p.is_output and p.name not in earlier):
            fail(node, "x must be a required input array or an output allocated above")

    def shape(node):
        if isinstance(node, ast.Tuple):
            if not 1 <= len(node.elts) <= MAX_NDIM:
                fail(node, f"a shape has 1 to {MAX_NDIM} sizes")
            for e in node.elts:
                size(e)
        elif isinstance(node, ast.IfExp):
            condition(node.test)
            shape(node.body)
            shape(node.orelse)
        else:
            array(node)

    def size(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return
        if isinstance(node, ast.Name):
            p = params.get(node.id)
            if p is None or p.type != "int":
                fail(node, "a size names an int parameter")
        elif isinstance(node, ast.Subscript):
            array(node.value)
            if not (isinstance(node.slice, ast.Constant) and type(node.slice.value) is int
                    and 0 <= node.slice.value < MAX_NDIM):
                fail(node, f"index a shape with an int literal in [0, {MAX_NDIM})")
        elif isinstance(node, ast.BinOp) and isinstance(
                node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)):
            size(node.left)
            size(node.right)
        elif isinstance(node, ast.IfExp):
            condition(node.test)
            size(node.body)
            size(node.orelse)
        else:
            fail(node, "not a size")

    def condition(node):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(
                node.ops[0], (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)):
            size(node.left)
            size(node.comparators[0])
        elif isinstance(node, ast.BoolOp):
            for v in node.values:
                condition(v)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            condition(node.operand)
        elif isinstance(node, ast.Name) and node.id in params and params[node.id].type in (
                "int", "bool"):
            return
        else:
            fail(node, "not a condition")

    shape(alloc.shape)


def _parse_line(line: str) -> Op:
    m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*\((.*)\)\s*", line)
    if not m:
        raise ValueError(f"bad signature line: {line!r}")
    name, body = m.groups()
    params = []
    for chunk in filter(None, (c.strip() for c in body.split(","))):
        parts = chunk.split()
        trimmed = _TRIMMED.match(parts[1]) if len(parts) == 2 else None
        if len(parts) != 2 or not (_IDENT.match(parts[1]) or trimmed):
            raise ValueError(f"{name}: bad parameter {chunk!r}")
        ptype, pname = parts
        if ptype not in _ARRAY_TYPES and ptype not in _SCALAR_TYPES:
            raise ValueError(f"{name}: unknown parameter type {ptype!r}")
        length = None
        if trimmed:
            if ptype != "Tensor!":
                raise ValueError(f"{name}: only a Tensor! output can be trimmed ({chunk!r})")
            pname, length = trimmed.groups()
        params.append(Param(ptype, pname, length))
    op = Op(name, tuple(params), line.strip())
    by_name = {p.name: p for p in params}
    for p in params:
        if p.length is not None and not (p.length in by_name and by_name[p.length].is_output):
            raise ValueError(f"{name}: {p.name} is trimmed to {p.length!r}, which is not an "
                             "output of the op")
    if not op.arrays:
        raise ValueError(f"{name}: an op needs at least one array parameter")
    if len(op.arrays) > MAX_ARRAY_ARGS:
        raise ValueError(f"{name}: more than {MAX_ARRAY_ARGS} array parameters")
    if len({p.name for p in params}) != len(params):
        raise ValueError(f"{name}: duplicate parameter names")
    return op


def read_signatures(path) -> list:
    """The ops of a signature file: each signature line with the indented
    allocation lines below it."""
    blocks: list[list[str]] = []
    for raw in Path(path).read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if line[0].isspace():
            if not blocks:
                raise ValueError(f"an allocation line before any signature: {line.strip()!r}")
            blocks[-1].append(line)
        else:
            blocks.append([line])
    ops = [parse_signature("\n".join(block)) for block in blocks]
    if len({op.name for op in ops}) != len(ops):
        raise ValueError("duplicate op names in signatures")
    return ops


def _c_params(op: Op) -> str:
    parts = []
    for p in op.params:
        ctype = "const mmd_tensor *" if p.is_array else _SCALAR_TYPES[p.type][0] + " "
        parts.append(f"{ctype}{p.name}")
    parts.append("const mmd_context *ctx")
    return ", ".join(parts)


@dataclass(frozen=True)
class DeviceModule:
    """A kernel directory src/<name>/: `files` are the names of its
    MMD_REGISTRATIONS(<name>, <file>) blocks (find_registrations);
    `unbuilt_reason` is set when the directory was not compiled into this
    build."""

    name: str
    device_type: int
    files: tuple
    unbuilt_reason: str | None = None


_REGISTRATIONS_RE = re.compile(r"^\s*MMD_REGISTRATIONS\(\s*(\w+)\s*,\s*(\w+)\s*\)", re.M)


def find_registrations(directory, device: str) -> tuple:
    """The names of the MMD_REGISTRATIONS(device, name) blocks in the source
    files (.c, .cpp, .cu) of a kernel directory, sorted. A file holds any
    number of blocks, helpers none; names need not match file names, but
    must be unique within the device."""
    found: dict[str, Path] = {}
    for path in sorted(Path(directory).iterdir()):
        if path.suffix not in (".c", ".cpp", ".cu"):
            continue
        for dev, name in _REGISTRATIONS_RE.findall(path.read_text()):
            if dev != device:
                raise ValueError(f"{path}: MMD_REGISTRATIONS({dev}, {name}) in the {device} "
                                 f"kernel directory")
            if name in found:
                raise ValueError(f"{path}: MMD_REGISTRATIONS({dev}, {name}) is also defined "
                                 f"in {found[name]}")
            found[name] = path
    return tuple(sorted(found))


def generate_header(ops) -> str:
    out = [
        "/* Generated by mmdispatch/_codegen.py from signatures.txt; do not edit. */",
        "#ifndef MMDISPATCH_GENERATED_H",
        "#define MMDISPATCH_GENERATED_H",
        '#include "mmdispatch/boxed.h"',
        '#include "mmdispatch/registry.h"',
        "#ifdef __cplusplus",
        'extern "C" {',
        "#endif",
        "",
        "/* The dispatcher's array-argument flags and limit (_codegen.py). */",
        f"#define MMD_ARG_OUTPUT {ARG_OUTPUT}",
        f"#define MMD_ARG_OPTIONAL {ARG_OPTIONAL}",
        f"#define MMD_ARG_ACCUMULATE {ARG_ACCUMULATE}",
        f"#define MMD_MAX_ARRAY_ARGS {MAX_ARRAY_ARGS}",
        "#ifdef __cplusplus",
        f'static_assert(MMD_MAX_NDIM == {MAX_NDIM}, "_codegen.MAX_NDIM is tensor.h\'s MMD_MAX_NDIM");',
        "#else",
        f'_Static_assert(MMD_MAX_NDIM == {MAX_NDIM}, "_codegen.MAX_NDIM is tensor.h\'s MMD_MAX_NDIM");',
        "#endif",
        "",
        "typedef struct {",
        "    const char *name;",
        "    int device_type;",
        "    /* Fills the device's slots and sets how many devices of its type",
        "       exist; returns 0, or nonzero with `status` saying why the device",
        "       type is unavailable. */",
        "    int (*register_fn)(char *status, size_t size, int *device_count);",
        "    /* Waits for the kernels queued on device `device_id` (every device",
        "       used, when negative) and returns the status of a deferred error",
        "       they left (mmdispatch/deferred.h); NULL when not built. */",
        "    int (*synchronize_fn)(int device_id);",
        "    /* Returns the memory the device's kernels keep for reuse (scratch",
        "       pools) on device `device_id` (every device, when negative) to",
        "       its driver; NULL when not built. */",
        "    int (*empty_cache_fn)(int device_id);",
        "} mmd_device_module;",
        "const mmd_device_module *mmd_get_device_modules(int *count);",
        "",
    ]
    for op in ops:
        out += [
            f"/* {op.line} */",
            f"typedef int (*mmd_{op.name}_fn)({_c_params(op)});",
            f"extern mmd_{op.name}_fn mmd_{op.name}_table[MMD_TABLE_SIZE];",
            f"extern const char *mmd_{op.name}_origin[MMD_TABLE_SIZE];",
            "/* the op's arguments boxed for its device's C fallback (mmdispatch/boxed.h) */",
            f"int mmd_{op.name}_boxed({_c_params(op)});",
            "",
        ]
    out += ["#ifdef __cplusplus", "}", "#endif", "#endif", ""]
    return "\n".join(out)


def generate_source(ops, devices) -> str:
    out = [
        "/* Generated by mmdispatch/_codegen.py; do not edit. */",
        "#include <stdio.h>",
        '#include "mmdispatch_generated.h"',
        "",
    ]
    for op in ops:
        out += [
            f"mmd_{op.name}_fn mmd_{op.name}_table[MMD_TABLE_SIZE];",
            f"const char *mmd_{op.name}_origin[MMD_TABLE_SIZE];",
        ]
    for op in ops:
        out += ["", f"int mmd_{op.name}_boxed({_c_params(op)}) {{",
                f"    const mmd_boxed_arg args[{len(op.params)}] = {{"]
        for p in op.params:
            if p.is_array:
                out.append(f'        {{"{p.name}", MMD_BOXED_ARRAY, {p.flags}, {p.name}, 0, 0.0}},')
            else:
                kind, field = _BOXED[p.type]
                value = (f"{p.name}, 0.0" if field == "int_value" else f"0, {p.name}")
                out.append(f'        {{"{p.name}", {kind}, 0, NULL, {value}}},')
        out += ["    };", f'    return mmd_boxed_dispatch("{op.name}", {len(op.params)}, args, ctx);',
                "}"]
    for dev in devices:
        out.append("")
        if dev.unbuilt_reason is not None:
            reason = dev.unbuilt_reason.replace("\\", "\\\\").replace('"', '\\"')
            out += [
                f"static int mmd_register_{dev.name}(char *status, size_t size, "
                "int *device_count) {",
                "    *device_count = 0;",
                f'    snprintf(status, size, "%s", "{reason}");',
                "    return 1;",
                "}",
            ]
            continue
        out.append(f"int mmd_{dev.name}_init(char *status, size_t size, int *device_count);")
        out.append(f"int mmd_{dev.name}_synchronize(int device_id);")
        out.append(f"int mmd_{dev.name}_empty_cache(int device_id);")
        out += [f"void mmd_register_{dev.name}__{name}(void);" for name in dev.files]
        out += [
            f"static int mmd_register_{dev.name}(char *status, size_t size, "
            "int *device_count) {",
            f"    if (mmd_{dev.name}_init(status, size, device_count) != 0) return 1;",
        ]
        out += [f"    mmd_register_{dev.name}__{name}();" for name in dev.files]
        out += ["    return 0;", "}"]
    out += ["", "static const mmd_device_module mmd_device_modules[] = {"]
    out += [f'    {{"{d.name}", {d.device_type}, mmd_register_{d.name}, ' +
            ("NULL, NULL" if d.unbuilt_reason is not None
             else f"mmd_{d.name}_synchronize, mmd_{d.name}_empty_cache") + "},"
            for d in devices]
    out += [
        "};",
        "",
        "const mmd_device_module *mmd_get_device_modules(int *count) {",
        "    *count = (int)(sizeof mmd_device_modules / sizeof mmd_device_modules[0]);",
        "    return mmd_device_modules;",
        "}",
        "",
    ]
    return "\n".join(out)


def generate_pyx(ops) -> str:
    out = [
        "# Generated by mmdispatch/_codegen.py from signatures.txt; do not edit.",
        "# Included into _core.pyx: one typed table and one entry point per op.",
        "",
        'cdef extern from "mmdispatch_generated.h" nogil:',
    ]
    for op in ops:
        ctypes = []
        for p in op.params:
            ctypes.append("const mmd_tensor *" if p.is_array else _SCALAR_TYPES[p.type][0])
        ctypes.append("const mmd_context *")
        out += [
            f"    ctypedef int (*mmd_{op.name}_fn)({', '.join(ctypes)}) noexcept nogil",
            f"    mmd_{op.name}_fn *mmd_{op.name}_table",
            f"    const char **mmd_{op.name}_origin",
            f"    int mmd_{op.name}_boxed({', '.join(ctypes)}) noexcept nogil",
        ]
    for op in ops:
        arrays = op.arrays
        names = ", ".join(repr(p.name) for p in op.params)
        positions = ", ".join(str(i) for i, _ in arrays)
        flags = ", ".join(str(_ARRAY_TYPES[p.type]) for _, p in arrays)
        args = ", ".join(p.name for p in op.params)
        out += [
            "",
            "",
            f"cdef OpRegistry _op_{op.name} = _define_op(",
            f"    {op.name!r}, {op.text or op.line!r},",
            f"    <void **>mmd_{op.name}_table, mmd_{op.name}_origin, <void *>mmd_{op.name}_boxed,",
            f"    ({names},), ({positions},), ({flags},))",
            "",
            "",
            f"def {op.name}({args}):",
            f'    """{op.line}',
            "",
            "    Checks that every array argument is on one device, then calls the",
            "    kernel registered for that device and the thread's backend.",
        ]
        if op.allocations:
            out += [
                "",
                "    Outputs given as None are allocated like the first array (its",
                "    library, device and dtype unless named), strided inputs are then",
                "    copied to C order, and the outputs are returned:",
                "",
            ] + [f"        {a.text}" for a in op.allocations]
        out += [
            '    """',
            f"    cdef OpRegistry op = _op_{op.name}",
            "    cdef CallState st",
            "    cdef int status",
        ]
        if op.allocations:
            out += ["    cdef int nd", "    cdef Py_ssize_t dims[8]", "    cdef unsigned int missing"]
        for i, p in enumerate(op.params):
            if not p.is_array:
                ctype, conv = _SCALAR_TYPES[p.type]
                out.append(f"    cdef {ctype} c_{p.name} = {conv}(op, {i}, {p.name})")
        for k, (_, p) in enumerate(arrays):
            out.append(f"    st.objects[{k}] = <PyObject *>{p.name}")
        out.append("    st.torch_written = 0   # set by prepare() for torch outputs")
        call = [f"st.args[{k}]" for k in range(len(arrays))]
        call_iter = iter(call)
        kernel_args = [next(call_iter) if p.is_array else f"c_{p.name}" for p in op.params]
        kernel_args.append("&st.ctx")
        output_mask = sum(1 << k for k, (_, p) in enumerate(arrays)
                          if _ARRAY_TYPES[p.type] & ARG_OUTPUT)
        optional_mask = sum(1 << k for k, (_, p) in enumerate(arrays)
                            if _ARRAY_TYPES[p.type] & ARG_OPTIONAL)
        if op.allocations:
            out += _allocating_call(op, kernel_args, optional_mask, output_mask)
        out += [
            # the masks are literals, so the C compiler unrolls the intake
            f"    if mmd_intake_plain_numpy(st.objects, {len(arrays)}, {optional_mask}, "
            f"{output_mask}, st.tensors,",
            "                              st.args, st.lo, st.hi):",
            "        held = _plain_numpy_kernel(op, &st)",
            "    else:  # any other array kind, and every error",
            "        held = op.prepare(&st)",
            "    if st.python_kernel:",
            "        if _hooks_on:",
            f"            return _hooked_python(op, &st, held, ({args},))",
            f"        return held({args})",
            "    if _hooks_on:   # hooks see the call around the kernel (_layers.pxi)",
            f"        record = _hook_begin(op, &st, ({args},))",
            "        if record is not None:",
            "            with nogil:",
            f"                status = (<mmd_{op.name}_fn>st.kernel)(",
            f"                    {', '.join(kernel_args)})",
            "            _hooked_status(op, record, status)",
            "            if st.torch_written:",
            "                _torch_outputs_written(op, &st)",
            "            return",
            "    with nogil:",
            f"        status = (<mmd_{op.name}_fn>st.kernel)(",
            f"            {', '.join(kernel_args)})",
            "    if status != 0:",
            "        op.raise_kernel_error(status)",
            "    if st.torch_written:   # torch outputs: autograd learns of the write",
            "        _torch_outputs_written(op, &st)",
        ]
    out.append("")
    return "\n".join(out)


_COMPARE = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
            ast.GtE: ">="}
_ARITHMETIC = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}


def _size_code(node, name, dim):
    """A size expression (validated by _check_shape) as code, the same text
    in Cython and Python but for the leaves: name(p) is int/bool parameter
    p, dim(x, i) is size i of array x (0 past its last axis); // by 0 is 0
    (_floordiv)."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.Name):
        return name(node.id)
    if isinstance(node, ast.Subscript):
        return dim(node.value.value.id, node.slice.value)
    if isinstance(node, ast.BinOp):
        left, right = _size_code(node.left, name, dim), _size_code(node.right, name, dim)
        if isinstance(node.op, ast.FloorDiv):
            return f"_floordiv({left}, {right})"
        return f"({left} {_ARITHMETIC[type(node.op)]} {right})"
    return (f"({_size_code(node.body, name, dim)} if {_condition_code(node.test, name, dim)} "
            f"else {_size_code(node.orelse, name, dim)})")


def _condition_code(node, name, dim):
    if isinstance(node, ast.Compare):
        return (f"({_size_code(node.left, name, dim)} {_COMPARE[type(node.ops[0])]} "
                f"{_size_code(node.comparators[0], name, dim)})")
    if isinstance(node, ast.BoolOp):
        joiner = " and " if isinstance(node.op, ast.And) else " or "
        return "(" + joiner.join(_condition_code(v, name, dim) for v in node.values) + ")"
    if isinstance(node, ast.UnaryOp):
        return f"(not {_condition_code(node.operand, name, dim)})"
    return f"({name(node.id)} != 0)"


def _cy_leaves(op):
    """Leaves of the Cython code: the converted scalars `c_<name>` and the
    views in `st`."""
    return (lambda p: f"c_{p}",
            lambda x, i: f"_dim(&st.tensors[{op.array_index(x)}], {i})")


def _cy_shape(op, node, indent):
    """Cython lines that set `nd` and `dims` to a shape expression."""
    pad = " " * indent
    leaves = _cy_leaves(op)
    if isinstance(node, ast.Tuple):
        return [f"{pad}nd = {len(node.elts)}"] + [
            f"{pad}dims[{j}] = _size({_size_code(e, *leaves)})" for j, e in enumerate(node.elts)]
    if isinstance(node, ast.IfExp):
        return ([f"{pad}if {_condition_code(node.test, *leaves)}:"]
                + _cy_shape(op, node.body, indent + 4)
                + [f"{pad}else:"] + _cy_shape(op, node.orelse, indent + 4))
    return [f"{pad}nd = _copy_shape(&st.tensors[{op.array_index(node.value.id)}], dims)"]


def _py_shape(node, names):
    """A shape expression as Python, `names` giving each parameter's value
    (a scalar's) or shape (an array's) as an expression, with the
    dispatcher's rules (_dim, _floordiv, _size in _core): a computed size
    below 0 is 0."""
    leaves = (lambda p: names[p], lambda x, i: f"_dim({names[x]}, {i})")
    if isinstance(node, ast.Tuple):
        # a plain x.shape[i] is never negative: no clamp (no guard on a symbolic size)
        sizes = [_size_code(e, *leaves) if isinstance(e, ast.Subscript)
                 else f"_size({_size_code(e, *leaves)})" for e in node.elts]
        return "(" + "".join(f"{s}, " for s in sizes) + ")"
    if isinstance(node, ast.IfExp):
        return (f"({_py_shape(node.body, names)} if {_condition_code(node.test, *leaves)} "
                f"else {_py_shape(node.orelse, names)})")
    return f"tuple({names[node.value.id]})"


def _dim_py(shape, d):
    return shape[d] if d < len(shape) else 0


def _floordiv_py(a, b):
    return 0 if b == 0 else a // b


def _size_py(value):
    return value if value > 0 else 0


# what the code of shape_lines calls
SHAPE_SCOPE = {"_dim": _dim_py, "_floordiv": _floordiv_py, "_size": _size_py}


def shape_lines(op: Op, names, target="s", indent="    "):
    """Python statements `<target><k> = <shape>`, one per allocation line
    of op, in their order: the same sizes the generated C computes, for
    callers that allocate themselves (the PyTorch layer). `names` maps
    parameter `name` to an expression: its value (a scalar) or its shape
    (an array). A later line reads an earlier output's shape as
    <target><k>. The code calls the functions of SHAPE_SCOPE."""
    names = dict(names)
    lines = []
    for k, alloc in enumerate(op.allocations):
        lines.append(f"{indent}{target}{k} = {_py_shape(alloc.shape, names)}  # {alloc.text}")
        names[alloc.name] = f"{target}{k}"   # what later lines read of this output: its shape
    return lines


def shape_function(op: Op, position):
    """The shapes of op's allocation lines (shape_lines), in their order, as
    one Python function of the caller's argument tuple, where parameter
    `name` is `args[position[name]]` (arrays with .shape, ints, bools); the
    arrays may be FakeTensors with symbolic sizes. Compiled once; a call
    costs about as much as the expressions."""
    names = {}
    for p in op.params:
        if p.name in position:
            names[p.name] = f"a[{position[p.name]}]" + (".shape" if p.is_array else "")
    lines = ["def shapes(a):", *shape_lines(op, names),
             f"    return ({''.join(f's{k}, ' for k in range(len(op.allocations)))})"]
    scope = dict(SHAPE_SCOPE, __builtins__={"tuple": tuple, "bool": bool})
    exec(compile("\n".join(lines), f"<allocation lines of {op.name}>", "exec"), scope)
    return scope["shapes"]


def _allocating_call(op, kernel_args, optional_mask, output_mask):
    """The entry point's branch for calls that leave allocated outputs as
    None: the dispatcher allocates them like the first array (its library,
    device and, unless declared, dtype), makes strided inputs contiguous,
    runs the kernel and returns the outputs."""
    arrays = op.arrays
    names = [p.name for p in op.params]
    index = {p.name: k for k, (_, p) in enumerate(arrays)}
    declared = [a.name for a in op.allocations]
    missing = " | ".join(f"(<unsigned int>({n} is None)) << {index[n]}" for n in declared)
    out = [f"    if {' or '.join(f'{n} is None' for n in declared)}:",
           "        # outputs left to the dispatcher: allocated, then the kernel runs",
           f"        missing = {missing}",
           f"        if mmd_intake_plain_numpy(st.objects, {len(arrays)}, {optional_mask} | missing, "
           f"{output_mask}, st.tensors,",
           "                                  st.args, st.lo, st.hi):",
           "            st.kinds[0] = KIND_NUMPY   # what allocate() and _results() read",
           "            python_kernel = _plain_numpy_kernel(op, &st)",
           "        else:  # any other array kind (strided inputs copied), and every error",
           "            held = []   # what must outlive the kernel",
           "            python_kernel = op.prepare_allocating(&st, missing, held)",
           "        if st.boxed:   # a fallback: it allocates what it returns",
           "            if _hooks_on:",
           f"                return _hooked_python(op, &st, python_kernel, ({', '.join(names)},))",
           f"            return python_kernel({', '.join(names)})"]
    for a in op.allocations:
        dtype = -1 if a.dtype is None else f"MMD_{a.dtype.upper()}"
        out += [f"        if {a.name} is None:  # {a.text}"]
        out += _cy_shape(op, a.shape, 12)
        out += [f"            {a.name} = _allocate(op, &st, {index[a.name]}, nd, dims, {dtype}, "
                f"{a.zeros})"]
    outputs = [p for _, p in arrays if p.is_output]
    out += [
        "        if st.python_kernel:",
        "            if _hooks_on:",
        f"                _hooked_python(op, &st, python_kernel, ({', '.join(names)},))",
        "            else:",
        f"                python_kernel({', '.join(names)})",
        "        else:",
        f"            record = _hook_begin(op, &st, ({', '.join(names)},)) if _hooks_on else None",
        "            with nogil:",
        f"                status = (<mmd_{op.name}_fn>st.kernel)(",
        f"                    {', '.join(kernel_args)})",
        "            if record is not None:",
        "                _hooked_status(op, record, status)",
        "            elif status != 0:",
        "                op.raise_kernel_error(status)",
        "            if st.torch_written:",
        "                _torch_outputs_written(op, &st)",
    ]
    lengths = {p.length for p in outputs if p.length}
    results = [f"{p.name}[:_length({p.length})]" if p.length else p.name
               for p in outputs if p.name not in lengths]
    first = arrays[0][1].name
    out += [f"        return _results(st.kinds[0], {first}, "
            f"{results[0] if len(results) == 1 else '(' + ', '.join(results) + ')'})"]
    return out


def generate(signature_file, out_dir, devices) -> list:
    """Writes the generated files into out_dir (only when changed, so
    rebuilds stay incremental) and returns the op list."""
    ops = read_signatures(signature_file)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("mmdispatch_generated.h", generate_header(ops)),
        ("mmdispatch_generated.c", generate_source(ops, devices)),
        ("_dispatch_gen.pxi", generate_pyx(ops)),
    ):
        _write_if_changed(out_dir / name, text)
    return ops


def _write_if_changed(path, text):
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


# Type stubs: the hand-written part of _core.pyi (the dispatcher's API in
# _core.pyx) followed by one generated function per entry point; __init__.pyi
# re-exports what mmdispatch/__init__.py does (tests/test_packaging.py checks
# both against the installed package).
_STUB_TYPES = {
    "Tensor": "_Array",
    "Tensor!": "_Array",
    "Tensor+": "_Array",
    "Tensor?": "_Array | None",
    "int": "SupportsIndex",
    "float": "SupportsFloat",
    "bool": "bool | SupportsIndex | np.bool_",
}


def _package_names():
    """FROM_CORE and OWN of mmdispatch/_names.py (read, not imported: the
    build runs this module without importing the package)."""
    names = {}
    exec(Path(__file__).with_name("_names.py").read_text(), names)
    return names["FROM_CORE"], names["OWN"]


def generate_core_stub(ops) -> str:
    """_core.pyi: the hand-written head (_core.pyi.in, the dispatcher's own
    API) and a stub per entry point."""
    head = Path(__file__).with_name("_core.pyi.in").read_text()
    out = ["# Generated by mmdispatch/_codegen.py from _core.pyi.in and signatures.txt; "
           "do not edit.\n" + head.split("\n", 2)[2]]
    for op in ops:
        allocated = {a.name for a in op.allocations}
        params = "".join(
            f"    {p.name}: {_STUB_TYPES[p.type]}{' | None' if p.name in allocated else ''},\n"
            for p in op.params)
        out.append(f'def {op.name}(\n{params}) -> Any:\n    """{op.line}"""\n')
    return "\n".join(out)


def generate_package_stub(ops) -> str:
    from_core, own = _package_names()
    out = ["# Generated by mmdispatch/_codegen.py from signatures.txt and _names.py; do not edit.",
           "from typing import Any", "", "from mmdispatch import fallbacks as fallbacks",
           "from mmdispatch import ops as ops", "from mmdispatch.profiler import profile as profile"]
    out += [f"from mmdispatch._core import {name} as {name}"
            for name in (*from_core, *(op.name for op in ops))]
    out += ["from mmdispatch._version import __version__ as __version__"]
    out += ["", "def build_info() -> dict[str, Any]: ...", "", "__all__ = ["]
    out += [f'    "{name}",' for name in (*from_core, *own, *(op.name for op in ops))]
    out += ["]", ""]
    return "\n".join(out)


def generate_ops_stub(ops_dir) -> str:
    """The stub of mmdispatch.ops, which finds its op modules when it is
    imported: the functions each op module lists in its __all__ (read from
    the source, not imported), so type checkers see them."""
    lines = ['"""Generated by mmdispatch/_codegen.py from the op modules; do not edit."""']
    exported = []
    for path in sorted(Path(ops_dir).glob("*.py")):
        if path.stem.startswith("_"):
            continue
        names = []
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and getattr(node.targets[0], "id", None) == "__all__"):
                names = ast.literal_eval(node.value)
        for name in names:
            lines.append(f"from mmdispatch.ops.{path.stem} import {name} as {name}")
        exported += names
    lines.append(f"__all__ = {sorted(exported)!r}")
    return "\n".join(lines) + "\n"


def generate_stubs(signature_file, package_dir, ops_dir=None) -> list:
    """Writes _core.pyi and __init__.pyi (and ops/__init__.pyi, from the op
    modules in ops_dir) into the package directory (only when changed) and
    returns the op list."""
    ops = read_signatures(signature_file)
    package_dir = Path(package_dir)
    _write_if_changed(package_dir / "_core.pyi", generate_core_stub(ops))
    _write_if_changed(package_dir / "__init__.pyi", generate_package_stub(ops))
    if ops_dir is not None:
        (package_dir / "ops").mkdir(exist_ok=True)
        _write_if_changed(package_dir / "ops" / "__init__.pyi", generate_ops_stub(ops_dir))
    return ops
