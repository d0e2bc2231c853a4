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
from mmdispatch.ops._arrays import (allocate, check_ndim, choice, contiguous, like, namespace,
                                    native, pair, roi_forward_inputs, shape_arg, unused_output)
from mmdispatch.ops._fastpath import pooled_output

_POOL_MODES = {"avg": 1, "max": 0}

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


def _pool_mode(op, pool_mode):
    return choice(op, "pool_mode", pool_mode, _POOL_MODES)


def roi_align_forward(input, rois, output_size, spatial_scale=1.0, sampling_ratio=0,
                      pool_mode="avg", aligned=True):
    """Returns (output, argmax_y, argmax_x); output is (K, C, *output_size)
    with the input's dtype, kind and device. In avg mode the argmax arrays
    are empty."""
    return _forward("roi_align_forward", input, rois, output_size, spatial_scale,
                    sampling_ratio, pool_mode, aligned, True)


def _forward(op, input, rois, output_size, spatial_scale, sampling_ratio, pool_mode, aligned,
             with_argmax):
    height, width = pair(op, "output_size", output_size)
    mode = _pool_mode(op, pool_mode)
    original = input
    input, rois = roi_forward_inputs(op, input, rois)
    xp, device = namespace(op, input)
    with device:
        output = allocate(op, "output", xp, (rois.shape[0], input.shape[1], height, width),
                          input.dtype)
        if mode == _POOL_MODES["max"] or with_argmax:
            argmax_shape = output.shape if mode == _POOL_MODES["max"] else (0,)
            argmax_y = allocate(op, "argmax_y", xp, argmax_shape, input.dtype)
            argmax_x = allocate(op, "argmax_x", xp, argmax_shape, input.dtype)
        else:   # avg mode writes no argmax: one shared empty array serves both
            argmax_y = argmax_x = unused_output(xp, input)
    _core.roi_align_forward_impl(input, rois, output, argmax_y, argmax_x, height, width,
                                 spatial_scale, sampling_ratio, mode, aligned)
    if not with_argmax:
        return like(original, output)
    return like(original, output), like(original, argmax_y), like(original, argmax_x)


def roi_align_backward(grad_output, rois, argmax_y, argmax_x, input_shape, spatial_scale=1.0,
                       sampling_ratio=0, pool_mode="avg", aligned=True):
    """Gradient of sum(output * grad_output) with respect to the input, of
    shape input_shape. argmax_y/argmax_x come from roi_align_forward (max
    mode); in avg mode they may be None or empty."""
    op = "roi_align_backward"
    mode = _pool_mode(op, pool_mode)
    original = grad_output
    grad_output = contiguous(native(op, "grad_output", grad_output))
    rois = contiguous(native(op, "rois", rois))
    check_ndim(op, "grad_output", grad_output, 4, "(K, C, out_h, out_w)")
    shape = shape_arg(op, "input_shape", input_shape, 4, "(N, C, H, W)")
    xp, device = namespace(op, grad_output)
    with device:
        grad_input = allocate(op, "grad_input", xp, shape, grad_output.dtype, zeros=True)
        if argmax_y is None or argmax_x is None:
            unused = unused_output(xp, grad_output)
    argmax_y = unused if argmax_y is None else contiguous(native(op, "argmax_y", argmax_y))
    argmax_x = unused if argmax_x is None else contiguous(native(op, "argmax_x", argmax_x))
    _core.roi_align_backward_impl(grad_output, rois, argmax_y, argmax_x, grad_input,
                                  grad_output.shape[2], grad_output.shape[3], spatial_scale,
                                  sampling_ratio, mode, aligned)
    return like(original, grad_input)


# Module-level names for roi_align's fast path: a global is found faster than
# a module attribute; "avg" is interned, so the default pool_mode is it.
_forward_impl = _core.roi_align_forward_impl
_AVG, _AVG_NAME = _POOL_MODES["avg"], "avg"


def roi_align(input, rois, output_size, spatial_scale=1.0, sampling_ratio=0, pool_mode="avg",
              aligned=True):
    """RoIAlign output, (K, C, *output_size)."""
    # The common call, inline (a tiny call costs about as much Python as
    # kernel): avg mode, and what pooled_output takes (plain float numpy
    # arrays, output_size ints), which also allocates the output. Scalars are
    # checked by the entry point, as on the general path.
    if pool_mode is _AVG_NAME or (type(pool_mode) is str and pool_mode == _AVG_NAME):
        fast = pooled_output(input, rois, output_size)
        if fast is not None:
            output, h, w, unused = fast
            _forward_impl(input, rois, output, unused, unused, h, w, spatial_scale,
                          sampling_ratio, _AVG, aligned)
            return output
    return _forward("roi_align_forward", input, rois, output_size, spatial_scale,
                    sampling_ratio, pool_mode, aligned, False)
