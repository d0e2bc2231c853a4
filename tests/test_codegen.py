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
    assert '{"cuda", 2, mmd_register_cuda, NULL},' in source   # nothing to synchronize
    assert '{"cpu", 1, mmd_register_cpu, mmd_cpu_synchronize},' in source


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
