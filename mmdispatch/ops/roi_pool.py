"""RoIPool (Fast R-CNN), dispatched through roi_pool_forward_impl /
roi_pool_backward_impl, with torchvision's or MMCV's way of mapping a roi
to cells (`convention`).

- rois are (K, 5): [batch_index, x1, y1, x2, y2] in input-image
  coordinates.
- convention="torchvision" (the default; Caffe's Fast R-CNN): corners are
  scaled by spatial_scale and rounded, a roi spans max(x2 - x1 + 1, 1)
  cells (same for y), and bin k along an axis covers [floor(k * bin),
  ceil((k + 1) * bin)) cells from the roi start.
- convention="mmcv" (mmcv.ops.roi_pool): the roi spans x1 * spatial_scale
  to (x2 + 1) * spatial_scale, not rounded, and bin k covers
  [floor(x1 * spatial_scale + k * bin), ceil(... + (k + 1) * bin)); a roi
  of width or height <= 0 has only empty bins. The two differ whenever a
  scaled corner is not a whole number (spatial_scale 1/16 and any roi not
  on the stride).
- Bins are clipped to the map; a bin's output is the maximum, and argmax
  (int64) is the flat h * W + w index of that maximum.
- An empty bin gives 0 and a bin of only NaN gives NaN, both with argmax
  -1; other NaN values are skipped. argmax -1 gets no gradient (MMCV leaves
  0 there for a roi of no width, which sends its gradient to cell 0).
"""
from mmdispatch import _core
from mmdispatch.ops._arrays import (choice, explain, index_array, like, output_pair,
                                    roi_backward_operands)

__all__ = ["roi_pool", "roi_pool_backward", "roi_pool_forward"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("roi_pool_forward_impl", "roi_pool_backward_impl")

# The gradient of `input` for the PyTorch layer's autograd (see
# mmdispatch/ops/roi_align.py): roi_pool_backward_impl's result, with
# `grad_output` the gradient of `output`, the other parameters the forward's.
GRADIENTS = {
    "roi_pool_forward_impl": {
        "input": {"backward": "roi_pool_backward_impl", "grad_output": "output"},
    },
}


_forward_impl = _core.roi_pool_forward_impl

# roi_pool_*_impl's `convention`, by name
CONVENTIONS = {"torchvision": 0, "mmcv": 1}


def roi_pool_forward(input, rois, output_size, spatial_scale=1.0, convention="torchvision"):
    """Returns (output, argmax): output is (K, C, *output_size) in the
    input's dtype, argmax the same shape in int64."""
    op = "roi_pool_forward"
    height, width = output_pair(op, "output_size", output_size)
    code = choice(op, "convention", convention, CONVENTIONS)
    try:
        return _forward_impl(input, rois, None, None, height, width, spatial_scale, code)
    except (TypeError, ValueError) as exc:
        explain(op, exc, (("input", input, 4, "(N, C, H, W)"), ("rois", rois, 2, "(K, 5)")))


def roi_pool_backward(grad_output, rois, argmax, input_shape, spatial_scale=1.0,
                      convention="torchvision"):
    """Gradient of sum(output * grad_output) with respect to the input, of
    shape input_shape; argmax comes from roi_pool_forward (with the same
    convention)."""
    op = "roi_pool_backward"
    code = choice(op, "convention", convention, CONVENTIONS)
    original = grad_output
    grad_output, rois, grad_input = roi_backward_operands(op, grad_output, rois, input_shape,
                                                          "(K, C, out_h, out_w)")
    argmax = index_array(op, "argmax", argmax)
    _core.roi_pool_backward_impl(grad_output, rois, argmax, grad_input, grad_output.shape[2],
                                 grad_output.shape[3], spatial_scale, code)
    return like(original, grad_input)


def roi_pool(input, rois, output_size, spatial_scale=1.0, convention="torchvision"):
    """RoIPool output, (K, C, *output_size)."""
    return roi_pool_forward(input, rois, output_size, spatial_scale, convention)[0]
