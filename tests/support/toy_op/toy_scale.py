"""A toy op: input * factor (the toy op of tests/test_toy_op.py)."""
from mmdispatch import _core

__all__ = ["toy_scale"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("toy_scale_impl",)


def toy_scale(input, factor=2.0):
    """input * factor, in input's dtype."""
    return _core.toy_scale_impl(input, None, factor)
