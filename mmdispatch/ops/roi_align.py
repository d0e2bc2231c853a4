"""RoIAlign with MMCV / Detectron2 semantics, dispatched through
roi_align_forward_impl / roi_align_backward_impl.

- rois are (K, 5): [batch_index, x1, y1, x2, y2] in input-image coordinates,
  scaled by spatial_scale; aligned=True shifts them by -0.5 pixel, legacy
  mode (aligned=False) clamps each roi's size to at least 1.
- sampling_ratio <= 0 samples ceil(roi_size / output_size) points per bin.
- samples outside [-1, H] x [-1, W] contribute 0; avg divides by the number
  of samples (at least 1); max records the position of the maximum
  (argmax_y / argmax_x) for backward.
"""

from mmdispatch import _core
from mmdispatch.ops._arrays import (choice, contiguous, explain, like, native, pair,
                                    roi_backward_operands, unused_like)

__all__ = ["roi_align", "roi_align_backward", "roi_align_forward"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("roi_align_forward_impl", "roi_align_backward_impl")

_OP = "roi_align_forward"
_POOL_MODES = {"avg": 1, "max": 0}
# the default pool_mode is this interned string: one identity test
_AVG_NAME, _AVG = "avg", _POOL_MODES["avg"]

# How gradients flow through the entry points, for the PyTorch layer
# (mmdispatch.torch derives its autograd from this and signatures.txt): the
# gradient of `input` is roi_align_backward_impl's result (its output,
# allocated like `input`), with `grad_output` the gradient of the forward's
# `output` and every other parameter the forward's own of the same name
# (rois, argmax_y, argmax_x, the sizes and flags).
GRADIENTS = {
    "roi_align_forward_impl": {
        "input": {"backward": "roi_align_backward_impl", "grad_output": "output"},
    },
}

_forward_impl = _core.roi_align_forward_impl


def _pool_mode(op, pool_mode):
    return choice(op, "pool_mode", pool_mode, _POOL_MODES)


def _explain(exc, input, rois):
    explain(_OP, exc, (("input", input, 4, "(N, C, H, W)"), ("rois", rois, 2, "(K, 5)")))


def roi_align_forward(input, rois, output_size, spatial_scale=1.0, sampling_ratio=0,
                      pool_mode="avg", aligned=True):
    """Returns (output, argmax_y, argmax_x); output is (K, C, *output_size)
    with the input's dtype, kind and device. In avg mode the argmax arrays
    are empty (one shared (0,) array)."""
    height, width = pair(_OP, "output_size", output_size)
    mode = _AVG if pool_mode is _AVG_NAME else _pool_mode(_OP, pool_mode)
    try:
        return _forward_impl(input, rois, None, None, None, height, width, spatial_scale,
                             sampling_ratio, mode, aligned)
    except (TypeError, ValueError) as exc:
        _explain(exc, input, rois)


def roi_align(input, rois, output_size, spatial_scale=1.0, sampling_ratio=0, pool_mode="avg",
              aligned=True):
    """RoIAlign output, (K, C, *output_size)."""
    # The common call (an int output_size, avg mode) without another Python
    # call: a tiny call costs about as much Python as kernel.
    if type(output_size) is int and output_size >= 1 and pool_mode is _AVG_NAME:
        try:
            return _forward_impl(input, rois, None, None, None, output_size, output_size,
                                 spatial_scale, sampling_ratio, _AVG, aligned)[0]
        except (TypeError, ValueError) as exc:
            _explain(exc, input, rois)
    return roi_align_forward(input, rois, output_size, spatial_scale, sampling_ratio, pool_mode,
                             aligned)[0]


def roi_align_backward(grad_output, rois, argmax_y, argmax_x, input_shape, spatial_scale=1.0,
                       sampling_ratio=0, pool_mode="avg", aligned=True):
    """Gradient of sum(output * grad_output) with respect to the input, of
    shape input_shape. argmax_y/argmax_x come from roi_align_forward (max
    mode); in avg mode they may be None or empty."""
    op = "roi_align_backward"
    mode = _pool_mode(op, pool_mode)
    original = grad_output
    grad_output, rois, grad_input = roi_backward_operands(op, grad_output, rois, input_shape,
                                                          "(K, C, out_h, out_w)")
    if argmax_y is None or argmax_x is None:
        unused = unused_like(op, grad_output)
    argmax_y = unused if argmax_y is None else contiguous(native(op, "argmax_y", argmax_y))
    argmax_x = unused if argmax_x is None else contiguous(native(op, "argmax_x", argmax_x))
    _core.roi_align_backward_impl(grad_output, rois, argmax_y, argmax_x, grad_input,
                                  grad_output.shape[2], grad_output.shape[3], spatial_scale,
                                  sampling_ratio, mode, aligned)
    return like(original, grad_input)
