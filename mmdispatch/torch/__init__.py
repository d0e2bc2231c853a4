"""mmdispatch for PyTorch.

- Every dispatch entry point is a torch.library op, ``torch.ops.mmdispatch.*``
  (derived from signatures.txt: fake implementations for FakeTensor and
  torch.compile, autograd), running on mmdispatch's kernels with torch's
  allocator and current CUDA stream.
- Drop-in functions and modules with torchvision.ops' names, signatures and
  defaults: ``from mmdispatch.torch import roi_align, nms`` in place of
  ``from torchvision.ops import roi_align, nms``.
- ``MultiScaleRoIAlign``, torchvision's FPN pooler on our roi_align, a
  subclass of torchvision's where torchvision is installed, so torchvision's
  Faster/Mask/Keypoint R-CNN take it as ``box_roi_pool``/``mask_roi_pool``.
- ``replace_torchvision_kernels()`` runs torchvision's own compiled ops
  (its functions, modules, detection models and compiled graphs of them)
  on our kernels until ``restore()``.
- ``mmdispatch.torch.mmcv`` has MMCV's names, signatures and defaults.

Needs torch (``pip install mmdispatch[torch]``); nothing else in mmdispatch
imports it.
"""
try:
    import torch as _torch  # noqa: F401
except ImportError as exc:
    raise ImportError("mmdispatch.torch needs PyTorch: pip install 'mmdispatch[torch]' (or "
                      "torch itself); the rest of mmdispatch works without it") from exc

from typing import TYPE_CHECKING

from mmdispatch.torch import _onnx  # noqa: F401  (fills ONNX_EXPORTS)
from mmdispatch.torch._torchvision import TorchvisionKernels, replace_torchvision_kernels
from mmdispatch.torch._vision import (DeformConv2d, PSRoIAlign, PSRoIPool, RoIAlign, RoIPool,
                                      batched_nms, box_iou, deform_conv2d, nms, ps_roi_align,
                                      ps_roi_pool, roi_align, roi_pool, sigmoid_focal_loss)

__all__ = ["DeformConv2d", "MultiScaleRoIAlign", "PSRoIAlign", "PSRoIPool", "RoIAlign", "RoIPool",
           "TorchvisionKernels", "batched_nms", "box_iou", "deform_conv2d", "nms",
           "ps_roi_align", "ps_roi_pool", "replace_torchvision_kernels", "roi_align", "roi_pool",
           "sigmoid_focal_loss"]

if TYPE_CHECKING:   # what module __getattr__ makes, for type checkers
    from mmdispatch.torch._vision import _MultiScaleRoIAlign as MultiScaleRoIAlign


def __getattr__(name):
    """MultiScaleRoIAlign, made on first use: a subclass of torchvision's
    (torchvision's detection models take no other pooler) where torchvision
    is installed, so `import mmdispatch.torch` does not import torchvision
    (about a second). torchvision.ops' other public names (box_area,
    clip_boxes_to_image, generalized_box_iou, FeaturePyramidNetwork, ...:
    torch code that runs no compiled kernel) are torchvision's own, so that
    `import mmdispatch.torch as ops` can replace `from torchvision import
    ops`."""
    if name == "MultiScaleRoIAlign":
        from mmdispatch.torch import _vision
        cls = _vision.multiscale_roi_align_class(_vision.torchvision_multiscale_base())
        globals()[name] = cls
        return cls
    if name in _TORCHVISION_OWN:
        try:
            from torchvision import ops
            value = getattr(ops, name)
        except (ImportError, RuntimeError, OSError, AttributeError) as exc:
            raise AttributeError(
                f"module {__name__!r} has no attribute {name!r}: torchvision.ops' names "
                f"without a kernel of ours are torchvision's own, and torchvision is not "
                f"usable here ({exc})") from None
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# torchvision.ops' public names that run no compiled kernel (torch code):
# torchvision's own objects here (a test checks the list against
# torchvision.ops.__all__)
_TORCHVISION_OWN = frozenset({
    "Conv2dNormActivation", "Conv3dNormActivation", "DropBlock2d", "DropBlock3d",
    "FeaturePyramidNetwork", "FrozenBatchNorm2d", "MLP", "Permute", "SqueezeExcitation",
    "StochasticDepth", "box_area", "box_convert", "clip_boxes_to_image", "complete_box_iou",
    "complete_box_iou_loss", "distance_box_iou", "distance_box_iou_loss", "drop_block2d",
    "drop_block3d", "generalized_box_iou", "generalized_box_iou_loss", "masks_to_boxes",
    "remove_small_boxes", "stochastic_depth"})


def __dir__():
    return sorted({*globals(), "MultiScaleRoIAlign"})
