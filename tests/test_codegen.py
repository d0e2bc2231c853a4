"""The signature table and the code generated from it."""
import re

import pytest

from mmdispatch import _codegen


def test_signature_line_parses_into_typed_parameters():
    op = _codegen.parse_signature(
        "toy_impl(Tensor a, Tensor? weight, Tensor! out, int n, float scale, bool flag)")
    assert op.name == "toy_impl"
    assert [(p.type, p.name) for p in op.params] == [
        ("Tensor", "a"), ("Tensor?", "weight"), ("Tensor!", "out"), ("int", "n"),
        ("float", "scale"), ("bool", "flag")]
    assert [i for i, _ in op.arrays] == [0, 1, 2]


@pytest.mark.parametrize("line, message", [
    ("toy(Tensor a", "bad signature line"),
    ("toy(Tensor)", "bad parameter"),
    ("toy(Tensor[] a)", "unknown parameter type 'Tensor[]'"),
    ("toy(int n)", "needs at least one array parameter"),
    ("toy(Tensor a, Tensor a)", "duplicate parameter names"),
])
def test_bad_signature_lines_are_rejected(line, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _codegen.parse_signature(line)


def test_generated_code_has_typed_table_and_entry_point():
    op = _codegen.parse_signature("toy_impl(Tensor a, Tensor? w, Tensor! out, int n, bool flag)")
    header = _codegen.generate_header([op])
    assert ("typedef int (*mmd_toy_impl_fn)(const mmd_tensor *a, const mmd_tensor *w, "
            "const mmd_tensor *out, int64_t n, int flag, const mmd_context *ctx);") in header
    assert "extern mmd_toy_impl_fn mmd_toy_impl_table[MMD_TABLE_SIZE];" in header
    pyx = _codegen.generate_pyx([op])
    assert "def toy_impl(a, w, out, n, flag):" in pyx
    assert "(0, 1, 2,), (0, 2, 1,))" in pyx  # array positions and flags (optional, output)
    assert "cdef int64_t c_n = _int_arg(op, 3, n)" in pyx
    assert "st.args[0], st.args[1], st.args[2], c_n, c_flag, &st.ctx" in pyx


def test_device_modules_are_generated_with_reasons_for_unbuilt_ones():
    devices = [_codegen.DeviceModule("cpu", 1, ("toy",)),
               _codegen.DeviceModule("cuda", 2, ("toy",), 'built "without" nvcc')]
    source = _codegen.generate_source([], devices)
    assert "mmd_register_cpu__toy();" in source
    assert "mmd_register_cuda__toy" not in source
    assert 'built \\"without\\" nvcc' in source
    assert '{"cuda", 2, mmd_register_cuda, NULL, NULL},' in source   # nothing to wait for
    assert ('{"cpu", 1, mmd_register_cpu, mmd_cpu_synchronize, mmd_cpu_empty_cache},'
            in source)


def test_registrations_are_found_by_their_blocks_not_by_file_names(tmp_path):
    (tmp_path / "toy.cpp").write_text(
        "MMD_REGISTRATIONS(cpu, toy) {}\n/* MMD_REGISTRATIONS(cpu, in_a_comment) */\n")
    (tmp_path / "toy_math.cpp").write_text("int helper(void) { return 0; }\n")
    (tmp_path / "two.c").write_text("MMD_REGISTRATIONS(cpu, first) {}\n"
                                    "MMD_REGISTRATIONS( cpu , second ) {}\n")
    (tmp_path / "notes.txt").write_text("MMD_REGISTRATIONS(cpu, not_source) {}\n")
    assert _codegen.find_registrations(tmp_path, "cpu") == ("first", "second", "toy")


@pytest.mark.parametrize("extra, message", [
    ("MMD_REGISTRATIONS(cpu, toy) {}", "is also defined in"),
    ("MMD_REGISTRATIONS(cuda, other) {}", "in the cpu kernel directory"),
])
def test_duplicate_or_misplaced_registrations_are_refused(tmp_path, extra, message):
    (tmp_path / "toy.cpp").write_text("MMD_REGISTRATIONS(cpu, toy) {}\n")
    (tmp_path / "more.cu").write_text(extra + "\n")
    with pytest.raises(ValueError, match=message):
        _codegen.find_registrations(tmp_path, "cpu")


def test_shipped_signatures_parse():
    from importlib.resources import files

    ops = _codegen.read_signatures(files("mmdispatch") / "signatures.txt")
    assert {op.name for op in ops} >= {"roi_align_forward_impl", "roi_align_backward_impl"}


def test_accumulated_and_trimmed_outputs_parse_and_are_outputs_to_the_dispatcher():
    op = _codegen.parse_signature(
        "toy(Tensor a, Tensor+ grad, Tensor! keep[:count], Tensor! count, int n)")
    grad, keep, count = op.params[1:4]
    assert grad.is_output and grad.flags == _codegen.ARG_OUTPUT | _codegen.ARG_ACCUMULATE
    assert keep.name == "keep" and keep.length == "count" and keep.is_output
    assert count.length is None
    pyx = _codegen.generate_pyx([op])
    assert "def toy(a, grad, keep, count, n):" in pyx
    assert "mmd_intake_plain_numpy(st.objects, 4, 0, 14," in pyx   # outputs 1, 2, 3


@pytest.mark.parametrize("line, message", [
    ("toy(Tensor! keep[:n], int n)", "which is not an output"),
    ("toy(Tensor keep[:count], Tensor! count)", "only a Tensor! output can be trimmed"),
    ("toy(Tensor! keep[count], Tensor! count)", "bad parameter"),
])
def test_bad_trimmed_outputs_are_refused(line, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _codegen.parse_signature(line)


def test_allocation_lines_parse_and_generate_the_shape_in_c():
    op = _codegen.parse_signature(
        "toy_impl(Tensor a, Tensor b, Tensor! out, Tensor! idx, int n, bool flag)\n"
        "    out = empty((a.shape[0], b.shape[1] // n + 1) if flag else a.shape)\n"
        "    idx = zeros(out.shape, int64)")
    assert [(a.name, a.dtype, a.zeros) for a in op.allocations] == [
        ("out", None, False), ("idx", "int64", True)]
    assert op.text.splitlines()[1:] == [
        "    out = empty((a.shape[0], b.shape[1] // n + 1) if flag else a.shape)",
        "    idx = zeros(out.shape, int64)"]
    pyx = _codegen.generate_pyx([op])
    assert "        if (c_flag != 0):" in pyx
    assert "dims[1] = _size((_floordiv(_dim(&st.tensors[1], 1), c_n) + 1))" in pyx
    assert "nd = _copy_shape(&st.tensors[0], dims)" in pyx
    assert "idx = _allocate(op, &st, 3, nd, dims, MMD_INT64, True)" in pyx
    assert "return _results(st.kinds[0], a, (out, idx))" in pyx
    stub = _codegen.generate_core_stub([op])
    assert "    out: _Array | None," in stub and "    a: _Array,\n" in stub


def test_shape_functions_follow_the_dispatchers_size_rules_in_python():
    """The Python twin of the generated C: a shape index past the last axis
    is 0, // by 0 is 0, a negative size is 0; later lines
    read earlier outputs' shapes."""
    class A:
        def __init__(self, *shape):
            self.shape = shape

    op = _codegen.parse_signature(
        "toy_impl(Tensor a, Tensor b, Tensor! out, Tensor! idx, int n, bool flag)\n"
        "    out = empty((a.shape[0], b.shape[1] // n + 1, a.shape[3], n - 9) if flag else a.shape)\n"
        "    idx = zeros(((out.shape[0] if not flag or n >= 2 else 5) * 2,), int64)")
    shapes = _codegen.shape_function(op, {"a": 0, "b": 1, "n": 2, "flag": 3})
    assert shapes((A(4, 5), A(2, 7), 2, True)) == ((4, 4, 0, 0), (8,))
    assert shapes((A(4, 5), A(2, 7), 0, True)) == ((4, 1, 0, 0), (10,))
    assert shapes((A(4, 5), A(2, 7), -2, True))[0][1] == 0   # 7 // -2 + 1 == -3, clamped
    assert shapes((A(4, 5), A(2, 7), 2, False)) == ((4, 5), (8,))


def test_a_trimmed_output_is_returned_trimmed_without_its_length():
    op = _codegen.parse_signature(
        "toy_impl(Tensor a, Tensor! keep[:count], Tensor! count)\n"
        "    keep = empty((a.shape[0],), int64)\n"
        "    count = empty((1,), int64)")
    assert "return _results(st.kinds[0], a, keep[:_length(count)])" in _codegen.generate_pyx([op])


@pytest.mark.parametrize("text, message", [
    ("    nope = empty(a.shape)", "'nope' is not an output of the op"),
    ("    b = empty(a.shape)", "'b' is not an output of the op"),
    ("    out = ones(a.shape)", "expected empty(shape[, dtype]) or zeros(shape[, dtype])"),
    ("    out = empty(a.shape, complex64)", "the dtype must be one of"),
    ("    out = empty(a.shape[0])", "expected x.shape"),
    ("    out = empty((a.shape[9],))", "index a shape with an int literal in [0, 8)"),
    ("    out = empty((w.shape[0],))", "a required input array or an output allocated above"),
    ("    out = empty((x,))", "a size names an int parameter"),
    ("    out = empty((n ** 2,))", "not a size"),
    ("    out = empty((1,) if a else (2,))", "not a condition"),
    ("    out = empty(acc.shape)", "a required input array or an output allocated above"),
    ("    acc = empty(a.shape)", "acc is a Tensor+ output (the kernel adds into it): allocate "
                               "it with zeros"),
    ("    out = empty(a.shape)\n    out = empty(a.shape)", "an output is allocated twice"),
    ("    out = empty(a.shape",  "'(' was never closed"),
])
def test_bad_allocation_lines_are_rejected(text, message):
    line = "toy_impl(Tensor a, Tensor b, Tensor? w, Tensor! out, Tensor+ acc, int n, float x)"
    with pytest.raises(ValueError, match=re.escape(message)):
        _codegen.parse_signature(line + "\n" + text)


def test_allocating_needs_the_first_array_to_be_a_required_input():
    with pytest.raises(ValueError, match="the first array parameter to be a required input"):
        _codegen.parse_signature("toy_impl(Tensor? w, Tensor! out)\n    out = empty(w.shape)")


def test_signature_file_attaches_indented_lines_to_the_op_above(tmp_path):
    path = tmp_path / "signatures.txt"
    path.write_text("# comment\n"
                    "a_impl(Tensor x, Tensor! y)\n"
                    "    y = empty(x.shape)  # like x\n"
                    "b_impl(Tensor x, Tensor! y)\n")
    a, b = _codegen.read_signatures(path)
    assert [x.name for x in a.allocations] == ["y"] and b.allocations == ()
    path.write_text("    y = empty(x.shape)\na_impl(Tensor x, Tensor! y)\n")
    with pytest.raises(ValueError, match="an allocation line before any signature"):
        _codegen.read_signatures(path)
