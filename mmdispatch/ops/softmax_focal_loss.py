"""Softmax focal loss (MMCV's softmax_focal_loss), dispatched through
softmax_focal_loss_forward_impl / softmax_focal_loss_backward_impl.

- input: (N, C) logits; target: (N,) integer class indices in [0, C), or
  negative for a row that is ignored (loss 0, no gradient).
- With p the softmax probability of a row's target class, the row's loss
  is -alpha * (1 - p)**gamma * log(p), times weight[target] when a (C,)
  weight is given. log(p) is a log-softmax, exact for large logits (MMCV
  clamps p at FLT_MIN, which caps the loss of a far-off row at about 87).
- reduction "mean" is MMCV's: the sum over rows divided by N.
"""
from mmdispatch import _core
from mmdispatch.ops._arrays import explain, index_array, reduce_loss, reduction_of

__all__ = ["softmax_focal_loss", "softmax_focal_loss_backward", "softmax_focal_loss_forward"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("softmax_focal_loss_forward_impl", "softmax_focal_loss_backward_impl")

# The gradient of `input` for the PyTorch layer's autograd: the backward
# entry point's result, with `grad_output` the gradient of the per-row loss.
GRADIENTS = {
    "softmax_focal_loss_forward_impl": {
        "input": {"backward": "softmax_focal_loss_backward_impl", "grad_output": "output"},
    },
}


def _explain(op, exc, input, target, weight, more=()):
    explain(op, exc, [("input", input, 2, "(N, C)"), ("target", target, 1, "(N,)"), *more]
            + ([] if weight is None else [("weight", weight, 1, "(C,)")]))


def softmax_focal_loss_forward(input, target, gamma=2.0, alpha=0.25, weight=None):
    """Per-row loss, (N,), in the input's dtype."""
    op = "softmax_focal_loss_forward"
    try:
        return _core.softmax_focal_loss_forward_impl(input, index_array(op, "target", target),
                                                     weight, None, gamma, alpha)
    except (TypeError, ValueError) as exc:
        _explain(op, exc, input, target, weight)


def softmax_focal_loss_backward(input, target, grad_output, gamma=2.0, alpha=0.25, weight=None):
    """d sum(loss * grad_output) / d input, (N, C); grad_output is (N,) (for
    reduction="mean", the upstream gradient over N in every row)."""
    op = "softmax_focal_loss_backward"
    try:
        return _core.softmax_focal_loss_backward_impl(input, index_array(op, "target", target),
                                                      weight, grad_output, None, gamma, alpha)
    except (TypeError, ValueError) as exc:
        _explain(op, exc, input, target, weight, [("grad_output", grad_output, 1, "(N,)")])


def softmax_focal_loss(input, target, gamma=2.0, alpha=0.25, weight=None, reduction="mean"):
    """Focal loss reduced by "none" ((N,)), "sum" or "mean" (0-d arrays).
    The mean of an empty batch (N = 0) is NaN, as in MMCV."""
    op = "softmax_focal_loss"
    reduction = reduction_of(op, reduction)
    loss = softmax_focal_loss_forward(input, target, gamma, alpha, weight)
    return reduce_loss(loss, reduction)
