"""RoIAlign over rotated rois (MMCV's roi_align_rotated), dispatched through
roi_align_rotated_forward_impl / roi_align_rotated_backward_impl.

- rois are (K, 6) rows [batch_index, cx, cy, w, h, angle in radians] in the
  input's dtype; the output is (K, C, *output_size).
- The bins are laid over the unrotated roi (centre scaled by spatial_scale,
  minus 0.5 when aligned; sides scaled, at least 1 when not aligned) and
  each sample is turned about the centre by the angle: counter-clockwise in
  image coordinates by default (MMCV's clockwise=False), clockwise with
  clockwise=True. Samples are MMCV's bilinear interpolation (0 outside
  [-1, H] x [-1, W]); a bin is the mean of its sampling_ratio x
  sampling_ratio samples (sampling_ratio <= 0: ceil(bin size) per axis).
- A roi with NaN or inf, a batch index that is not an integer in [0, N),
  or (aligned) a negative width or height is an error naming the roi, and
  nothing is written (on CUDA a deferred error, or raised at the call in
  strict mode).
"""
from mmdispatch import _core
from mmdispatch.ops._arrays import explain, like, pair, roi_backward_operands
from mmdispatch.ops.box_iou_rotated import _flag

__all__ = ["roi_align_rotated", "roi_align_rotated_backward"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("roi_align_rotated_forward_impl", "roi_align_rotated_backward_impl")

# The gradient of `input` for the PyTorch layer's autograd: the backward
# entry point's result, with `grad_output` the gradient of the forward's
# `output`.
GRADIENTS = {
    "roi_align_rotated_forward_impl": {
        "input": {"backward": "roi_align_rotated_backward_impl", "grad_output": "output"},
    },
}


def roi_align_rotated(input, rois, output_size, spatial_scale=1.0, sampling_ratio=0,
                      aligned=True, clockwise=False):
    """(K, C, *output_size) in the input's dtype, library and device."""
    op = "roi_align_rotated"
    height, width = pair(op, "output_size", output_size)
    aligned, clockwise = _flag(op, "aligned", aligned), _flag(op, "clockwise", clockwise)
    try:
        return _core.roi_align_rotated_forward_impl(input, rois, None, height, width,
                                                    spatial_scale, sampling_ratio, aligned,
                                                    clockwise)
    except (TypeError, ValueError) as exc:
        explain(op, exc, (("input", input, 4, "(N, C, H, W)"), ("rois", rois, 2, "(K, 6)")))


def roi_align_rotated_backward(grad_output, rois, input_shape, spatial_scale=1.0,
                               sampling_ratio=0, aligned=True, clockwise=False):
    """Gradient of sum(output * grad_output) with respect to the input, of
    shape input_shape; grad_output is (K, C, out_h, out_w)."""
    op = "roi_align_rotated_backward"
    aligned, clockwise = _flag(op, "aligned", aligned), _flag(op, "clockwise", clockwise)
    original = grad_output
    grad_output, rois, grad_input = roi_backward_operands(op, grad_output, rois, input_shape,
                                                          "(K, C, out_h, out_w)")
    _core.roi_align_rotated_backward_impl(grad_output, rois, grad_input, grad_output.shape[2],
                                          grad_output.shape[3], spatial_scale, sampling_ratio,
                                          aligned, clockwise)
    return like(original, grad_input)
