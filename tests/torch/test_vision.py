"""mmdispatch.torch as a drop-in for torchvision.ops: the same results and
gradients as torchvision's own ops, a small two-stage detector head trained
either way, gradcheck, torch.compile, and bad input."""
import math
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the test extra has it)")
torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")

import mmdispatch.torch as mt  # noqa: E402
from torch_models import (assert_same_run, boxes_of_every_level, fpn_features,  # noqa: E402
                          mask_rcnn_run, needs_data_dependent_tracing)
from torchvision import ops as tv  # noqa: E402


def feature_map(seed=0, dtype=torch.float32, shape=(2, 8, 24, 20)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def random_boxes(n, size, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g, dtype=dtype) * size * 0.8
    wh = torch.rand(n, 2, generator=g, dtype=dtype) * size * 0.5 + 0.5
    return torch.cat([xy, xy + wh], dim=1)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [-1, 0, 2])
@pytest.mark.parametrize("as_list", [False, True])
def test_roi_align_matches_torchvision_in_value_and_gradient(aligned, sampling_ratio, as_list):
    x = feature_map().requires_grad_(True)
    boxes = [random_boxes(7, 40, seed=2), random_boxes(5, 40, seed=3)]
    rois = boxes if as_list else torch.cat(
        [torch.cat([torch.full((len(b), 1), float(i)), b], dim=1) for i, b in enumerate(boxes)])
    ours = mt.roi_align(x, rois, (3, 4), 0.5, sampling_ratio, aligned)
    theirs = tv.roi_align(x, rois, (3, 4), 0.5, sampling_ratio, aligned)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    g = torch.randn(ours.shape)
    (ours_grad,) = torch.autograd.grad(ours, x, g)
    (theirs_grad,) = torch.autograd.grad(theirs, x, g)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-5, atol=1e-5)


def test_roi_pool_nms_batched_nms_and_box_iou_match_torchvision():
    x = feature_map().requires_grad_(True)
    rois = [random_boxes(9, 40, seed=4), random_boxes(4, 40, seed=5)]
    ours, theirs = mt.roi_pool(x, rois, 3, 0.5), tv.roi_pool(x, rois, 3, 0.5)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(ours.sum(), x)[0],
                               torch.autograd.grad(theirs.sum(), x)[0])
    boxes = random_boxes(400, 100, seed=6)
    scores = torch.rand(400, generator=torch.Generator().manual_seed(7))
    classes = torch.randint(0, 6, (400,), generator=torch.Generator().manual_seed(8))
    for threshold in (0.3, 0.5, 0.7):
        assert torch.equal(mt.nms(boxes, scores, threshold), tv.nms(boxes, scores, threshold))
        assert torch.equal(mt.batched_nms(boxes, scores, classes, threshold),
                           tv.batched_nms(boxes, scores, classes, threshold))
    torch.testing.assert_close(mt.box_iou(boxes, boxes[:50]), tv.box_iou(boxes, boxes[:50]))


def test_box_iou_of_boxes_without_area_is_zero_and_it_is_differentiable():
    boxes = torch.tensor([[1.0, 1, 1, 1], [0, 0, 2, 2]])
    iou = mt.box_iou(boxes, boxes)
    assert iou[0, 0] == 0 and iou[1, 1] == 1          # torchvision: NaN, 1
    assert torch.isnan(tv.box_iou(boxes, boxes)[0, 0])
    b1 = random_boxes(5, 10, seed=9, dtype=torch.float64).requires_grad_(True)
    b2 = random_boxes(4, 10, seed=10, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda b: mt.box_iou(b, b2), (b1,))
    torch.testing.assert_close(mt.box_iou(b1, b2), tv.box_iou(b1, b2))
    assert mt.box_iou(torch.tensor([[0, 0, 2, 2]]), torch.tensor([[1, 1, 3, 3]])).dtype == \
        torch.float32   # integer boxes, as torchvision: float


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("alpha", [0.25, -1])
def test_sigmoid_focal_loss_matches_torchvision(reduction, alpha):
    g = torch.Generator().manual_seed(11)
    inputs = (torch.randn(6, 5, generator=g, dtype=torch.float64) * 8).requires_grad_(True)
    targets = (torch.rand(6, 5, generator=g, dtype=torch.float64) > 0.7).to(torch.float64)
    ours = mt.sigmoid_focal_loss(inputs, targets, alpha, 2, reduction)
    theirs = tv.sigmoid_focal_loss(inputs, targets, alpha, 2, reduction)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours.sum(), inputs)[0],
                               torch.autograd.grad(theirs.sum(), inputs)[0])


def test_sigmoid_focal_loss_is_torchvisions_for_targets_outside_0_1_and_gamma_1():
    """The where() that keeps gamma < 1 gradients finite changes nothing
    else: targets outside [0, 1] (1 - p_t < 0) and the targets' gradient at
    gamma 1 are torchvision's."""
    inputs = torch.tensor([3.0, -3, 20, 0.5])
    targets = torch.tensor([1.5, -0.2, 1.0, 0.3], requires_grad=True)
    for gamma in (0.5, 1, 2):
        ours = mt.sigmoid_focal_loss(inputs, targets, -1, gamma)
        theirs = tv.sigmoid_focal_loss(inputs, targets, -1, gamma)
        torch.testing.assert_close(ours, theirs, equal_nan=True)
        if gamma >= 1:
            torch.testing.assert_close(torch.autograd.grad(ours.sum(), targets)[0],
                                       torch.autograd.grad(theirs.sum(), targets)[0])


def test_sigmoid_focal_loss_gives_both_gradients_promotes_and_broadcasts_as_torchvision():
    """Soft targets that need a gradient (distillation) get torchvision's;
    targets of another dtype give torchvision's result and dtype, another
    shape its error; float16 and bfloat16 on the CPU compute
    in float32; all through one op (binary_focal_loss) a call."""
    g = torch.Generator().manual_seed(5)
    inputs = (torch.randn(5, 4, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    targets = torch.rand(5, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    for alpha, gamma in ((0.25, 2), (-1, 0), (0.75, 1.5)):
        ours = mt.sigmoid_focal_loss(inputs, targets, alpha, gamma, "sum")
        theirs = tv.sigmoid_focal_loss(inputs, targets, alpha, gamma, "sum")
        torch.testing.assert_close(ours, theirs)
        for a, b in zip(torch.autograd.grad(ours, (inputs, targets)),
                        torch.autograd.grad(theirs, (inputs, targets))):
            torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(
        lambda x, t: mt.sigmoid_focal_loss(x, t, 0.25, 2.5, "mean"), (inputs, targets))
    x32 = inputs.detach().float()
    ours, theirs = (f.sigmoid_focal_loss(x32, (inputs > 0).double()) for f in (mt, tv))
    assert ours.dtype == theirs.dtype == torch.float64
    torch.testing.assert_close(ours, theirs)
    for f in (mt, tv):   # no broadcasting
        with pytest.raises(ValueError, match="size|shape"):
            f.sigmoid_focal_loss(x32, torch.rand(1, 4))
    # boolean labels (torchvision's subtracts them and raises): as floats
    torch.testing.assert_close(mt.sigmoid_focal_loss(x32, inputs > 0),
                               tv.sigmoid_focal_loss(x32, (inputs > 0).float()))
    for dtype in (torch.float16, torch.bfloat16):
        ours = mt.sigmoid_focal_loss(x32.to(dtype), (x32 > 0).to(dtype))
        assert ours.dtype == dtype
        torch.testing.assert_close(ours.float(), tv.sigmoid_focal_loss(
            x32.to(dtype).float(), (x32 > 0).float()), rtol=1e-2, atol=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):   # torchvision's BCE: float32 there
        assert mt.sigmoid_focal_loss(x32.bfloat16(), (x32 > 0).bfloat16()).dtype == \
            tv.sigmoid_focal_loss(x32.bfloat16(), (x32 > 0).bfloat16()).dtype == torch.float32
    with pytest.raises(TypeError, match="sigmoid_focal_loss: inputs must hold floating-point"):
        mt.sigmoid_focal_loss(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))


def test_sigmoid_focal_loss_has_every_derivative_torch_func_and_forward_ad_take():
    """The fused op has a backward only: forward-mode AD, torch.func's
    transforms and tensor gamma/alpha take the composite formula, with
    torchvision's values; a second backward through the fused op's
    gradient is refused with a clear error, never a wrong answer."""
    import torch.autograd.forward_ad as fwAD

    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, generator=g, dtype=torch.float64) * 3
    t = torch.rand(5, generator=g, dtype=torch.float64)
    v = torch.randn(5, generator=g, dtype=torch.float64)
    for f in (lambda lib, x: lib.sigmoid_focal_loss(x, t, 0.25, 2),
              lambda lib, x: lib.sigmoid_focal_loss(x, t, -1, 1.5, "sum")):
        ours, theirs = (torch.func.jvp(lambda x: f(lib, x), (x,), (v,))[1] for lib in (mt, tv))
        torch.testing.assert_close(ours, theirs)
        with fwAD.dual_level():
            ours = fwAD.unpack_dual(f(mt, fwAD.make_dual(x, v))).tangent
        torch.testing.assert_close(ours, theirs)
    hessians = [torch.func.hessian(lambda x: lib.sigmoid_focal_loss(x, t, 0.25, 2, "sum"))(x)
                for lib in (mt, tv)]
    torch.testing.assert_close(*hessians)
    gamma = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    ours, theirs = (torch.autograd.grad(lib.sigmoid_focal_loss(x, t, 0.25, gamma, "sum"), gamma)
                    for lib in (mt, tv))
    torch.testing.assert_close(ours, theirs)
    xr = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(mt.sigmoid_focal_loss(xr, t, reduction="sum"), xr,
                                  create_graph=True)
    with pytest.raises(RuntimeError, match="binary_focal_loss_backward"):
        torch.autograd.grad(grad.sum(), xr)


def test_retinanets_classification_loss_on_our_focal_loss_is_torchvisions(monkeypatch):
    """torchvision's RetinaNet head computes its loss with the
    sigmoid_focal_loss its module imported: swapping that one name for
    ours gives the same loss and gradients (ignored and background anchors,
    two images)."""
    from torchvision.models.detection import retinanet

    torch.manual_seed(0)
    head = retinanet.RetinaNetClassificationHead(8, num_anchors=3, num_classes=5)
    features = [torch.randn(2, 8, 6, 5), torch.randn(2, 8, 3, 3)]
    targets = [{"labels": torch.tensor([1, 4])}, {"labels": torch.tensor([2])}]
    anchors = 3 * (30 + 9)
    matched = [torch.randint(-2, 2, (anchors,)), torch.randint(-2, 1, (anchors,))]

    def loss_and_grads():
        logits = head(features)
        loss = head.compute_loss(targets, {"cls_logits": logits}, matched)
        return loss, torch.autograd.grad(loss, list(head.parameters()))

    theirs = loss_and_grads()
    monkeypatch.setattr(retinanet, "sigmoid_focal_loss", mt.sigmoid_focal_loss)
    ours = loss_and_grads()
    torch.testing.assert_close(ours[0], theirs[0])
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_sigmoid_focal_loss_matches_torchvisions_with_both_gradients(torch_cuda, dtype):
    """On CUDA tensors, torch's stream and allocator: torchvision's values
    and gradients (16-bit: ours computes in float32, so compared with
    torchvision's float32 result), under autocast too."""
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(300, 20, generator=g) * 4).cuda()
    t = (torch.rand(300, 20, generator=g) > 0.9).float().cuda()
    xs, ts = x.to(dtype).requires_grad_(True), t.to(dtype).requires_grad_(True)
    ours = mt.sigmoid_focal_loss(xs, ts, 0.25, 2, "sum")
    assert ours.dtype == dtype and ours.device == xs.device
    x32, t32 = xs.detach().float().requires_grad_(True), ts.detach().float().requires_grad_(True)
    theirs = tv.sigmoid_focal_loss(x32, t32, 0.25, 2, "sum")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ours.float(), theirs, **tol)
    for a, b in zip(torch.autograd.grad(ours, (xs, ts)), torch.autograd.grad(theirs, (x32, t32))):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, **tol)
    with torch.autocast("cuda", dtype=torch.float16):
        assert mt.sigmoid_focal_loss(x.half(), t.half()).dtype == \
            tv.sigmoid_focal_loss(x.half(), t.half()).dtype


def test_sigmoid_focal_loss_of_a_sum_or_mean_hands_its_backward_one_gradient_value():
    """torch's backward of a "sum" or "mean" broadcasts one value over the
    loss's shape; the fused backward takes that value (0-d) instead of a
    full array of it, which torch would have had to write: the gradients of
    "none" given the full array, bit for bit. Any other gradient (here
    "none"'s, and a strided one) reaches it with the loss's shape."""
    import mmdispatch

    g = torch.Generator().manual_seed(8)
    inputs = (torch.randn(50, 9, generator=g) * 6).requires_grad_(True)
    targets = torch.rand(50, 9, generator=g).requires_grad_(True)
    shapes = []

    def record(event, call):
        if event == "begin" and call.op == "binary_focal_loss_backward_impl":
            shapes.append(call.shapes[2])

    for reduction, full in (("sum", torch.ones(50, 9)), ("mean", torch.ones(50, 9) / 450)):
        with mmdispatch.trace(record):
            got = torch.autograd.grad(mt.sigmoid_focal_loss(inputs, targets, 0.25, 2, reduction),
                                      (inputs, targets))
        want = torch.autograd.grad(mt.sigmoid_focal_loss(inputs, targets, 0.25, 2, "none"),
                                   (inputs, targets), full)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    with mmdispatch.trace(record):
        torch.autograd.grad(mt.sigmoid_focal_loss(inputs, targets), inputs, torch.ones(50, 9))
        torch.autograd.grad(mt.sigmoid_focal_loss(inputs, targets), inputs,
                            torch.ones(9, 50).t())
    assert shapes == [(), (), (50, 9), (50, 9)]


def test_sigmoid_focal_loss_compiles_without_a_graph_break():
    g = torch.Generator().manual_seed(6)
    inputs = torch.randn(6, 3, generator=g).requires_grad_(True)
    targets = (torch.rand(6, 3, generator=g) > 0.6).float()

    def loss(x, t):
        return mt.sigmoid_focal_loss(x, t, 0.25, 2, "sum") / 6

    compiled = torch.compile(loss, fullgraph=True)
    eager = loss(inputs, targets)
    got = compiled(inputs, targets)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(torch.autograd.grad(got, inputs)[0],
                               torch.autograd.grad(eager, inputs)[0])


@pytest.mark.parametrize("gamma", [0, 0.5, 0.9, 1, 2])
def test_sigmoid_focal_loss_of_saturated_logits_has_finite_gradients_for_any_gamma(gamma):
    """Where torchvision's 1 - p_t rounds to 0 (a logit of 20 or more the
    right way, in float32), pow's slope is infinite for gamma < 1 and its
    gradient NaN; ours is finite, the exact gradient's size (0.25 * 2e-9
    at most, at a logit of 20 and gamma 0, where torchvision's is 0), and
    the loss and the other gradients are torchvision's."""
    inputs = torch.tensor([[-100.0, -100, 100, 100, 20, 0.3]], requires_grad=True)
    targets = torch.tensor([[0.0, 1, 0, 1, 1, 1]])
    ours = mt.sigmoid_focal_loss(inputs, targets, 0.25, gamma)
    theirs = tv.sigmoid_focal_loss(inputs, targets, 0.25, gamma)
    torch.testing.assert_close(ours, theirs)
    (grad,) = torch.autograd.grad(ours.sum(), inputs)
    (their_grad,) = torch.autograd.grad(theirs.sum(), inputs)
    assert torch.isfinite(grad).all()
    saturated = torch.tensor([[True, False, False, True, True, False]])
    assert (grad[saturated].abs() <= 0.25 * 2.1e-9).all()
    torch.testing.assert_close(grad[~saturated], their_grad[~saturated])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_features_with_float32_boxes_run_in_float32_not_on_rounded_boxes(dtype):
    """Outside autocast, float32 (or integer) boxes beside 16-bit features
    are not rounded to 16 bits (1001.3 would be 1000 in bfloat16): the op
    runs in float32, as under autocast, the result and the gradient in the
    features' dtype."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(1, 8, 40, 1100, generator=g).to(dtype).requires_grad_(True)
    boxes = torch.tensor([[0, 1001.3, 5.2, 1013.7, 30.9], [0, 777.7, 3.3, 790.2, 20.1]])
    int_boxes = torch.tensor([[0, 1001, 5, 1013, 30], [0, 777, 3, 790, 20]])
    for op in (lambda x, b: mt.roi_align(x, b, 3, 1.0, 2, True), lambda x, b: mt.roi_pool(x, b, 3),
               lambda x, b: mt.ps_roi_align(x, b, 2, 1.0, 2),
               lambda x, b: mt.ps_roi_pool(x, b, 2)):
        for b in (boxes, int_boxes, [boxes[:, 1:]]):
            got = op(x, b)
            expected = op(x.detach().float(), b if isinstance(b, list) else b.float())
            assert got.dtype == dtype
            torch.testing.assert_close(got, expected.to(dtype), rtol=0, atol=0)
            (grad,) = torch.autograd.grad(got.float().sum(), x)
            assert grad.dtype == dtype and grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=dtype):
        torch.testing.assert_close(mt.roi_align(x, boxes, 3, 1.0, 2, True),
                                   mt.roi_align(x.detach().float(), boxes, 3, 1.0, 2,
                                                True).to(dtype), rtol=0, atol=0)


def test_meta_tensors_take_the_fake_implementations_as_torchvisions_meta_kernels():
    """Eager calls on meta tensors give the output shapes (no data), as
    torchvision's ops do on meta tensors."""
    x, rois = torch.rand(1, 2, 8, 8, device="meta"), torch.rand(3, 5, device="meta")
    out = mt.roi_align(x, rois, 2)
    assert out.device.type == "meta" and out.shape == tv.roi_align(x, rois, 2).shape
    assert mt.roi_pool(x, rois, 2).shape == (3, 2, 2, 2)
    offset = torch.rand(1, 18, 3, 3, device="meta")
    assert mt.deform_conv2d(torch.rand(1, 2, 5, 5, device="meta"), offset,
                            torch.rand(3, 2, 3, 3, device="meta")).shape == (1, 3, 3, 3)
    assert mt.box_iou(torch.rand(3, 4, device="meta"), torch.rand(2, 4, device="meta")).shape \
        == (3, 2)
    bf16 = torch.rand(1, 2, 8, 8, device="meta", dtype=torch.bfloat16)
    assert mt.roi_align(bf16, rois, 2).dtype == torch.bfloat16   # boxes of another dtype
    with pytest.raises(TypeError, match="no data"):   # not uninitialised memory on the CPU
        mt.roi_align(torch.rand(1, 2, 8, 8), rois, 2)


def test_modules_are_torchvisions():
    x, rois = feature_map(), [random_boxes(3, 40, seed=12)]
    ours, theirs = mt.RoIAlign((2, 3), 0.5, 2, True), tv.RoIAlign((2, 3), 0.5, 2, True)
    torch.testing.assert_close(ours(x, rois), theirs(x, rois))
    assert repr(ours) == repr(theirs)
    ours, theirs = mt.RoIPool(2, 0.5), tv.RoIPool(2, 0.5)
    torch.testing.assert_close(ours(x, rois), theirs(x, rois))
    assert repr(ours) == repr(theirs)


@pytest.mark.parametrize("strided", [False, True])
def test_gradcheck_in_float64_on_contiguous_and_strided_inputs(strided):
    base = feature_map(dtype=torch.float64, shape=(2, 3, 8, 16 if strided else 8))
    base.requires_grad_(True)
    rois = torch.tensor([[0, 0.5, 0.5, 5, 6], [1, 1, 1, 6, 5], [0, 2.2, 1, 7, 7.5]],
                        dtype=torch.float64)

    def view(x):
        return x[..., ::2] if strided else x

    assert torch.autograd.gradcheck(lambda x: mt.roi_align(view(x), rois, 2, 1.0, 2, True),
                                    (base,))
    assert torch.autograd.gradcheck(lambda x: mt.roi_align(view(x), rois, 2, 1.0, -1, False),
                                    (base,))
    assert torch.autograd.gradcheck(lambda x: mt.roi_pool(view(x), rois, 2, 1.0), (base,))


@needs_data_dependent_tracing
@pytest.mark.parametrize("name, function, args", [
    ("RoIAlign", "roi_align", (2, 0.5, 2, True)), ("RoIPool", "roi_pool", (2, 0.5)),
    ("PSRoIAlign", "ps_roi_align", (2, 0.5, 2)), ("PSRoIPool", "ps_roi_pool", (2, 0.5))])
def test_torch_fx_traces_the_roi_modules_with_their_function_as_a_leaf(name, function, args):
    """torch.fx.symbolic_trace (torchvision's create_feature_extractor
    traces so) of the modules: their function is one call in the graph, as
    torchvision's modules trace (its argument checks would meet fx's
    proxies), and the traced module gives the module's values."""
    x = torch.rand(1, 4, 8, 8)
    rois = torch.tensor([[0, 1.0, 1, 6, 6], [0, 0, 2, 7, 5]])
    module = getattr(mt, name)(*args)
    traced = torch.fx.symbolic_trace(module)
    calls = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert calls == [getattr(mt, function)]
    torch.testing.assert_close(traced(x, rois), module(x, rois), rtol=0, atol=0)


def test_compiled_function_with_roi_align_nms_and_box_iou_has_no_graph_break():
    def detect(x, boxes, scores):
        pooled = mt.roi_align(x, [boxes], 3, 0.5, 2, True)
        keep = mt.nms(boxes, scores, 0.5)
        return pooled.sum(dim=(1, 2, 3)), keep, mt.box_iou(boxes[keep], boxes)

    x = feature_map()
    boxes = random_boxes(30, 40, seed=13)
    scores = torch.rand(30, generator=torch.Generator().manual_seed(14))
    compiled = torch.compile(detect, fullgraph=True, dynamic=False)
    for got, expected in zip(compiled(x, boxes, scores), detect(x, boxes, scores)):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("call, message", [
    (lambda x: mt.roi_align(x, torch.zeros(3, 4), 2), "roi_align: boxes must be a Tensor[K, 5]"),
    (lambda x: mt.roi_align(x, [torch.zeros(3, 5)], 2), "roi_align: boxes[0] must be a "
                                                        "Tensor[L, 4]"),
    (lambda x: mt.roi_align(x, "boxes", 2), "roi_align: boxes must be a Tensor[K, 5]"),
    (lambda x: mt.roi_align(x, [torch.zeros(1, 4)], "2"), "roi_align: output_size must be"),
    (lambda x: mt.roi_align(x[0], [torch.zeros(1, 4)], 2), "roi_align_forward_impl: input must "
                                                           "have shape"),
    (lambda x: mt.roi_pool(x, torch.tensor([[9.0, 0, 0, 1, 1]]), 2),
     "roi_pool_forward_impl: rois[0, 0] (batch index) must be an integer in [0, 2)"),
    (lambda x: mt.nms(torch.zeros(3, 5), torch.zeros(3), 0.5), "nms_impl: boxes must have shape"),
])
def test_bad_input_gets_a_clear_error_naming_the_op(call, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        call(feature_map())


def detector_run(roi_align, batched_nms, steps=3, device="cpu"):
    """A small two-stage head (a conv backbone level pair, torchvision's
    MultiScaleRoIAlign, TwoMLPHead and FastRCNNPredictor, cross entropy and
    smooth L1 losses) trained for a few steps with the given roi_align, then
    post-processed with the given batched_nms. Returns the losses, the
    gradients of the last step and the kept detections."""
    from unittest import mock

    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.ops import MultiScaleRoIAlign

    torch.manual_seed(0)
    backbone = torch.nn.ModuleDict({"0": torch.nn.Conv2d(3, 16, 3, stride=4, padding=1),
                                    "1": torch.nn.Conv2d(3, 16, 3, stride=8, padding=1)})
    head, predictor = TwoMLPHead(16 * 7 * 7, 64), FastRCNNPredictor(64, 5)
    for module in (backbone, head, predictor):
        module.to(device)
    pooler = MultiScaleRoIAlign(["0", "1"], 7, 2)
    params = [*backbone.parameters(), *head.parameters(), *predictor.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)
    images = torch.randn(2, 3, 128, 128).to(device)
    proposals = [random_boxes(24, 120, seed=20 + i).to(device) for i in range(2)]
    labels = torch.randint(0, 5, (48,)).to(device)
    targets = torch.randn(48, 4).to(device)
    losses = []
    with mock.patch("torchvision.ops.poolers.roi_align", roi_align):
        for _ in range(steps):
            features = {name: layer(images) for name, layer in backbone.items()}
            pooled = pooler(features, proposals, [(128, 128)] * 2)
            logits, deltas = predictor(head(pooled))
            picked = deltas.reshape(48, 5, 4)[torch.arange(48, device=device), labels]
            loss = (torch.nn.functional.cross_entropy(logits, labels)
                    + torch.nn.functional.smooth_l1_loss(picked, targets))
            optimizer.zero_grad()
            loss.backward()
            losses.append(loss.item())
            gradients = [p.grad.clone() for p in params]
            optimizer.step()
        with torch.no_grad():
            features = {name: layer(images) for name, layer in backbone.items()}
            logits, _ = predictor(head(pooler(features, proposals, [(128, 128)] * 2)))
    scores, classes = logits.softmax(-1).max(-1)
    keep = batched_nms(torch.cat(proposals), scores, classes, 0.5)
    return losses, gradients, keep


def test_a_two_stage_head_trains_the_same_with_our_ops_as_with_torchvisions():
    ours = detector_run(mt.roi_align, mt.batched_nms)
    theirs = detector_run(tv.roi_align, tv.batched_nms)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-4, atol=1e-4)
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours[2], theirs[2])


def test_a_two_stage_head_trains_the_same_on_cuda(torch_cuda):
    ours = detector_run(mt.roi_align, mt.batched_nms, device="cuda")
    theirs = detector_run(tv.roi_align, tv.batched_nms, device="cuda")
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-4, atol=1e-4)
    for a, b in zip(ours[1], theirs[1]):   # atomics on both sides: not bit for bit
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours[2], theirs[2])


def test_cuda_deform_conv2d_takes_tf32_products_where_torch_lets_torchvisions(torch_cuda):
    """Under torch.set_float32_matmul_precision("high") torchvision's
    deform_conv2d products run in TF32 on devices of compute capability
    8.0 and later, and ours do too (cuBLAS's TF32 math): both then differ
    from the float64 result by TF32's error, far above float32's; under
    "highest" ours are IEEE float32."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, 20, 20, generator=g)
    offset = torch.randn(2, 18, 20, 20, generator=g)
    weight = torch.randn(32, 64, 3, 3, generator=g) / 24
    mask = torch.rand(2, 9, 20, 20, generator=g)
    reference = mt.deform_conv2d(x.double().cuda(), offset.double().cuda(),
                                 weight.double().cuda(), padding=(1, 1),
                                 mask=mask.double().cuda())
    scale = reference.abs().max()

    def error(deform_conv2d, precision):
        torch.set_float32_matmul_precision(precision)
        try:
            out = deform_conv2d(x.cuda(), offset.cuda(), weight.cuda(), padding=(1, 1),
                                mask=mask.cuda())
        finally:
            torch.set_float32_matmul_precision("highest")
        return float((out.double() - reference).abs().max() / scale)

    ieee, ours, theirs = (error(mt.deform_conv2d, "highest"), error(mt.deform_conv2d, "high"),
                          error(tv.deform_conv2d, "high"))
    assert ieee < 1e-5
    if torch.cuda.get_device_capability()[0] >= 8:
        assert ours > 10 * ieee and theirs > 10 * ieee, (ieee, ours, theirs)
        assert ours < 5e-3 and theirs < 5e-3, (ours, theirs)
    else:
        assert ours < 1e-5


def test_cuda_backward_is_bit_for_bit_under_torchs_deterministic_mode(torch_cuda):
    x = feature_map().cuda().requires_grad_(True)
    rois = [random_boxes(300, 40, seed=30).cuda()]   # many rois over one small map
    torch.use_deterministic_algorithms(True)
    try:
        grads = [torch.autograd.grad(mt.roi_align(x, rois, 7, 0.5, 0, True).sum(), x)[0]
                 for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(g, grads[0]) for g in grads)
    expected = torch.autograd.grad(tv.roi_align(x.cpu(), [r.cpu() for r in rois], 7, 0.5, 0,
                                                True).sum(), x)[0]
    torch.testing.assert_close(grads[0].cpu(), expected.cpu(), rtol=1e-4, atol=1e-4)



def _under_autocast(roi_align, roi_pool, nms, device, dtype):
    """roi_align, roi_pool and nms inside torch.autocast, on features from a
    convolution (so in `dtype`) and float32 boxes: their values, and the
    gradient of the pooled values with respect to the convolution's input."""
    torch.manual_seed(3)
    conv = torch.nn.Conv2d(8, 8, 3, padding=1).to(device)
    x = feature_map().to(device).requires_grad_(True)
    boxes = [random_boxes(9, 20, seed=4).to(device), random_boxes(4, 20, seed=5).to(device)]
    scores = torch.rand(9, generator=torch.Generator().manual_seed(6)).to(device)
    with torch.autocast(device, dtype=dtype):
        features = conv(x)
        aligned = roi_align(features, boxes, 5, 0.5, 2, True)
        pooled = roi_pool(features, boxes, 3, 0.5)
        keep = nms(boxes[0].to(dtype), scores, 0.3)
    (grad,) = torch.autograd.grad(aligned.float().sum() + pooled.float().sum(), x)
    return aligned, pooled, keep, grad


def _roi_pool_in_float32(features, boxes, output_size, spatial_scale):
    """torchvision's roi_pool as its autocast kernel would run it: in float32,
    the result in the features' dtype (torchvision has no CPU autocast
    kernel for roi_pool)."""
    return tv.roi_pool(features.float(), [b.float() for b in boxes], output_size,
                       spatial_scale).to(features.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_ops_run_in_float32_and_answer_in_the_features_dtype(dtype):
    """As torchvision's autocast kernels: 16-bit features and float32 boxes
    are computed in float32 (boxes keep their precision), the result is in
    the features' dtype, and gradients flow through the casts: the same
    bits as torchvision."""
    ours = _under_autocast(mt.roi_align, mt.roi_pool, mt.nms, "cpu", dtype)
    theirs = _under_autocast(tv.roi_align, _roi_pool_in_float32, tv.nms, "cpu", dtype)
    assert ours[0].dtype == ours[1].dtype == dtype and ours[2].dtype == torch.int64
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_cuda_autocast_ops_match_torchvisions(torch_cuda, dtype):
    ours = _under_autocast(mt.roi_align, mt.roi_pool, mt.nms, "cuda", dtype)
    theirs = _under_autocast(tv.roi_align, tv.roi_pool, tv.nms, "cuda", dtype)
    assert ours[0].dtype == ours[1].dtype == dtype
    for a, b in zip(ours[:3], theirs[:3]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(ours[3], theirs[3], rtol=1e-3, atol=1e-3)   # atomics


def torchvision_box_iou_takes(boxes, fmt):
    """Whether this torchvision's box_iou takes `fmt` on boxes of that shape
    (0.19 has no fmt at all, 0.26 no 'cxcywhr'; 0.29, CI's, takes both and
    leading dimensions): ours is compared with it only where it does."""
    try:
        tv.box_iou(boxes, boxes, fmt=fmt)
    except (TypeError, ValueError, RuntimeError, IndexError):
        return False
    return True


needs_box_iou_formats = pytest.mark.skipif(
    not torchvision_box_iou_takes(torch.ones(2, 1, 4), "xywh"),
    reason=f"torchvision {torchvision.__version__}'s box_iou has no fmt or leading dimensions "
           f"to compare with")
needs_rotated_box_iou = pytest.mark.skipif(
    not torchvision_box_iou_takes(torch.ones(1, 5), "cxcywhr"),
    reason=f"torchvision {torchvision.__version__}'s box_iou has no fmt 'cxcywhr' to compare with")


# --- found by a differential review against torchvision 0.29 ------------------------------

@needs_box_iou_formats
@pytest.mark.parametrize("fmt", ["xyxy", "xywh", "cxcywh"])
def test_box_iou_takes_torchvisions_formats_and_leading_dimensions(fmt):
    gen = torch.Generator().manual_seed(4)
    a = torch.rand(6, 4, generator=gen) * 20
    b = torch.rand(5, 4, generator=gen) * 20
    a[:, 2:] += 1
    b[:, 2:] += 1
    torch.testing.assert_close(mt.box_iou(a, b, fmt=fmt), tv.box_iou(a, b, fmt=fmt))
    batched = a[None].expand(3, 6, 4)
    torch.testing.assert_close(mt.box_iou(batched, b, fmt=fmt), tv.box_iou(batched, b, fmt=fmt))


@needs_rotated_box_iou
def test_box_iou_of_rotated_boxes_in_degrees_counter_clockwise_is_torchvisions():
    gen = torch.Generator().manual_seed(5)
    r1 = torch.cat([torch.rand(6, 2, generator=gen) * 20, torch.rand(6, 2, generator=gen) * 9 + 1,
                    torch.rand(6, 1, generator=gen) * 180 - 90], 1)
    r2 = torch.cat([torch.rand(5, 2, generator=gen) * 20, torch.rand(5, 2, generator=gen) * 9 + 1,
                    torch.rand(5, 1, generator=gen) * 180 - 90], 1)
    torch.testing.assert_close(mt.box_iou(r1, r2, fmt="cxcywhr"),
                               tv.box_iou(r1, r2, fmt="cxcywhr"), rtol=1e-5, atol=1e-6)


def test_box_iou_result_dtype_is_torchvisions():
    a = torch.tensor([[0.0, 0, 10, 10]])
    b = torch.tensor([[1.0, 1, 11, 11]])
    for x, y in ((a, b.double()), (a.half(), b.half()), (a.bfloat16(), b), (a.int(), b.int())):
        assert mt.box_iou(x, y).dtype == tv.box_iou(x, y).dtype


@needs_rotated_box_iou
def test_rotated_box_iou_result_dtype_is_torchvisions():
    r = torch.tensor([[5.0, 5, 4, 2, 30]], dtype=torch.float64)
    assert mt.box_iou(r, r, fmt="cxcywhr").dtype == tv.box_iou(r, r, fmt="cxcywhr").dtype


@needs_box_iou_formats
def test_box_iou_of_an_empty_batch_is_empty():
    a, b = torch.zeros(0, 3, 4), torch.zeros(0, 2, 4)
    got, want = mt.box_iou(a, b), tv.box_iou(a, b)
    assert got.shape == want.shape == (0, 3, 2) and got.dtype == want.dtype
    # torchvision's rotated op takes no leading dimensions; ours do
    rotated = mt.box_iou(torch.zeros(0, 3, 5, dtype=torch.float64), torch.zeros(0, 2, 5),
                         fmt="cxcywhr")
    assert rotated.shape == (0, 3, 2) and rotated.dtype == torch.float32


def test_box_iou_of_a_zero_union_has_a_zero_gradient_not_nan():
    p = torch.tensor([[3.0, 3, 3, 3]], requires_grad=True)
    value = mt.box_iou(p, p)
    value.sum().backward()
    assert value.item() == 0 and (p.grad == 0).all()


def test_nms_of_two_dtypes_computes_in_the_wider():
    boxes = torch.tensor([[0.0, 0, 10, 10]] * 2).half()
    scores = torch.tensor([0.90001, 0.90002])
    assert mt.nms(boxes, scores, 0.5).tolist() == [1]   # float16 scores would tie: [0]


def test_sigmoid_focal_loss_refuses_alpha_outside_0_1_as_torchvision():
    for alpha in (-0.5, 1.5, -2):
        with pytest.raises(ValueError, match="sigmoid_focal_loss: alpha must be in"):
            mt.sigmoid_focal_loss(torch.zeros(3), torch.zeros(3), alpha=alpha)
    for alpha in (-1, 0, 1):
        mt.sigmoid_focal_loss(torch.zeros(3), torch.zeros(3), alpha=alpha)


def test_sizes_take_numpy_integers_and_a_numpy_input_is_a_clear_error():
    x = torch.randn(1, 1, 8, 8)
    rois = torch.tensor([[0, 1.0, 1, 5, 5]])
    assert mt.roi_align(x, rois, np.int64(3)).shape == (1, 1, 3, 3)
    assert mt.RoIPool((np.int32(2), 3), 1.0)(x, rois).shape == (1, 1, 2, 3)
    assert mt.DeformConv2d(1, 2, np.int64(3), padding=np.int64(1)).kernel_size == (3, 3)
    with pytest.raises(TypeError, match="output_size must be an int or a pair of ints"):
        mt.roi_align(x, rois, 2.5)
    with pytest.raises(TypeError, match="roi_align: input must be a torch.Tensor, got ndarray"):
        mt.roi_align(x.numpy(), rois, 2)


def test_psroipool_is_not_a_roipool_as_in_torchvision():
    assert not isinstance(mt.PSRoIPool(3, 1.0), mt.RoIPool)
    assert not isinstance(tv.PSRoIPool(3, 1.0), tv.RoIPool)
    assert repr(mt.PSRoIPool(3, 1.0)) == repr(tv.PSRoIPool(3, 1.0))


@needs_data_dependent_tracing
def test_a_module_of_our_ops_exports_with_torch_export_and_runs_the_same():
    """torch.export (torch.jit.script's successor, which torch 2.14 deprecates;
    our functions do not script) traces the ops through their fake kernels."""
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dcn = mt.DeformConv2d(8, 8, 3, padding=1)
            self.pool = mt.RoIAlign(7, 0.25, 2, aligned=True)

        def forward(self, x, rois, offset):
            return self.pool(self.dcn(x, offset), rois), mt.nms(rois[:, 1:], rois[:, 1], 0.5)

    torch.manual_seed(0)
    head = Head()
    x, offset = torch.randn(2, 8, 32, 32), torch.randn(2, 18, 32, 32)
    rois = torch.tensor([[0, 1.0, 1, 20, 20], [1, 3, 3, 30, 25], [0, 2, 2, 21, 21]])
    exported = torch.export.export(head, (x, rois, offset))
    got, want = exported.module()(x, rois, offset), head(x, rois, offset)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_nms_ranks_a_nan_score_first_as_torchvision():
    """torchvision's sort puts a NaN score first, so that box is kept and
    suppresses others; mmdispatch.ops.nms ranks it last, the torch layer
    follows torchvision."""
    boxes = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 10.5], [20, 20, 30, 30]])
    scores = torch.tensor([float("nan"), 0.9, 0.5])
    assert mt.nms(boxes, scores, 0.5).tolist() == tv.nms(boxes, scores, 0.5).tolist() == [0, 2]
    idxs = torch.tensor([0, 0, 1])
    assert (mt.batched_nms(boxes, scores, idxs, 0.5).tolist()
            == tv.batched_nms(boxes, scores, idxs, 0.5).tolist())
    import mmdispatch.ops
    assert mmdispatch.ops.nms(boxes.numpy(), scores.numpy(), 0.5).tolist() == [1, 2]
    with pytest.raises(TypeError, match="nms_impl: boxes has dtype int64"):   # not a NaN trap
        mt.nms(torch.tensor([[0, 0, 10, 10]]), torch.tensor([3]), 0.5)


def test_nms_takes_a_nan_score_as_inf_so_that_it_ties_with_an_inf_score_by_index():
    """The documented difference: torchvision ranks NaN above +inf, our
    torch layer takes NaN as +inf (the kernels rank NaN last, and no
    value of the scores' dtype lies above +inf), so the two tie and the
    lower index goes first. Without a +inf score the NaN ranks first as
    in torchvision (the test above)."""
    boxes = torch.tensor([[0.0, 0, 1, 1], [0, 0, 1, 1], [5, 5, 6, 6]])
    scores = torch.tensor([float("inf"), float("nan"), 0.5])
    assert mt.nms(boxes, scores, 0.5).tolist() == [0, 2]
    assert tv.nms(boxes, scores, 0.5).tolist() == [1, 2]


def test_batched_nms_keeps_each_distinct_floating_category_apart_as_torchvision():
    """Floating idxs are categories by value: 0.0 and 0.5 stay apart (as
    in torchvision's loop over torch.unique(idxs)), -0.0 is 0.0; an
    integer conversion merged 0.5 into 0."""
    boxes = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10]])
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6])
    for idxs, expected in ((torch.tensor([0.0, 0.5, -0.0, 0.5]), [0, 1]),
                           (torch.tensor([1.0, 2.0, 1.0, 3.0], dtype=torch.float16), [0, 1, 3]),
                           (torch.tensor([0, 1, 0, 1]), [0, 1])):
        got = mt.batched_nms(boxes, scores, idxs, 0.5).tolist()
        assert got == expected
        assert got == tv.batched_nms(boxes, scores, idxs, 0.5).tolist()


def multiscale_pair(names, output_size=7, sampling_ratio=2):
    return (mt.MultiScaleRoIAlign(names, output_size, sampling_ratio),
            tv.MultiScaleRoIAlign(names, output_size, sampling_ratio))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_multiscale_roi_align_matches_torchvision_in_value_and_gradient(request, dtype, device):
    if device == "cuda":
        request.getfixturevalue("torch_cuda")
    names = ["0", "1", "2", "3"]
    x = {k: v.requires_grad_(True) for k, v in fpn_features(dtype=dtype, device=device).items()}
    boxes = [boxes_of_every_level(0, dtype=dtype, device=device),
             boxes_of_every_level(450, seed=42, dtype=dtype, device=device)]
    shapes = [(120, 150), (128, 160)]
    results = []
    for pooler in multiscale_pair(names):
        out = pooler(x, boxes, shapes)
        weight = torch.linspace(-1, 1, out.numel(), dtype=dtype, device=device).view(out.shape)
        grads = torch.autograd.grad((out * weight).sum(), [x[k] for k in names])
        results.append((out, grads, pooler.scales))
    (ours, our_grads, our_scales), (theirs, their_grads, their_scales) = results
    assert our_scales == their_scales == [1 / 4, 1 / 8, 1 / 16, 1 / 32]
    assert ours.shape == (450, 8, 7, 7) and ours.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
    for a, b in zip(our_grads, their_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_multiscale_roi_align_pools_each_box_from_its_fpn_level_exactly():
    """Each row is our roi_align of that box on the map torchvision's level
    mapper picks (eq. 1 of the FPN paper, clamped to the maps there are),
    bit for bit; every level, and both clamps, are used."""
    names = ["0", "1", "2", "3"]
    x = fpn_features()
    boxes = [boxes_of_every_level(400), boxes_of_every_level(100, seed=43)]
    shapes = [(128, 160), (128, 160)]
    ours, theirs = multiscale_pair(names, (5, 4), 0)
    out = ours(x, boxes, shapes)
    theirs(x, boxes, shapes)
    levels = theirs.map_levels(boxes)
    assert torch.equal(ours.map_levels(boxes), levels)
    assert torch.bincount(levels, minlength=4).min() > 0
    rois = torch.cat([torch.cat([torch.full((len(b), 1), float(i)), b], 1)
                      for i, b in enumerate(boxes)])
    for level, name in enumerate(names):
        rows = (levels == level).nonzero()[:, 0]
        expected = mt.roi_align(x[name], rois[rows], (5, 4), 2.0 ** -(level + 2), 0)
        assert torch.equal(out[rows], expected)


def test_multiscale_roi_align_of_one_map_or_a_skipped_level_is_torchvisions():
    """One map: a plain roi_align at its scale. Maps "0" and "2" only (strides
    4 and 16): the levels run from 2 to 4 and pair with the maps by
    position, as torchvision pairs them, so the boxes of level 4, past the
    last map, are zeros."""
    x = fpn_features()
    boxes = [boxes_of_every_level(200), boxes_of_every_level(50, seed=44)]
    shapes = [(128, 160)] * 2
    for names in (["1"], ["0", "2"]):
        ours, theirs = multiscale_pair(names)
        torch.testing.assert_close(ours(x, boxes, shapes), theirs(x, boxes, shapes),
                                   rtol=1e-5, atol=1e-5)
    levels = theirs.map_levels(boxes)
    skipped = ours(x, boxes, shapes)[levels == 2]
    assert len(skipped) and not skipped.any()


def test_multiscale_roi_align_keeps_the_scales_of_its_first_call_as_torchvision():
    x = fpn_features()
    boxes = [boxes_of_every_level(60)]
    ours, theirs = multiscale_pair(["0", "1", "2"])
    for pooler in (ours, theirs):
        pooler(x, boxes, [(128, 160)])
        first = list(pooler.scales)
        pooler(x, boxes, [(512, 640)])     # kept: the maps are those of 128 x 160 images
        assert pooler.scales == first == [1 / 4, 1 / 8, 1 / 16]
        pooler.scales = None               # and inferred again when cleared
        pooler(x, boxes, [(512, 640)])
        assert pooler.scales == [1 / 16, 1 / 32, 1 / 64]
    torch.testing.assert_close(ours(x, boxes, [(512, 640)]), theirs(x, boxes, [(512, 640)]),
                               rtol=1e-5, atol=1e-5)
    assert repr(ours) == repr(theirs)
    assert mt.MultiScaleRoIAlign(["0"], [3, 5], 2).output_size == (3, 5)


@pytest.mark.parametrize("call, message", [
    (lambda p, x, b: p(x, b, []), "MultiScaleRoIAlign: image_shapes"),
    (lambda p, x, b: p({"a": x["0"]}, b, [(128, 160)]), "MultiScaleRoIAlign: none of featmap"),
    (lambda p, x, b: p({"0": x["0"], "1": x["1"][:, :3]}, b, [(128, 160)]),
     "MultiScaleRoIAlign: the feature maps must be (N, C, H, W) of one C"),
    (lambda p, x, b: p(x, b[0], [(128, 160)]), "MultiScaleRoIAlign: boxes must be a list"),
    (lambda p, x, b: p(x, [b[0][:, :3]], [(128, 160)]), "MultiScaleRoIAlign: boxes[0] must be"),
    (lambda p, x, b: p({"0": x["0"][..., :0, :], "1": x["1"]}, b, [(128, 160)]),
     "MultiScaleRoIAlign: a feature map of shape (2, 8, 0, 40) has no scale"),
])
def test_multiscale_roi_align_bad_input_gets_a_clear_error(call, message):
    pooler = mt.MultiScaleRoIAlign(["0", "1"], 7, 2)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        call(pooler, fpn_features(), [boxes_of_every_level(5)])


def test_every_name_of_torchvision_ops_is_reachable_ours_or_torchvisions_own():
    """`import mmdispatch.torch as ops` in place of `from torchvision import
    ops`: the ops with kernels are ours, the rest (box_area,
    clip_boxes_to_image, FeaturePyramidNetwork: torch code) torchvision's."""
    ours = {"roi_align", "roi_pool", "ps_roi_align", "ps_roi_pool", "nms", "batched_nms",
            "box_iou", "deform_conv2d", "sigmoid_focal_loss", "RoIAlign", "RoIPool",
            "PSRoIAlign", "PSRoIPool", "DeformConv2d", "MultiScaleRoIAlign"}
    assert set(tv.__all__) - ours == mt._TORCHVISION_OWN
    for name in tv.__all__:
        value = getattr(mt, name)
        if name in ours:
            assert value is not getattr(tv, name) and value.__module__.startswith("mmdispatch")
        else:
            assert value is getattr(tv, name)
    from mmdispatch.torch import clip_boxes_to_image, generalized_box_iou  # noqa: F401
    boxes = random_boxes(6, 30)
    torch.testing.assert_close(mt.box_area(boxes), tv.box_area(boxes))
    with pytest.raises(AttributeError, match="has no attribute 'roi_algin'"):
        mt.roi_algin
    with pytest.raises(ImportError):
        from mmdispatch.torch import _no_such_name  # noqa: F401


def test_torchvisions_other_names_without_torchvision_say_it_is_not_installed(tmp_path):
    import subprocess
    import sys
    code = ("import sys; sys.modules['torchvision'] = None; import mmdispatch.torch as mt\n"
            "try:\n    mt.box_area\nexcept AttributeError as e:\n"
            "    assert 'torchvision is not usable here' in str(e), e\n"
            "else:\n    raise SystemExit('no error')\n"
            "try:\n    mt.roi_algin\nexcept AttributeError as e:\n"
            "    assert 'torchvision' not in str(e), e\n"
            "assert mt.roi_align is not None")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)   # not the source tree


def test_multiscale_roi_align_is_torchvisions_subclass_made_without_importing_torchvision(
        tmp_path):
    """A subclass of torchvision's MultiScaleRoIAlign (its detection models
    refuse any other pooler), made when first asked for: importing
    mmdispatch.torch does not import torchvision. Without torchvision it
    is an nn.Module that pools the same."""
    import subprocess
    import sys
    code = ("import sys, mmdispatch.torch as mt; assert 'torchvision' not in sys.modules; "
            "assert 'MultiScaleRoIAlign' in dir(mt) and 'MultiScaleRoIAlign' in mt.__all__; "
            "assert not hasattr(mt, 'no_such_name') and 'torchvision' not in sys.modules; "
            "import torchvision; "
            "assert issubclass(mt.MultiScaleRoIAlign, torchvision.ops.MultiScaleRoIAlign)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)   # not the source tree
    from mmdispatch.torch import _vision
    assert mt.MultiScaleRoIAlign.__module__ == "mmdispatch.torch"
    plain = _vision.multiscale_roi_align_class(torch.nn.Module)
    assert not issubclass(plain, tv.MultiScaleRoIAlign)
    x, boxes = fpn_features(), [boxes_of_every_level(80)]
    assert torch.equal(plain(["0", "1", "2"], 5, 2)(x, boxes, [(128, 160)]),
                       mt.MultiScaleRoIAlign(["0", "1", "2"], 5, 2)(x, boxes, [(128, 160)]))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torchvisions_mask_rcnn_with_our_poolers_trains_and_detects_as_with_its_own(request,
                                                                                 device):
    """Swapping torchvision's MultiScaleRoIAlign for ours in a torchvision
    Mask R-CNN (box_roi_pool and mask_roi_pool): the same losses, gradients
    and detections, within 1e-4."""
    if device == "cuda":
        request.getfixturevalue("torch_cuda")
    ours, theirs = (mask_rcnn_run(p, device) for p in (mt.MultiScaleRoIAlign,
                                                        tv.MultiScaleRoIAlign))
    assert_same_run(ours, theirs)


def test_multiscale_roi_align_gives_every_map_a_gradient_even_without_boxes():
    """As torchvision's: every level is pooled, so a map no box pooled from
    gets a zero gradient (not None), and no boxes at all still give an
    output that autograd can go back through."""
    x = {k: v.requires_grad_(True) for k, v in fpn_features().items()}
    names = ["0", "1", "2", "3"]
    small = boxes_of_every_level(50, seed=45).clamp(0, 60)   # none reaches levels 4 and 5
    for boxes in ([small, small[:0]], [small[:0], small[:0]]):
        results = []
        for pooler in multiscale_pair(names):
            out = pooler(x, boxes, [(128, 160)] * 2)
            assert out.requires_grad
            results.append(torch.autograd.grad(out.sum(), [x[k] for k in names]))
        for ours, theirs in zip(*results):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        assert not results[0][3].any()


def test_multiscale_roi_align_eager_result_and_gradients_are_those_of_torchs_index_copy():
    """In eager code the levels' rows go into an uninitialised result and
    backward hands each level its rows of the gradient (_LevelRows): the
    same bits as index_copy_ into zeros (the pooler's path under tracing
    and torch.compile), for every map and for maps that need no gradient;
    rows of a level past the last map are 0 even where the result's memory
    held NaN before."""
    from mmdispatch.torch import _vision
    x = fpn_features()
    boxes = [boxes_of_every_level(40, seed=50), boxes_of_every_level(25, seed=51)]
    shapes = [(128, 160)] * 2

    def index_copy_result(pooler, maps):
        rois = _vision.rois_of("test", boxes, maps["0"])
        levels = pooler.map_levels([rois[:, 1:]])
        result = maps["0"].new_zeros((len(rois), 8, 5, 5))
        for level, (name, scale) in enumerate(zip(pooler.featmap_names, pooler.scales)):
            index = torch.where(levels == level)[0]
            result.index_copy_(0, index, mt.roi_align(maps[name], rois[index], 5, scale, 2))
        return result

    for names, grad_names in ((["0", "1", "2", "3"], ["0", "1", "2", "3"]),
                              (["0", "1", "2", "3"], ["1", "3"]), (["0", "2"], ["0", "2"])):
        pooler = mt.MultiScaleRoIAlign(names, 5, 2)
        runs = []
        for path in ("eager", "index_copy"):
            maps = {k: v.clone().requires_grad_(k in grad_names) for k, v in x.items()}
            if path == "eager":
                torch.full((65, 8, 5, 5), math.nan)   # memory the result may take next
                out = pooler(maps, boxes, shapes)
                assert type(out.grad_fn).__name__ == "_LevelRowsBackward"
            else:
                out = index_copy_result(pooler, maps)
            weight = torch.linspace(-1, 1, out.numel()).view(out.shape)
            grads = torch.autograd.grad((out * weight).sum(), [maps[k] for k in grad_names])
            runs.append((out, grads))
        (out, grads), (expected, expected_grads) = runs
        assert torch.equal(out, expected)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))
        if names == ["0", "2"]:   # levels 2 to 4 on two maps: the boxes of level 4 get zeros
            past = pooler.map_levels(boxes) == 2
            assert past.any() and not out[past].any()


@needs_data_dependent_tracing
def test_multiscale_roi_align_traces_compiles_and_scripts_as_torchvisions():
    """torch.jit.trace records the per-level selection (a trace made on one
    set of boxes gives the eager result on another); torch.compile with
    fullgraph=True takes it; torch.jit.script takes torchvision's pooler
    in its place, with the same settings and scales."""
    names = ["0", "1", "2", "3"]
    x = fpn_features()
    first = [boxes_of_every_level(60, seed=46), boxes_of_every_level(30, seed=47)]
    second = [boxes_of_every_level(9, seed=48), boxes_of_every_level(70, seed=49)]
    shapes = [(128, 160)] * 2
    pooler = mt.MultiScaleRoIAlign(names, 5, 2)
    eager = [pooler(x, boxes, shapes) for boxes in (first, second)]
    traced = torch.jit.trace(lambda x, boxes: pooler(x, boxes, shapes), (x, first),
                             check_trace=False, strict=False)
    for boxes, expected in zip((first, second), eager):
        assert torch.equal(traced(x, boxes), expected)
    compiled = torch.compile(pooler, fullgraph=True)
    for boxes, expected in zip((first, second), eager):
        assert torch.equal(compiled(x, boxes, shapes), expected)
    scripted = torch.jit.script(pooler)
    assert scripted.original_name == "MultiScaleRoIAlign" and scripted.scales == pooler.scales
    torch.testing.assert_close(scripted(x, second, shapes), eager[1], rtol=1e-5, atol=1e-5)
