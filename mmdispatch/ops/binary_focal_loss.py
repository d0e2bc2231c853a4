"""Binary focal loss: torchvision's sigmoid_focal_loss (RetinaNet's loss,
with soft targets), fused, dispatched through binary_focal_loss_forward_impl
/ binary_focal_loss_backward_impl.

- input: logits of any shape; target: the same shape and dtype, (soft)
  binary labels.
- With p = sigmoid(x) and p_t = p * t + (1 - p) * (1 - t), an element's
  loss is a_t * (1 - p_t)**gamma * BCE(x, t), a_t = alpha * t + (1 - alpha)
  * (1 - t); alpha = -1 weights nothing (a_t = 1), as torchvision's.
- reduction "mean" is torchvision's: the mean over all elements (NaN for
  none).
- one pass over the elements forward and one backward (both gradients),
  where torchvision's composes 15 elementwise ops forward; the
  gradient at a saturated logit on its target's side is finite for every
  gamma (torchvision's is NaN for gamma < 1).
(MMCV's sigmoid focal loss, with class-index targets: sigmoid_focal_loss.)
"""
import numpy as np

from mmdispatch import _core
from mmdispatch.ops._arrays import explain, reduction_of

__all__ = ["binary_focal_loss", "binary_focal_loss_backward"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("binary_focal_loss_forward_impl", "binary_focal_loss_backward_impl")

# The gradients of input and target for the PyTorch layer: the outputs of one
# binary_focal_loss_backward_impl call, made with with_grad_input /
# with_grad_target set where each is needed; a gradient of the loss that is
# one value broadcast (a sum's or a mean's) goes to it as that value.
GRADIENTS = {
    "binary_focal_loss_forward_impl": {
        name: {"backward": "binary_focal_loss_backward_impl", "grad_output": "output",
               "result": f"grad_{name}", "broadcast_grad": True}
        for name in ("input", "target")
    },
}


def _arrays(input, target, grad_output=None):
    return [("input", input, None, ""), ("target", target, None, "")] + (
        [] if grad_output is None else [("grad_output", grad_output, None, "")])


def _alpha(op, alpha):
    if isinstance(alpha, (bool, np.bool_)) or not isinstance(
            alpha, (int, float, np.integer, np.floating)) or not (
            0 <= alpha <= 1 or alpha == -1):
        raise ValueError(f"{op}: alpha must be in [0, 1], or -1 for no class weighting, got "
                         f"{alpha!r}")
    return float(alpha)


def binary_focal_loss(input, target, gamma=2.0, alpha=0.25, reduction="none"):
    """Focal loss of each element ("none", input's shape) or its "sum" or
    "mean" (0-d arrays), in the input's dtype."""
    op = "binary_focal_loss"
    reduction = reduction_of(op, reduction)
    alpha = _alpha(op, alpha)
    try:
        loss = _core.binary_focal_loss_forward_impl(input, target, None, gamma, alpha)
    except (TypeError, ValueError) as exc:
        explain(op, exc, _arrays(input, target))
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            total = total / loss.size
    return np.asarray(total) if isinstance(total, np.generic) else total


def binary_focal_loss_backward(input, target, grad_output, gamma=2.0, alpha=0.25):
    """(grad_input, grad_target): the gradients of sum(loss * grad_output)
    with respect to input and target; grad_output of the input's shape, or
    a 0-d array, the same gradient for every element (that of a "sum": 1)."""
    op = "binary_focal_loss_backward"
    alpha = _alpha(op, alpha)
    try:
        return _core.binary_focal_loss_backward_impl(
            input, target, grad_output, None, None, gamma, alpha, True, True)
    except (TypeError, ValueError) as exc:
        explain(op, exc, _arrays(input, target, grad_output))
