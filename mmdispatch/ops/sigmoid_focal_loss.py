"""Sigmoid focal loss (MMCV's sigmoid_focal_loss), dispatched through
sigmoid_focal_loss_forward_impl / sigmoid_focal_loss_backward_impl.

- input: (N, C) logits; target: (N,) integer class indices in [0, C], where
  C means background (every column is a negative).
- With p = sigmoid(x), an element's loss is
  alpha * (1 - p)**gamma * -log(p) in its target column and
  (1 - alpha) * p**gamma * -log(1 - p) elsewhere, computed from softplus so
  that large |x| stays finite and exact.
- weight: optional (C,) per-class weight; as in MMCV, every element of row i
  is multiplied by weight[target[i]]; background rows are not weighted.
- reduction "mean" is MMCV's: the sum over all elements divided by N (the
  number of rows), not by N * C.
"""
from mmdispatch import _core
from mmdispatch.ops._arrays import explain, index_array, reduce_loss, reduction_of

__all__ = ["sigmoid_focal_loss", "sigmoid_focal_loss_backward", "sigmoid_focal_loss_forward"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("sigmoid_focal_loss_forward_impl", "sigmoid_focal_loss_backward_impl")

# The gradient of `input` for the PyTorch layer's autograd (see
# mmdispatch/ops/roi_align.py): the backward entry point gives d loss / d
# input elementwise, which the gradient of `output` then scales.
GRADIENTS = {
    "sigmoid_focal_loss_forward_impl": {
        "input": {"backward": "sigmoid_focal_loss_backward_impl", "times_grad_of": "output"},
    },
}


def _run(op, impl, input, target, gamma, alpha, weight):
    """impl's output, allocated by the entry point like `input`."""
    try:
        return impl(input, index_array(op, "target", target), weight, None, gamma, alpha)
    except (TypeError, ValueError) as exc:
        explain(op, exc, [("input", input, 2, "(N, C)"), ("target", target, 1, "(N,)")]
                + ([] if weight is None else [("weight", weight, None, "")]))


def sigmoid_focal_loss_forward(input, target, gamma=2.0, alpha=0.25, weight=None):
    """Elementwise loss, (N, C), in the input's dtype."""
    return _run("sigmoid_focal_loss_forward", _core.sigmoid_focal_loss_forward_impl, input,
                target, gamma, alpha, weight)


def sigmoid_focal_loss_backward(input, target, gamma=2.0, alpha=0.25, weight=None):
    """d sum(loss) / d input, (N, C). Scale it by the upstream gradient (and
    by 1 / N for reduction="mean")."""
    return _run("sigmoid_focal_loss_backward", _core.sigmoid_focal_loss_backward_impl, input,
                target, gamma, alpha, weight)


def sigmoid_focal_loss(input, target, gamma=2.0, alpha=0.25, weight=None, reduction="mean"):
    """Focal loss reduced by "none" ((N, C)), "sum" or "mean" (0-d arrays).
    The mean of an empty batch (N = 0) is NaN, as in MMCV."""
    op = "sigmoid_focal_loss"
    reduction = reduction_of(op, reduction)
    loss = _run(op, _core.sigmoid_focal_loss_forward_impl, input, target, gamma, alpha, weight)
    return reduce_loss(loss, reduction)
