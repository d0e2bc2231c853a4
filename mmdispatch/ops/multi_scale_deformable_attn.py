"""Multi-scale deformable attention (Deformable DETR; MMCV's
multi_scale_deformable_attn), dispatched through
multi_scale_deformable_attn_forward_impl / _backward_impl.

- value is (N, S, M, D): S keys, the cells of every level one level after
  another (row-major), for M heads of D channels.
- spatial_shapes is (L, 2), each level's (H, W), and level_start_index
  (L,) where each level starts in S: (0, H_0 * W_0, ...); S must be the sum
  of H * W. Both are integer arrays on value's device; anything else is an
  error naming the level.
- sampling_locations is (N, Q, M, L, P, 2): per query, head, level and
  point, an (x, y) location in [0, 1] of the level; attention_weights is
  (N, Q, M, L, P).
- The output (N, Q, M * D) is, per query and head, the sum over levels and
  points of attention_weights times the level's value sampled bilinearly at
  (x * W - 0.5, y * H - 0.5) in cells, with zeros outside the level (as
  grid_sample with align_corners=False and zero padding).
- A NaN location makes its query and head's output NaN (and its gradients
  NaN); a location outside the level, however far, reads zeros.
- Backward sums grad_output x each corner's value before weighting the
  corners, so an infinite grad_output may give NaN where the definition's
  order (weights first) gives an infinity; finite gradients follow IEEE
  arithmetic as the definition does.
- im2col_step is MMCV's batch step for its CUDA kernel. It is checked (an
  int >= 1) and changes nothing here: the kernels take the whole batch.
"""
import operator

from mmdispatch import _core
from mmdispatch.ops._arrays import explain, index_array

__all__ = ["multi_scale_deformable_attn", "multi_scale_deformable_attn_backward"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("multi_scale_deformable_attn_forward_impl",
                "multi_scale_deformable_attn_backward_impl")

# The gradients of value, sampling_locations and attention_weights for the
# PyTorch layer: outputs ("result") of one backward call, with
# `grad_output` the gradient of the forward's `output`.
GRADIENTS = {
    "multi_scale_deformable_attn_forward_impl": {
        name: {"backward": "multi_scale_deformable_attn_backward_impl",
               "grad_output": "output", "result": f"grad_{name}"}
        for name in ("value", "sampling_locations", "attention_weights")
    },
}

_LAYOUTS = (("value", 4, "(N, S, M, D)"), ("spatial_shapes", 2, "(L, 2)"),
            ("level_start_index", 1, "(L,)"),
            ("sampling_locations", 6, "(N, Q, M, L, P, 2)"),
            ("attention_weights", 5, "(N, Q, M, L, P)"))


def _im2col_step(op, step):
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"{op}: im2col_step must be an int, got {type(step).__name__}") from None
    if step < 1:
        raise ValueError(f"{op}: im2col_step must be >= 1, got {step}")


def _levels(op, spatial_shapes, level_start_index):
    return (index_array(op, "spatial_shapes", spatial_shapes),
            index_array(op, "level_start_index", level_start_index))


def multi_scale_deformable_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                attention_weights, im2col_step=64):
    """(N, Q, M * D) in value's dtype, library and device."""
    op = "multi_scale_deformable_attn"
    _im2col_step(op, im2col_step)
    arrays = (value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    try:
        shapes, starts = _levels(op, spatial_shapes, level_start_index)
        return _core.multi_scale_deformable_attn_forward_impl(
            value, shapes, starts, sampling_locations, attention_weights, None)
    except (TypeError, ValueError) as exc:
        explain(op, exc, [(name, a, ndim, layout)
                          for (name, ndim, layout), a in zip(_LAYOUTS, arrays)])


def multi_scale_deformable_attn_backward(value, spatial_shapes, level_start_index,
                                         sampling_locations, attention_weights, grad_output,
                                         im2col_step=64):
    """(grad_value, grad_sampling_locations, grad_attention_weights): the
    gradients of sum(output * grad_output), grad_output (N, Q, M * D)."""
    op = "multi_scale_deformable_attn_backward"
    _im2col_step(op, im2col_step)
    arrays = (value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
              grad_output)
    try:
        shapes, starts = _levels(op, spatial_shapes, level_start_index)
        return _core.multi_scale_deformable_attn_backward_impl(
            value, shapes, starts, sampling_locations, attention_weights, grad_output, None,
            None, None)
    except (TypeError, ValueError) as exc:
        explain(op, exc, [(name, a, ndim, layout) for (name, ndim, layout), a
                          in zip(_LAYOUTS + (("grad_output", 3, "(N, Q, M * D)"),), arrays)])
