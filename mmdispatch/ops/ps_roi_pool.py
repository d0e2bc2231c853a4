"""Position-sensitive RoIPool (R-FCN) with torchvision's semantics,
dispatched through ps_roi_pool_forward_impl / ps_roi_pool_backward_impl.

- input is (N, C, H, W) with C = C_out * out_h * out_w: bin (ph, pw) of
  output channel c_out reads input channel (c_out * out_h + ph) * out_w + pw
  (torchvision's channel_mapping, which is computed, never stored); a C
  that is not such a multiple is an error.
- rois are (K, 5): [batch_index, x1, y1, x2, y2] in input-image
  coordinates; corners are scaled by spatial_scale and rounded (halves away
  from zero), and a roi spans max(x2 - x1, 1) cells (same for y).
- Bin k along an axis covers [floor(k * bin), ceil((k + 1) * bin)) cells
  from the roi start, clipped to [0, size - 1]: as in torchvision, the
  map's last row and column are never pooled. A bin is the mean of its
  cells, 0 when it has none.
- The backward is the exact gradient of this forward. torchvision's is not
  where a bin reaches past the map: it spreads such a bin over the last row
  and column too.
"""
from mmdispatch import _core
from mmdispatch.ops._arrays import explain, like, pair, roi_backward_operands

__all__ = ["ps_roi_pool", "ps_roi_pool_backward"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("ps_roi_pool_forward_impl", "ps_roi_pool_backward_impl")

# The gradient of `input` for the PyTorch layer's autograd (see
# mmdispatch/ops/roi_align.py): ps_roi_pool_backward_impl's result, with
# `grad_output` the gradient of `output`, the other parameters the forward's.
GRADIENTS = {
    "ps_roi_pool_forward_impl": {
        "input": {"backward": "ps_roi_pool_backward_impl", "grad_output": "output"},
    },
}


def ps_roi_pool(input, rois, output_size, spatial_scale=1.0):
    """Position-sensitive RoIPool output, (K, C // (out_h * out_w),
    *output_size), in the input's dtype, kind and device."""
    op = "ps_roi_pool"
    height, width = pair(op, "output_size", output_size)
    try:
        return _core.ps_roi_pool_forward_impl(input, rois, None, height, width, spatial_scale)
    except (TypeError, ValueError) as exc:
        explain(op, exc, (("input", input, 4, "(N, C, H, W)"), ("rois", rois, 2, "(K, 5)")))


def ps_roi_pool_backward(grad_output, rois, input_shape, spatial_scale=1.0):
    """Gradient of sum(output * grad_output) with respect to the input, of
    shape input_shape; grad_output is (K, C_out, out_h, out_w)."""
    op = "ps_roi_pool_backward"
    original = grad_output
    grad_output, rois, grad_input = roi_backward_operands(op, grad_output, rois, input_shape,
                                                          "(K, C_out, out_h, out_w)")
    _core.ps_roi_pool_backward_impl(grad_output, rois, grad_input, grad_output.shape[2],
                                    grad_output.shape[3], spatial_scale)
    return like(original, grad_input)
