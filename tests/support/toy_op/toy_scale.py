"""A toy op: input * factor (the toy op of tests/test_toy_op.py)."""
from mmdispatch import _core
from mmdispatch.ops._arrays import contiguous, like, native

__all__ = ["toy_scale"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("toy_scale_impl",)


def toy_scale(input, factor=2.0):
    """input * factor, in input's dtype and input's library; strided input
    is copied once."""
    output = _core.toy_scale_impl(contiguous(native("toy_scale", "input", input)), None, factor)
    return like(input, output)
