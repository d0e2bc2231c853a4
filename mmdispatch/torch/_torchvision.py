"""Our kernels behind torchvision's own ops: `replace_torchvision_kernels()`
registers, for torchvision's compiled ops (torch.ops.torchvision.nms,
roi_align, roi_pool, ps_roi_align, ps_roi_pool, deform_conv2d and their
backward ops), CPU and CUDA kernels that call mmdispatch's. Every caller of
those ops then runs on our kernels without a code change: torchvision.ops'
functions and modules, torchvision's detection models (their RPN and box
nms, their poolers), and graphs torch.compile made of them.

torchvision keeps its autograd, autocast and meta (fake tensor)
registrations: they call the ops through the dispatcher, so they reach our
kernels, and our outputs follow its meta functions' shapes and dtypes (the
int32 argmax of roi_pool and channel mapping of the ps ops). Each adapter
below takes torchvision's argument order to our op's (a fixed mapping from
one schema to another, so it is written out per op; our own ops'
registrations stay derived from signatures.txt).

The registrations are removed again by `restore()` (or leaving the `with`
block), which gives torchvision back its own kernels.
"""
import warnings

import torch

from mmdispatch.ops.roi_pool import CONVENTIONS
from mmdispatch.torch._library import DERIVED
from mmdispatch.torch._vision import _AVG, _nms

_TORCHVISION_CONVENTION = CONVENTIONS["torchvision"]   # roi_pool's torchvision bins


def _run(entry_point):
    """The implementation of our op (no autograd: torchvision's autograd
    registration is above these kernels)."""
    return DERIVED[entry_point].run


def _no_argmax(like):
    return like.new_empty((0,))


def nms(dets, scores, iou_threshold):
    return _nms(dets, scores, None, iou_threshold)


def roi_align(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    return _run("roi_align_forward_impl")(input, rois, pooled_height, pooled_width, spatial_scale,
                                          sampling_ratio, _AVG, aligned)[0]


def roi_align_backward(grad, rois, spatial_scale, pooled_height, pooled_width, batch_size,
                       channels, height, width, sampling_ratio, aligned):
    none = _no_argmax(grad)
    return _run("roi_align_backward_impl")(grad, rois, none, none,
                                           [batch_size, channels, height, width], grad.dtype,
                                           pooled_height, pooled_width, spatial_scale,
                                           sampling_ratio, _AVG, aligned)


def roi_pool(input, rois, spatial_scale, pooled_height, pooled_width):
    output, argmax = _run("roi_pool_forward_impl")(input, rois, pooled_height, pooled_width,
                                                   spatial_scale, _TORCHVISION_CONVENTION)
    return output, argmax.to(torch.int32)   # torchvision's argmax dtype (its meta function's)


def roi_pool_backward(grad, rois, argmax, spatial_scale, pooled_height, pooled_width,
                      batch_size, channels, height, width):
    return _run("roi_pool_backward_impl")(grad, rois, argmax.to(torch.int64),
                                          [batch_size, channels, height, width], grad.dtype,
                                          pooled_height, pooled_width, spatial_scale,
                                          _TORCHVISION_CONVENTION)


def _channel_mapping(output):
    """torchvision's second output of the ps ops: the input channel each
    output element read, (c * pooled_height + i) * pooled_width + j (our
    backward does not need it)."""
    k, c, h, w = output.shape
    return (torch.arange(c * h * w, dtype=torch.int32, device=output.device)
            .view(1, c, h, w).expand(k, c, h, w).contiguous())


def ps_roi_align(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio):
    output = _run("ps_roi_align_forward_impl")(input, rois, pooled_height, pooled_width,
                                               spatial_scale, sampling_ratio)
    return output, _channel_mapping(output)


def ps_roi_align_backward(grad, rois, channel_mapping, spatial_scale, pooled_height,
                          pooled_width, sampling_ratio, batch_size, channels, height, width):
    return _run("ps_roi_align_backward_impl")(grad, rois, [batch_size, channels, height, width],
                                              grad.dtype, pooled_height, pooled_width,
                                              spatial_scale, sampling_ratio)


def ps_roi_pool(input, rois, spatial_scale, pooled_height, pooled_width):
    output = _run("ps_roi_pool_forward_impl")(input, rois, pooled_height, pooled_width,
                                              spatial_scale)
    return output, _channel_mapping(output)


def ps_roi_pool_backward(grad, rois, channel_mapping, spatial_scale, pooled_height,
                         pooled_width, batch_size, channels, height, width):
    return _run("ps_roi_pool_backward_impl")(grad, rois, [batch_size, channels, height, width],
                                             grad.dtype, pooled_height, pooled_width,
                                             spatial_scale)


def deform_conv2d(input, weight, offset, mask, bias, stride_h, stride_w, pad_h, pad_w,
                  dilation_h, dilation_w, groups, offset_groups, use_mask):
    return _run("deform_conv2d_forward_impl")(input, offset, mask if use_mask else None, weight,
                                              bias, stride_h, stride_w, pad_h, pad_w,
                                              dilation_h, dilation_w, groups, offset_groups)


def deform_conv2d_backward(grad, input, weight, offset, mask, bias, stride_h, stride_w, pad_h,
                           pad_w, dilation_h, dilation_w, groups, offset_groups, use_mask):
    grad_input, grad_offset, grad_mask, grad_weight, grad_bias = _run(
        "deform_conv2d_backward_impl")(grad, input, offset, mask if use_mask else None, weight,
                                       stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                                       groups, offset_groups)
    if not use_mask:   # torchvision's placeholder mask gets a gradient of its own shape
        grad_mask = torch.zeros_like(mask)
    return grad_input, grad_weight, grad_offset, grad_mask, grad_bias


# torchvision op -> our kernel for it
KERNELS = {
    "nms": nms,
    "roi_align": roi_align,
    "_roi_align_backward": roi_align_backward,
    "roi_pool": roi_pool,
    "_roi_pool_backward": roi_pool_backward,
    "ps_roi_align": ps_roi_align,
    "_ps_roi_align_backward": ps_roi_align_backward,
    "ps_roi_pool": ps_roi_pool,
    "_ps_roi_pool_backward": ps_roi_pool_backward,
    "deform_conv2d": deform_conv2d,
    "_deform_conv2d_backward": deform_conv2d_backward,
}
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_ACTIVE: "set[TorchvisionKernels]" = set()   # those not restored


def _our_cuda_runs():
    import mmdispatch
    return any(d["device"] == "cuda" and d["available"] for d in mmdispatch.devices())


class TorchvisionKernels:
    """The registrations of replace_torchvision_kernels: `restore()` (or
    the end of a `with` block) removes them, and torchvision's own kernels
    serve its ops again."""

    def __init__(self, devices):
        op = "replace_torchvision_kernels"
        try:
            import torchvision  # noqa: F401  (loads torchvision's ops)
            ops = torch.ops.torchvision
            for name in KERNELS:
                getattr(ops, name)
        except (ImportError, RuntimeError, AttributeError, OSError) as exc:
            raise RuntimeError(f"{op}: torchvision's compiled ops are not available ({exc})") \
                from exc
        if devices is None:
            devices = ("cpu", "cuda") if _our_cuda_runs() else ("cpu",)
        devices = (devices,) if isinstance(devices, str) else tuple(devices)
        unknown = [d for d in devices if d not in _DISPATCH_KEYS]
        if unknown or not devices:
            raise ValueError(f"{op}: devices must be among {sorted(_DISPATCH_KEYS)}, got "
                             f"{unknown or list(devices)}")
        self.devices = devices
        self._library = torch.library.Library("torchvision", "IMPL")
        with warnings.catch_warnings():
            # torch warns that a kernel is overridden: that is the point
            warnings.filterwarnings("ignore", message=".*[Oo]verrid")
            for name, kernel in KERNELS.items():
                for device in devices:
                    self._library.impl(name, kernel, _DISPATCH_KEYS[device])
        # torch removes a Library's registrations when it is collected: the
        # replacement lasts until restore(), not until the handle is dropped
        _ACTIVE.add(self)

    def restore(self):
        """Give torchvision its own kernels back (again: nothing)."""
        if self._library is not None:
            self._library._destroy()
            self._library = None
            _ACTIVE.discard(self)

    @property
    def active(self):
        return self._library is not None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()

    def __repr__(self):
        state = "active" if self.active else "restored"
        return f"<mmdispatch torchvision kernels on {', '.join(self.devices)}: {state}>"


def replace_torchvision_kernels(devices=None):
    """Run torchvision's compiled ops (nms, roi_align, roi_pool,
    ps_roi_align, ps_roi_pool, deform_conv2d, forward and backward) on
    mmdispatch's kernels, for every caller: torchvision.ops, torchvision's
    detection models, torch.compile and torch.jit graphs of them.
    `devices`: "cpu" and/or "cuda" (a name or a list); by default the CPU,
    and CUDA where our CUDA kernels run. Returns a TorchvisionKernels:
    `restore()` it, or use it in a `with` block, to give torchvision its
    kernels back (dropping the handle does not). Semantics are
    mmdispatch.torch's (README, PyTorch section), bad rois included: they
    raise our clear errors where torchvision's kernels compute."""
    return TorchvisionKernels(devices)
