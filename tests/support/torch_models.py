"""Torch test helpers shared by tests/torch: an FPN's feature maps, boxes
for every FPN level, a torchvision Mask R-CNN run, and the mark of tests
that trace ops of data-dependent size (needs torch, and torchvision for the
model run; imported by tests that have checked for what they use)."""
import contextlib

import numpy as np
import pytest
import torch

from mmdispatch.torch._library import torch_release

# Tests that trace an op of data-dependent size (nms, soft_nms, torch's
# nonzero) with torch.compile or torch.export: torch 2.11 and newer trace
# them as they are; 2.7 needs capture_dynamic_output_shape_ops, older ones
# are refused by mmdispatch.torch (the README's PyTorch section)
needs_data_dependent_tracing = pytest.mark.skipif(
    torch_release() < (2, 11),
    reason=f"torch {torch.__version__} traces ops of data-dependent size only with "
           f"capture_dynamic_output_shape_ops (2.7) or not at all (before 2.7)")


def fpn_features(names=("0", "1", "2", "3"), channels=8, size=(128, 160), dtype=torch.float32,
                 device="cpu", seed=40):
    """An FPN's maps at strides 4 to 32 of images of `size`, plus a "pool"
    map that a pooler naming the levels must leave out."""
    from collections import OrderedDict
    g = torch.Generator().manual_seed(seed)
    x = OrderedDict()
    for name, stride in zip(names, (4, 8, 16, 32)):
        x[name] = torch.randn(2, channels, size[0] // stride, size[1] // stride, generator=g,
                              dtype=dtype).to(device)
    x["pool"] = torch.randn(2, channels, 2, 3, generator=g, dtype=dtype).to(device)
    return x


def boxes_of_every_level(n, size=(128, 160), seed=41, dtype=torch.float32, device="cpu"):
    """Boxes of sides from 1 to 4x the image (so every FPN level, and the
    clamps at both ends, get some)."""
    g = torch.Generator().manual_seed(seed)
    centre = torch.rand(n, 2, generator=g, dtype=dtype) * torch.tensor(size[::-1], dtype=dtype)
    side = torch.rand(n, 2, generator=g, dtype=dtype) ** 3 * 4 * max(size) + 1
    return torch.cat([centre - side / 2, centre + side / 2], 1).to(device)


@contextlib.contextmanager
def full_float32():
    """cuDNN's convolutions in float32, deterministically, for the block.

    cuDNN convolves float32 in TF32 by default on Ampere and newer (a 10-bit
    mantissa), so two runs whose pooled features differ in the last bits
    (their roi_aligns round differently) round some of the mask head's and
    FPN's products to neighbouring TF32 values, 1e-3 apart: the H200 run of
    2026-11-27 saw backbone.body.conv1.weight's gradients 1.4e-3 of their
    largest magnitude apart, torchvision's pooler against ours. In float32
    only the poolers' own rounding is left to compare."""
    backends = torch.backends
    saved = (backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32,
             backends.cudnn.deterministic, backends.cudnn.benchmark)
    backends.cudnn.allow_tf32 = backends.cuda.matmul.allow_tf32 = False
    backends.cudnn.deterministic, backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        (backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32,
         backends.cudnn.deterministic, backends.cudnn.benchmark) = saved


def mask_rcnn_run(pooler, device="cpu"):
    """torchvision's Mask R-CNN on a small ResNet-18 FPN, with `pooler`'s
    MultiScaleRoIAlign as its box and mask poolers: the losses and the
    gradients of one training step, then the detections in eval mode, with
    cuDNN in float32 (full_float32)."""
    with full_float32():
        return _mask_rcnn_run(pooler, device)


def _mask_rcnn_run(pooler, device):
    from torchvision.models.detection import MaskRCNN
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    torch.manual_seed(0)
    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5)
    model = MaskRCNN(backbone, num_classes=3, min_size=128, max_size=160,
                     box_roi_pool=pooler(["0", "1", "2", "3"], 7, 2),
                     mask_roi_pool=pooler(["0", "1", "2", "3"], 14, 2)).to(device)
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 128, 160, generator=g).to(device) for _ in range(2)]
    targets = []
    for i in range(2):
        boxes = boxes_of_every_level(3, seed=50 + i).clamp(0, 127).to(device)
        boxes[:, 2:] = torch.maximum(boxes[:, 2:], boxes[:, :2] + 8)
        masks = torch.zeros(3, 128, 160, dtype=torch.uint8)
        for j, (x1, y1, x2, y2) in enumerate(boxes.cpu().int().tolist()):
            masks[j, y1:y2, x1:x2] = 1
        targets.append({"boxes": boxes, "labels": torch.tensor([1, 2, 1], device=device),
                        "masks": masks.to(device)})
    model.train()
    losses = model(images, targets)
    sum(losses.values()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        detections = model(images)
    return {k: v.item() for k, v in losses.items()}, grads, detections


def assert_same_run(ours, theirs):
    """Two mask_rcnn_run results agree: the same losses (the mask loss among
    them), gradients and detections (some), within 1e-4.

    On the CPU each gradient agrees element by element. On CUDA, both
    libraries' roi_align backwards add with atomics, so not even two runs of
    torchvision agree bit for bit, and the backbone's gradients carry that
    rounding through every layer below the poolers: an element that is a
    near-cancelling sum (an H200 run of 2026-11-27 failed on
    backbone.body.conv1.weight elementwise) has no relative precision left.
    There each gradient agrees within 1e-4 of its own largest magnitude
    (which TF32 convolutions did not meet either: mask_rcnn_run's
    full_float32)."""
    assert ours[0].keys() == theirs[0].keys() and "loss_mask" in ours[0]
    np.testing.assert_allclose(list(ours[0].values()), list(theirs[0].values()), rtol=1e-4,
                               atol=1e-4)
    assert ours[1].keys() == theirs[1].keys()
    for name in ours[1]:
        mine, want = ours[1][name], theirs[1][name]
        if want.is_cuda:
            scale = want.abs().max().item()
            worst = (mine - want).abs().max().item()
            assert worst <= 1e-4 * scale + 1e-7, \
                f"{name}: differs by {worst:.3g}, its largest magnitude {scale:.3g}"
        else:
            torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-4, msg=name)
    for a, b in zip(ours[2], theirs[2]):
        assert a.keys() == b.keys() and len(a["boxes"])
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-4, msg=key)
