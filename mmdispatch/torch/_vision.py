"""torchvision.ops' functions and modules, with torchvision's names,
signatures and defaults, on mmdispatch's kernels (the ops of
mmdispatch.torch._library): `from mmdispatch.torch import roi_align` in
place of `from torchvision.ops import roi_align`.

Where our semantics differ from torchvision's they are documented on the
function (box_iou of boxes with no area is 0, not NaN).
"""
import math

import torch
from torch import nn

from mmdispatch.ops._arrays import pair
from mmdispatch.ops.roi_align import _POOL_MODES
from mmdispatch.ops.roi_pool import CONVENTIONS
from mmdispatch.torch._library import DERIVED, _functorch, _onnx_tracing, _plain_eager

_ROI_ALIGN = DERIVED["roi_align_forward_impl"]
_ROI_POOL = DERIVED["roi_pool_forward_impl"]
_PS_ROI_ALIGN = DERIVED["ps_roi_align_forward_impl"]
_PS_ROI_POOL = DERIVED["ps_roi_pool_forward_impl"]
_NMS = DERIVED["nms_impl"]
_OVERLAPS = DERIVED["bbox_overlaps_impl"]
_BOX_IOU_ROTATED = DERIVED["box_iou_rotated_impl"]
_DEFORM_CONV2D = DERIVED["deform_conv2d_forward_impl"]
_BINARY_FOCAL_LOSS = DERIVED["binary_focal_loss_forward_impl"]
_AVG = _POOL_MODES["avg"]


def _pair(op, value, name="output_size"):
    """(h, w) from an int or a pair of ints (torchvision's output_size),
    unbounded: the op checks the sizes."""
    return pair(op, name, value, low=None)


def autocast_on(tensor):
    """Whether torch.autocast is on for the tensor's device type (never for
    a device autocast does not know, such as meta, where torch's own test
    raises)."""
    try:
        return torch.is_autocast_enabled(tensor.device.type)
    except RuntimeError:
        return False


def like_dtype(value, like):
    """`value` in `like`'s dtype (our kernels take arrays of one dtype),
    except inside torch.autocast on like's device, where the op's autocast
    kernel runs both in float32 (so boxes beside float16 features keep
    their precision, as with torchvision)."""
    if value.dtype == like.dtype or autocast_on(like):
        return value
    return value.to(like.dtype)


_SIXTEEN_BITS = (torch.float16, torch.bfloat16)


def with_coordinates(features, coordinates):
    """(features, coordinates) in one dtype for a kernel (ours take arrays
    of one dtype): the coordinates (rois, sampling locations) in the
    features' dtype, except beside 16-bit features, where coordinates of
    another dtype (float32 boxes, integer ones) would move by pixels in 16
    bits (1001.3 is 1000 in bfloat16): there the features go to float32
    and the coordinates with them, and the caller casts the result back to
    the features' dtype (`in_dtype_of`), as torch.autocast runs the op.
    Inside torch.autocast on the features' device, both as they are: the
    op's autocast kernel does the same."""
    dtype = features.dtype
    if coordinates.dtype == dtype or autocast_on(features):
        return features, coordinates
    if dtype in _SIXTEEN_BITS:
        return features.float(), coordinates.float()
    return features, coordinates.to(dtype)


def in_dtype_of(result, features):
    """An op's result in the dtype of the features it was given (see
    with_coordinates)."""
    return result if result.dtype == features.dtype else result.to(features.dtype)


def rois_of(op, boxes, like):
    """(K, 5) rois [batch index, x1, y1, x2, y2] from a Tensor[K, 5] or a
    list of Tensor[L, 4] (one per image), as torchvision takes them, in the
    boxes' dtype (an empty list: `like`'s); with_coordinates takes them to
    the features'."""
    if not isinstance(like, torch.Tensor):
        raise TypeError(f"{op}: input must be a torch.Tensor, got {type(like).__name__} (the "
                        f"numpy and CuPy functions are in mmdispatch.ops)")
    if isinstance(boxes, torch.Tensor):
        if boxes.dim() != 2 or boxes.shape[1] != 5:
            raise ValueError(f"{op}: boxes must be a Tensor[K, 5] or a list of Tensor[L, 4], "
                             f"got a tensor of shape {tuple(boxes.shape)}")
        rois = boxes
    elif isinstance(boxes, (list, tuple)):
        for i, b in enumerate(boxes):
            if not isinstance(b, torch.Tensor) or b.dim() != 2 or b.shape[1] != 4:
                raise ValueError(f"{op}: boxes[{i}] must be a Tensor[L, 4], got "
                                 f"{tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
        if boxes:
            rois = torch.cat([torch.cat([torch.full_like(b[:, :1], i), b], dim=1)
                              for i, b in enumerate(boxes)], dim=0)
        else:
            rois = like.new_empty((0, 5))
    else:
        raise TypeError(f"{op}: boxes must be a Tensor[K, 5] or a list of Tensor[L, 4], got "
                        f"{type(boxes).__name__}")
    return rois


def roi_align(input, boxes, output_size, spatial_scale=1.0, sampling_ratio=-1, aligned=False):
    """RoIAlign (avg pooling) as torchvision.ops.roi_align: input (N, C, H,
    W); boxes a Tensor[K, 5] or a list of Tensor[L, 4]; returns (K, C,
    *output_size). Differentiable with respect to input."""
    h, w = _pair("roi_align", output_size)
    features, rois = with_coordinates(input, rois_of("roi_align", boxes, input))
    return in_dtype_of(_ROI_ALIGN(features, rois, h, w, float(spatial_scale),
                                  int(sampling_ratio), _AVG, bool(aligned))[0], input)


def roi_pool(input, boxes, output_size, spatial_scale=1.0):
    """RoIPool (max pooling, Fast R-CNN) as torchvision.ops.roi_pool;
    differentiable with respect to input."""
    h, w = _pair("roi_pool", output_size)
    features, rois = with_coordinates(input, rois_of("roi_pool", boxes, input))
    return in_dtype_of(_ROI_POOL(features, rois, h, w, float(spatial_scale),
                                 CONVENTIONS["torchvision"])[0], input)


def ps_roi_align(input, boxes, output_size, spatial_scale=1.0, sampling_ratio=-1):
    """Position-sensitive RoIAlign (R-FCN) as torchvision.ops.ps_roi_align:
    input (N, C, H, W) with C a multiple of out_h * out_w; returns (K,
    C / (out_h * out_w), *output_size). Differentiable with respect to
    input. A roi with x2 < x1 or y2 < y1 is an error, and a bin with no
    samples 0 (torchvision computes values for such rois, and NaN for such
    bins)."""
    h, w = _pair("ps_roi_align", output_size)
    features, rois = with_coordinates(input, rois_of("ps_roi_align", boxes, input))
    return in_dtype_of(_PS_ROI_ALIGN(features, rois, h, w, float(spatial_scale),
                                     int(sampling_ratio)), input)


def ps_roi_pool(input, boxes, output_size, spatial_scale=1.0):
    """Position-sensitive RoIPool (average pooling, R-FCN) as
    torchvision.ops.ps_roi_pool, whose bins never include the map's last row
    and column; differentiable with respect to input, with the exact
    gradient (torchvision's spreads a bin that reaches past the map over
    the last row and column too)."""
    h, w = _pair("ps_roi_pool", output_size)
    features, rois = with_coordinates(input, rois_of("ps_roi_pool", boxes, input))
    return in_dtype_of(_PS_ROI_POOL(features, rois, h, w, float(spatial_scale)), input)


def _nms(boxes, scores, idxs, iou_threshold, offset=0):
    """Boxes and scores of two dtypes both go to the wider one (float16
    scores beside float32 boxes would tie where the float32 ones differ).
    A NaN score ranks first, as torch.sort puts it in torchvision's and
    MMCV's nms (our kernel ranks it last): it is taken as +inf, so that a
    +inf score ties with it and the lower index goes first (torchvision
    ranks NaN above +inf; no value of the scores' dtype lies above +inf,
    and a sort to tell them apart would cost every call)."""
    if boxes.dtype != scores.dtype and not autocast_on(boxes):
        common = torch.promote_types(boxes.dtype, scores.dtype)
        boxes, scores = boxes.to(common), scores.to(common)
    return _NMS(boxes, nan_first(scores), idxs, float(iou_threshold), int(offset))


def nan_first(scores):
    """Scores for the nms kernels' ranking, a NaN taken as +inf: first, as
    torch.sort(descending=True) puts it in torchvision's and MMCV's nms
    (see _nms)."""
    if not scores.is_floating_point():
        return scores
    # one op (torch.where of isnan and a tensor of inf took three: 5.6 us
    # where this takes 2.3 on the CPU for 1,000 scores, and two launches
    # more on a GPU); infinities kept as they are
    return torch.nan_to_num(scores, nan=math.inf, posinf=math.inf, neginf=-math.inf)


def nms(boxes, scores, iou_threshold):
    """Indices (int64) of the boxes kept, by decreasing score, as
    torchvision.ops.nms: a box is dropped when a kept box has IoU >
    iou_threshold with it. A NaN score ranks first, as in torchvision
    (mmdispatch.ops.nms ranks it last), tied with a +inf score (_nms)."""
    return _nms(boxes, scores, None, iou_threshold)


def categories(idxs):
    """idxs as the kernels' int64 category ids, which they only compare:
    integers as they are; floating values by their float64 bits (-0.0 as
    0.0, every NaN as one), so that each distinct value is a category of
    its own, as torchvision's and MMCV's loops over torch.unique(idxs) take
    them (converting 0.5 to an integer merged it with 0). Their coordinate
    offset trick, which they use for fewer boxes, can merge close float
    values (0.0 and 0.01 on boxes of side 10); ours never do. No sync."""
    if not idxs.is_floating_point():
        return idxs.to(torch.int64)
    if _onnx_tracing(idxs):   # ONNX has no bit view: the export ranks the values
        return idxs
    values = idxs.to(torch.float64) + 0.0   # -0.0 + 0.0 is 0.0
    return torch.where(values.isnan(), math.nan, values).view(torch.int64)


def batched_nms(boxes, scores, idxs, iou_threshold):
    """nms within each category of idxs, as torchvision.ops.batched_nms:
    boxes of different categories never suppress each other. Equal scores
    are kept in index order (torchvision's path for more than 1,000 boxes
    on the CPU, 25,000 on CUDA (5,000 before torchvision 0.22), re-sorts
    them with an unstable sort: the same boxes, its tied ones in an order
    torch leaves unspecified)."""
    return _nms(boxes, scores, categories(idxs), iou_threshold)


def _box_iou_composite(boxes1, boxes2):
    """IoU written with torch operations, for inputs that need a gradient
    (a zero union gives 0 and a zero gradient, not NaN)."""
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    top_left = torch.max(boxes1[:, None, :2], boxes2[:, :2])
    bottom_right = torch.min(boxes1[:, None, 2:], boxes2[:, 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(dim=2)
    union = area1[:, None] + area2 - inter
    positive = union > 0
    return torch.where(positive, inter / torch.where(positive, union, torch.ones_like(union)),
                       torch.zeros_like(inter))


def _xyxy(boxes, fmt):
    """(..., 4) boxes in fmt "xyxy", "xywh" or "cxcywh" as (x1, y1, x2, y2)."""
    if fmt == "xyxy":
        return boxes
    a, b, w, h = boxes.unbind(-1)
    if fmt == "xywh":
        return torch.stack([a, b, a + w, b + h], -1)
    return torch.stack([a - w / 2, b - h / 2, a + w / 2, b + h / 2], -1)


_AXIS_ALIGNED_FORMATS = ("xyxy", "xywh", "cxcywh")


def box_iou(boxes1, boxes2, fmt="xyxy"):
    """(..., N, M) IoU of (..., N, 4) and (..., M, 4) boxes, as
    torchvision.ops.box_iou: fmt "xyxy" (x1, y1, x2, y2), "xywh" or
    "cxcywh"; or "cxcywhr" (..., 5) rotated boxes, the angle in degrees
    counter-clockwise (our polygon IoU in double). The leading dimensions
    broadcast. The result is float32 for integer, float16 and bfloat16
    boxes and for "cxcywhr", else the wider of the two dtypes (16-bit boxes
    are taken to float32 first: torchvision subtracts their corners in
    bfloat16, several thousandths off at worst). A pair whose union has no
    area gives 0 (torchvision gives NaN). Differentiable for the axis-aligned
    formats: inputs that need a gradient are computed with torch
    operations."""
    op = "box_iou"
    if fmt not in _AXIS_ALIGNED_FORMATS + ("cxcywhr",):
        raise ValueError(f"{op}: fmt must be one of {', '.join(map(repr, _AXIS_ALIGNED_FORMATS))}"
                         f" or 'cxcywhr', got {fmt!r}")
    width = 5 if fmt == "cxcywhr" else 4
    for name, b in (("boxes1", boxes1), ("boxes2", boxes2)):
        if not isinstance(b, torch.Tensor) or b.dim() < 2 or b.shape[-1] != width:
            got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"{op}: {name} must be a Tensor[..., N, {width}] for fmt {fmt!r}, "
                             f"got {got}")
    dtype = torch.promote_types(boxes1.dtype, boxes2.dtype)
    if dtype not in (torch.float32, torch.float64):
        dtype = torch.float32
    boxes1, boxes2 = boxes1.to(dtype), boxes2.to(dtype)
    if boxes1.dim() > 2 or boxes2.dim() > 2:
        lead = torch.broadcast_shapes(boxes1.shape[:-2], boxes2.shape[:-2])
        shape = (*lead, boxes1.shape[-2], boxes2.shape[-2])
        if math.prod(lead) == 0:
            return boxes1.new_zeros(shape, dtype=torch.float32 if fmt == "cxcywhr" else dtype)
        b1 = boxes1.expand(*lead, *boxes1.shape[-2:]).reshape(-1, *boxes1.shape[-2:])
        b2 = boxes2.expand(*lead, *boxes2.shape[-2:]).reshape(-1, *boxes2.shape[-2:])
        return torch.stack([box_iou(x, y, fmt) for x, y in zip(b1, b2)]).reshape(shape)
    if fmt == "cxcywhr":   # float32, as torchvision's rotated op returns
        radians = [torch.cat([b[:, :4], torch.deg2rad(b[:, 4:])], 1) for b in (boxes1, boxes2)]
        return _BOX_IOU_ROTATED(*radians, 0, False, False).to(torch.float32)
    boxes1, boxes2 = _xyxy(boxes1, fmt), _xyxy(boxes2, fmt)
    if torch.is_grad_enabled() and (boxes1.requires_grad or boxes2.requires_grad):
        return _box_iou_composite(boxes1, boxes2)
    return _OVERLAPS(boxes1.contiguous(), boxes2.contiguous(), 0, False, 0)


def focal_loss_composite(inputs, targets, gamma, alpha):
    """binary_focal_loss, unreduced, in torch's elementwise ops (as
    torchvision's sigmoid_focal_loss composes it, 1 - p_t without its
    cancellation): every derivative of every order, and what the ONNX
    exporters translate."""
    p = torch.sigmoid(inputs)
    cross_entropy = nn.functional.binary_cross_entropy_with_logits(inputs, targets,
                                                                   reduction="none")
    remaining = p * (1 - targets) + torch.sigmoid(-inputs) * targets
    if 0 < gamma < 1:
        # pow's slope at 0 is infinite for such gamma, and times the 0 of a
        # saturated logit's gradient it gave NaN (as torchvision's does):
        # 0 ** gamma there is a constant, its gradient 0
        some = remaining != 0
        modulating = torch.where(some, torch.where(some, remaining, 1) ** gamma,
                                 remaining.new_zeros(()))
    else:
        modulating = remaining ** gamma
    loss = cross_entropy * modulating
    return loss if alpha < 0 else (alpha * targets + (1 - alpha) * (1 - targets)) * loss


def _forward_ad_level():
    return getattr(torch.autograd.forward_ad, "_current_level", -1)


def _composite_focal_loss(gamma, alpha):
    """Whether sigmoid_focal_loss takes focal_loss_composite: with a tensor
    gamma or alpha (which may need a gradient), or in eager code inside a
    torch.func transform or forward-mode AD, where torch would drop the
    fused op's tangent without an error (it has a backward only)."""
    if isinstance(gamma, torch.Tensor) or isinstance(alpha, torch.Tensor):
        return True
    if torch.compiler.is_compiling():
        return False
    return bool(_functorch is not None and _functorch()) or _forward_ad_level() >= 0


def sigmoid_focal_loss(inputs, targets, alpha=0.25, gamma=2, reduction="none"):
    """torchvision.ops.sigmoid_focal_loss: inputs are logits of any shape,
    targets the same shape of (soft) binary labels; alpha = -1 disables the
    class weighting; reduction "none", "mean" or "sum". With p = sigmoid(x)
    and p_t = p for positives, 1 - p for negatives, the loss is
    alpha_t * (1 - p_t) ** gamma * cross_entropy, the cross entropy taken
    from the logits (stable for large values). One fused kernel forward and
    one backward (binary_focal_loss), where torchvision's composes 15
    elementwise ops; the result's dtype is torchvision's (float32 under
    autocast, as its cross entropy there). Where 1 - p_t is 0 (a saturated
    logit on its target's side) the gradient is 0 (torchvision's is NaN for
    gamma < 1). Forward-mode AD, torch.func transforms and tensor gamma or
    alpha take the same formula in torch's ops (focal_loss_composite); a
    second backward through the fused op's gradient is refused.
    (MMCV's variant, with class index targets: mmdispatch.torch.mmcv.)"""
    op = "sigmoid_focal_loss"
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{op}: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if not (0 <= alpha <= 1) and alpha != -1:
        raise ValueError(f"{op}: alpha must be in [0, 1], or -1 for no class weighting (as "
                         f"torchvision's), got {alpha}")
    for name, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(value).__name__}")
    dtype = inputs.dtype if targets.dtype == inputs.dtype else torch.promote_types(
        inputs.dtype, targets.dtype)
    if not dtype.is_floating_point:
        raise TypeError(f"{op}: inputs must hold floating-point logits, got {inputs.dtype}")
    if inputs.shape != targets.shape:   # torchvision's cross entropy refuses them too
        raise ValueError(f"{op}: targets must have the inputs' shape {tuple(inputs.shape)}, "
                         f"got {tuple(targets.shape)}")
    if _composite_focal_loss(gamma, alpha):
        loss = focal_loss_composite(inputs, targets.to(dtype), gamma, alpha)
    else:
        if dtype in _SIXTEEN_BITS and autocast_on(inputs):
            dtype = torch.float32
        if inputs.dtype != dtype:   # .to() of the same dtype costs 1.6 us a call
            inputs = inputs.to(dtype)
        if targets.dtype != dtype:
            targets = targets.to(dtype)
        loss = _BINARY_FOCAL_LOSS(inputs, targets, float(gamma), float(alpha))
    if reduction == "mean":
        # the sum over the count: its backward hands the fused backward one
        # value, where mean()'s writes it over the loss's shape. In float32
        # and float64 it is mean()'s bits on the CPU (within an ulp of them
        # on CUDA, whose mean() multiplies by 1 / count); in 16 bits mean()
        # rounds once, so it stays
        if loss.dtype in (torch.float32, torch.float64):
            return loss.sum() / loss.numel()
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


def deform_groups(op, input, offset, weight):
    """(groups, offset_groups) that the tensors' shapes imply, as
    torchvision infers them."""
    for name, t in (("input", input), ("offset", offset), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{op}: {name} must be a 4-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    per_group, taps = weight.shape[1], 2 * weight.shape[2] * weight.shape[3]
    if per_group == 0 or input.shape[1] % per_group:
        raise ValueError(f"{op}: weight has {per_group} input channels per group, which must "
                         f"divide the input's {input.shape[1]} channels")
    if taps == 0 or offset.shape[1] % taps:
        raise ValueError(f"{op}: offset has {offset.shape[1]} channels, which must be a "
                         f"multiple of 2 * kh * kw = {taps}")
    return input.shape[1] // per_group, offset.shape[1] // taps


def deform_conv2d(input, offset, weight, bias=None, stride=(1, 1), padding=(0, 0),
                  dilation=(1, 1), mask=None):
    """torchvision.ops.deform_conv2d: (N, C_out, out_h, out_w);
    differentiable with respect to input, offset, weight, bias and mask."""
    op = "deform_conv2d"
    groups, offset_groups = deform_groups(op, input, offset, weight)
    return _DEFORM_CONV2D(input, offset, mask, weight, bias, *_pair(op, stride, "stride"),
                          *_pair(op, padding, "padding"),
                          *_pair(op, dilation, "dilation"), groups, offset_groups)


class DeformConv2d(nn.Module):
    """torchvision.ops.DeformConv2d: a weight (out_channels, in_channels //
    groups, *kernel_size) and an optional bias, initialised as torchvision
    initialises them; forward(input, offset, mask=None)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True):
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"DeformConv2d: groups ({groups}) must divide in_channels "
                             f"({in_channels}) and out_channels ({out_channels})")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = _pair("DeformConv2d", kernel_size, "kernel_size")
        self.stride = _pair("DeformConv2d", stride, "stride")
        self.padding = _pair("DeformConv2d", padding, "padding")
        self.dilation = _pair("DeformConv2d", dilation, "dilation")
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups,
                                               *self.kernel_size))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        # nn.Conv2d's initialisation, which torchvision's DeformConv2d uses too
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        if self.bias is not None:
            fan_in = self.weight.shape[1] * self.weight.shape[2] * self.weight.shape[3]
            bound = 1 / fan_in ** 0.5 if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input, offset, mask=None):
        return deform_conv2d(input, offset, self.weight, self.bias, self.stride, self.padding,
                             self.dilation, mask)

    def __repr__(self):
        text = (f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}")
        if self.padding != (0, 0):
            text += f", padding={self.padding}"
        if self.dilation != (1, 1):
            text += f", dilation={self.dilation}"
        if self.groups != 1:
            text += f", groups={self.groups}"
        return text + (", bias=False)" if self.bias is None else ")")


# torch.fx traces the modules below with these functions as leaves (their
# argument checks would meet fx's proxies), as torchvision's modules trace
for _leaf in ("roi_align", "roi_pool", "ps_roi_align", "ps_roi_pool"):
    torch.fx.wrap(_leaf)
del _leaf


class RoIAlign(nn.Module):
    """torchvision.ops.RoIAlign."""

    def __init__(self, output_size, spatial_scale, sampling_ratio, aligned=False):
        super().__init__()
        self.output_size = output_size
        self.spatial_scale = spatial_scale
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned

    def forward(self, input, rois):
        return roi_align(input, rois, self.output_size, self.spatial_scale, self.sampling_ratio,
                         self.aligned)

    def __repr__(self):
        return (f"{self.__class__.__name__}(output_size={self.output_size}, "
                f"spatial_scale={self.spatial_scale}, sampling_ratio={self.sampling_ratio}, "
                f"aligned={self.aligned})")


class _Pool(nn.Module):
    """What torchvision's RoIPool and PSRoIPool share (neither is the
    other's subclass)."""

    def __init__(self, output_size, spatial_scale):
        super().__init__()
        self.output_size = output_size
        self.spatial_scale = spatial_scale

    def __repr__(self):
        return (f"{self.__class__.__name__}(output_size={self.output_size}, "
                f"spatial_scale={self.spatial_scale})")


class PSRoIAlign(nn.Module):
    """torchvision.ops.PSRoIAlign."""

    def __init__(self, output_size, spatial_scale, sampling_ratio):
        super().__init__()
        self.output_size = output_size
        self.spatial_scale = spatial_scale
        self.sampling_ratio = sampling_ratio

    def forward(self, input, rois):
        return ps_roi_align(input, rois, self.output_size, self.spatial_scale,
                            self.sampling_ratio)

    def __repr__(self):
        return (f"{self.__class__.__name__}(output_size={self.output_size}, "
                f"spatial_scale={self.spatial_scale}, sampling_ratio={self.sampling_ratio})")


class RoIPool(_Pool):
    """torchvision.ops.RoIPool."""

    def forward(self, input, rois):
        return roi_pool(input, rois, self.output_size, self.spatial_scale)


class PSRoIPool(_Pool):
    """torchvision.ops.PSRoIPool."""

    def forward(self, input, rois):
        return ps_roi_pool(input, rois, self.output_size, self.spatial_scale)


class _LevelMapper:
    """The FPN paper's level of each box (its eq. 1), as torchvision's
    LevelMapper: floor(canonical_level + log2(sqrt(area) / canonical_scale)
    + eps), clamped to [k_min, k_max], minus k_min."""

    def __init__(self, k_min, k_max, canonical_scale=224, canonical_level=4, eps=1e-6):
        self.k_min, self.k_max = k_min, k_max
        self.s0, self.lvl0, self.eps = canonical_scale, canonical_level, eps

    def __call__(self, boxlists):
        """The level index (int64, from 0) of each box of the (L, 4) lists."""
        s = torch.sqrt(torch.cat([(b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) for b in boxlists]))
        target = torch.floor(self.lvl0 + torch.log2(s / self.s0)
                             + torch.tensor(self.eps, dtype=s.dtype, device=s.device))
        target = torch.clamp(target, min=self.k_min, max=self.k_max)
        return target.to(torch.int64) - self.k_min


def _level_scale(op, feature, original_size):
    """The scale 2 ** -k of a feature map relative to the (height, width)
    of the largest image, from its height, rounded as torchvision rounds it
    (log2 of the float32 ratio, to the nearest integer, ties to even)."""
    approx = torch.tensor(float(feature.shape[-2]) / float(original_size[0])).log2().round()
    scale = 2 ** float(approx)
    if not 0 < scale < math.inf:
        raise ValueError(f"{op}: a feature map of shape {tuple(feature.shape)} has no scale "
                         f"relative to images of size {tuple(original_size)}")
    return scale


def _level_rows(shape, dtype, indices, pooled, zeros=True):
    """A (K, C, h, w) result of `dtype` with each level's pooled rows at its
    indices (index_copy_), the rest 0 (or uninitialised: not zeros)."""
    first = pooled[0]
    result = (first.new_zeros if zeros else first.new_empty)(shape, dtype=dtype)
    for index, rows in zip(indices, pooled):
        result.index_copy_(0, index, rows.to(dtype))
    return result


class _LevelRows(torch.autograd.Function):
    """MultiScaleRoIAlign's result in eager code: each level's pooled rows
    put in place (index_copy_) in an uninitialised (K, C, h, w) tensor (0
    where some rows belong to no level); backward hands each level the rows
    of the gradient at its indices. torch's own index_copy_ into zeros (or
    torchvision's pooler's index_put_, `result[index] = ...`) fills the
    result with zeros first and copies the whole gradient once per level
    after the first in backward (an index_fill of what the earlier levels
    wrote): four passes over the (K, C, h, w) gradient of FPN's four
    levels, a fifth of the standard workload's CPU forward+backward
    (torch.profiler). Under tracing,
    torch.compile or a torch.func transform the pooler takes torch's ops
    instead (torch.jit.trace records no autograd.Function's inside)."""

    @staticmethod
    def forward(ctx, shape, dtype, indices, *pooled):
        ctx.indices = indices
        ctx.dtypes = [rows.dtype for rows in pooled]
        covered = sum(int(index.numel()) for index in indices)
        return _level_rows(shape, dtype, indices, pooled, zeros=covered < shape[0])

    @staticmethod
    def backward(ctx, grad):
        needs = ctx.needs_input_grad[3:]
        return (None, None, None,
                *(grad.index_select(0, index).to(dtype) if need else None
                  for index, dtype, need in zip(ctx.indices, ctx.dtypes, needs)))


class _MultiScaleRoIAlign:
    """torchvision.ops.MultiScaleRoIAlign, the pooler of torchvision's
    Faster, Mask and Keypoint R-CNN, on our roi_align: each box is pooled
    from one feature map, picked by the FPN paper's eq. 1 (a box of
    canonical_scale ** 2 area goes to level canonical_level), with the
    maps' scales inferred from their heights on the first call and kept
    (set .scales to None to infer them again).

    forward(x, boxes, image_shapes): x a dict of (N, C, H, W) maps (those
    named in featmap_names are used, in x's order), boxes a list of
    Tensor[L, 4] (x1, y1, x2, y2) in image coordinates, one per image,
    image_shapes the (height, width) of each image; returns (K, C,
    *output_size). The levels, from the first map's to the last map's
    scale, pair with the maps by position, as torchvision pairs them: where
    featmap_names skips a level, the boxes of the levels past the last map
    give zeros. Each level is one roi_align call, as in torchvision's.

    Where torchvision is installed this class is a subclass of
    torchvision's, which its detection models require:
    `box_roi_pool=MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)` in
    FasterRCNN (or `model.roi_heads.box_roi_pool = ...` in a built model)
    runs a torchvision model's pooling on our kernels. torch.jit.trace
    and torch.compile (fullgraph too) take it; torch.jit.script takes
    torchvision's pooler in its place (__prepare_scriptable__); torch.fx
    symbolic tracing does not take it."""

    def __init__(self, featmap_names, output_size, sampling_ratio, *, canonical_scale=224,
                 canonical_level=4):
        nn.Module.__init__(self)
        self.featmap_names = featmap_names
        self.output_size = _pair("MultiScaleRoIAlign", output_size)
        self.sampling_ratio = sampling_ratio
        self.scales = None
        self.map_levels = None
        self.canonical_scale = canonical_scale
        self.canonical_level = canonical_level

    def _setup_scales(self, features, image_shapes):
        op = "MultiScaleRoIAlign"
        if not image_shapes:
            raise ValueError(f"{op}: image_shapes must hold the (height, width) of each image, "
                             f"got {image_shapes!r}")
        original_size = (max(int(s[0]) for s in image_shapes),
                         max(int(s[1]) for s in image_shapes))
        scales = [_level_scale(op, f, original_size) for f in features]
        # levels from the first and last maps' scales, as torchvision: float32 log2, truncated
        k_min, k_max = (int(-torch.log2(torch.tensor(s, dtype=torch.float32)).item())
                        for s in (scales[0], scales[-1]))
        self.scales = scales
        self.map_levels = _LevelMapper(k_min, k_max, self.canonical_scale,
                                       self.canonical_level)

    def forward(self, x, boxes, image_shapes):
        op = "MultiScaleRoIAlign"
        features = [v for k, v in x.items() if k in self.featmap_names]
        if not features:
            raise ValueError(f"{op}: none of featmap_names {list(self.featmap_names)} is a key "
                             f"of x (keys {list(x)})")
        channels = {int(f.shape[1]) if f.dim() == 4 else None for f in features}
        if len(channels) != 1 or None in channels:
            raise ValueError(f"{op}: the feature maps must be (N, C, H, W) of one C, got shapes "
                             f"{[tuple(f.shape) for f in features]}")
        if not isinstance(boxes, (list, tuple)):
            raise TypeError(f"{op}: boxes must be a list of Tensor[L, 4], one per image, got "
                            f"{type(boxes).__name__}")
        if self.scales is None or self.map_levels is None:
            self._setup_scales(features, image_shapes)
        if len(self.scales) != len(features):
            raise ValueError(f"{op}: {len(features)} feature maps where the scales were set up "
                             f"for {len(self.scales)} (set .scales = None to infer them again)")
        # rois in the boxes' dtype (roi_align takes them to each map's), as torchvision
        like = boxes[0] if boxes and isinstance(boxes[0], torch.Tensor) else features[0]
        rois = rois_of(op, boxes, like)
        h, w = self.output_size
        if len(features) == 1:
            return roi_align(features[0], rois, (h, w), self.scales[0], self.sampling_ratio)
        levels = self.map_levels([rois[:, 1:]])
        # every level pooled, those without boxes too (so every map gets a
        # gradient, as torchvision's); a level past the last map (or a NaN
        # box's) is never pooled: its rows stay 0. One selection per level,
        # as torchvision's, so torch.jit.trace and torch.compile(fullgraph)
        # take it as they take torchvision's
        indices, pooled = [], []
        for level, (feature, scale) in enumerate(zip(features, self.scales)):
            index = torch.where(levels == level)[0]
            indices.append(index)
            pooled.append(roi_align(feature, rois[index], (h, w), scale, self.sampling_ratio))
        shape, dtype = (rois.shape[0], features[0].shape[1], h, w), features[0].dtype
        if _plain_eager(pooled, range(len(pooled))) is None:   # traced, compiled, transformed
            return _level_rows(shape, dtype, indices, pooled)
        return _LevelRows.apply(shape, dtype, indices, *pooled)

    def __prepare_scriptable__(self):
        """torch.jit.script takes torchvision's pooler in its place (our
        ops are not scriptable), with this one's settings and scales; its
        torch.ops.torchvision calls run our kernels under
        replace_torchvision_kernels."""
        from torchvision.ops import MultiScaleRoIAlign as Theirs
        from torchvision.ops.poolers import LevelMapper
        theirs = Theirs(self.featmap_names, self.output_size, self.sampling_ratio,
                        canonical_scale=self.canonical_scale,
                        canonical_level=self.canonical_level)
        if self.scales is not None and self.map_levels is not None:
            m = self.map_levels
            theirs.scales = list(self.scales)
            theirs.map_levels = LevelMapper(m.k_min, m.k_max, m.s0, m.lvl0, m.eps)
        return theirs

    def __repr__(self):
        return (f"{self.__class__.__name__}(featmap_names={self.featmap_names}, "
                f"output_size={self.output_size}, sampling_ratio={self.sampling_ratio})")


def multiscale_roi_align_class(base):
    """MultiScaleRoIAlign (the methods of _MultiScaleRoIAlign) as a
    subclass of `base`: torchvision's MultiScaleRoIAlign, or nn.Module
    without torchvision."""
    return type("MultiScaleRoIAlign", (_MultiScaleRoIAlign, base),
                {"__module__": "mmdispatch.torch", "__qualname__": "MultiScaleRoIAlign",
                 "__doc__": _MultiScaleRoIAlign.__doc__})


def torchvision_multiscale_base():
    """torchvision.ops.MultiScaleRoIAlign, or nn.Module where torchvision
    is not installed or does not load (built for another torch)."""
    try:
        from torchvision.ops import MultiScaleRoIAlign as base
    except (ImportError, RuntimeError, OSError):
        return nn.Module
    return base
