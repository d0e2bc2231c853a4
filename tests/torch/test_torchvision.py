"""replace_torchvision_kernels: torchvision's own ops (its functions,
modules, detection models and compiled graphs) run on our kernels while
the registration is active, with mmdispatch.torch's results, and on
torchvision's kernels again after restore()."""
import re

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the test extra has it)")
torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")

import mmdispatch  # noqa: E402
import mmdispatch.torch as mt  # noqa: E402
from torch_models import assert_same_run, mask_rcnn_run, needs_data_dependent_tracing  # noqa: E402
from torchvision import ops as tv  # noqa: E402


def inputs(dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 18, 24, 20, generator=g, dtype=dtype)
    boxes = torch.rand(12, 4, generator=g, dtype=dtype) * 15
    boxes[:, 2:] += boxes[:, :2] + 1
    rois = torch.cat([torch.tensor([0.0, 1] * 6, dtype=dtype)[:, None], boxes], 1)
    weight = torch.randn(4, 18, 3, 3, generator=g, dtype=dtype)
    offset = torch.randn(2, 18, 22, 18, generator=g, dtype=dtype)
    mask = torch.rand(2, 9, 22, 18, generator=g, dtype=dtype)
    scores = torch.rand(12, generator=g, dtype=dtype)
    return [t.to(device) for t in (x, rois, boxes, scores, weight, offset, mask)]


def torchvision_calls(library, dtype=torch.float64, device="cpu"):
    """Each op of `library` (torchvision.ops or mmdispatch.torch) on the same
    inputs: {name: (output, gradient of the input map)}, and nms's keep."""
    x, rois, boxes, scores, weight, offset, mask = inputs(dtype, device)
    calls = {
        "roi_align": lambda x: library.roi_align(x, rois, 3, 0.5, 2, True),
        "roi_align sr=0": lambda x: library.roi_align(x, rois, (3, 2), 0.5, 0, False),
        "roi_pool": lambda x: library.roi_pool(x, rois, 3, 0.5),
        "ps_roi_align": lambda x: library.ps_roi_align(x, rois, 3, 0.5, 2),
        "ps_roi_pool": lambda x: library.ps_roi_pool(x, rois, 3, 0.5),
        "deform_conv2d": lambda x: library.deform_conv2d(x, offset, weight, mask=mask),
        "deform_conv2d no mask": lambda x: library.deform_conv2d(x, offset, weight,
                                                                  bias=weight[:, 0, 0, 0]),
    }
    results = {}
    for name, call in calls.items():
        leaf = x.clone().requires_grad_(True)
        out = call(leaf)
        weights = torch.linspace(-1, 1, out.numel(), dtype=dtype, device=device)
        results[name] = (out, torch.autograd.grad((out * weights.view(out.shape)).sum(), leaf)[0])
    results["nms"] = (library.nms(boxes, scores, 0.3), None)
    return results


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torchvisions_ops_run_our_kernels_until_restored(request, device):
    """While replaced: torchvision.ops gives mmdispatch.torch's values and
    gradients bit for bit, and every forward and backward op reaches our
    dispatcher. After restore(): torchvision's own results again, bit for
    bit, and none of our kernels runs. On CUDA the backwards add with
    atomics (both libraries'), so gradients agree within rounding there."""
    if device == "cuda":
        request.getfixturevalue("torch_cuda")
    theirs = torchvision_calls(tv, device=device)
    ours = torchvision_calls(mt, device=device)
    seen = []
    with mt.replace_torchvision_kernels(devices=[device]) as kernels:
        assert kernels.active and device in repr(kernels)
        with mmdispatch.trace(lambda when, call: seen.append(call.op)):
            replaced = torchvision_calls(tv, device=device)
    assert not kernels.active and "restored" in repr(kernels)
    assert set(seen) == {f"{op}_{part}_impl" for op in ("roi_align", "roi_pool", "ps_roi_align",
                                                         "ps_roi_pool", "deform_conv2d")
                         for part in ("forward", "backward")} | {"nms_impl"}
    def same_gradient(a, b, name):
        if device == "cpu":
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)

    for name, (out, grad) in ours.items():
        assert torch.equal(replaced[name][0], out), name
        if grad is not None:
            same_gradient(replaced[name][1], grad, name)
    seen.clear()
    with mmdispatch.trace(lambda when, call: seen.append(call.op)):
        again = torchvision_calls(tv, device=device)
    assert not seen
    for name, (out, grad) in theirs.items():
        assert torch.equal(again[name][0], out), name
        if grad is not None:
            same_gradient(again[name][1], grad, name)
            torch.testing.assert_close(replaced[name][1], grad, rtol=1e-10, atol=1e-10,
                                       msg=name)


def test_second_outputs_are_torchvisions_argmax_and_channel_mapping():
    """roi_pool's argmax and the ps ops' channel mappings, which
    torchvision's backward ops take back: the same values, dtype (int32)
    and shape as torchvision's kernels give."""
    x, rois = inputs(torch.float32)[:2]
    ops = torch.ops.torchvision
    calls = [lambda: ops.roi_pool(x, rois, 0.5, 3, 3),
             lambda: ops.ps_roi_align(x, rois, 0.5, 3, 3, 2),
             lambda: ops.ps_roi_pool(x, rois, 0.5, 3, 3)]
    theirs = [call() for call in calls]
    with mt.replace_torchvision_kernels(devices=["cpu"]):
        ours = [call() for call in calls]
    for (their_out, their_index), (out, index) in zip(theirs, ours):
        assert index.dtype == their_index.dtype == torch.int32
        assert torch.equal(index, their_index)
        torch.testing.assert_close(out, their_out)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torchvisions_mask_rcnn_on_our_kernels_trains_and_detects_as_on_its_own(request, device):
    """A torchvision Mask R-CNN (its poolers, RPN and box nms all through
    torchvision's ops) trained a step and run, with torchvision's kernels
    and with ours behind them: the same losses, gradients and detections,
    within 1e-4; our kernels served it."""
    if device == "cuda":
        request.getfixturevalue("torch_cuda")
    theirs = mask_rcnn_run(tv.MultiScaleRoIAlign, device)
    seen = set()
    with mt.replace_torchvision_kernels(devices=[device]), \
            mmdispatch.trace(lambda when, call: seen.add(call.op)):
        ours = mask_rcnn_run(tv.MultiScaleRoIAlign, device)
    assert {"nms_impl", "roi_align_forward_impl", "roi_align_backward_impl"} <= seen
    assert_same_run(ours, theirs)


@needs_data_dependent_tracing
def test_compiled_torchvision_calls_trace_with_its_meta_and_run_our_kernels():
    """torch.compile(fullgraph=True) of torchvision's roi_align, roi_pool
    and nms: traced with torchvision's meta functions, run on our kernels
    (the eager results, and our dispatcher sees the calls)."""
    x, rois, boxes, scores = inputs(torch.float32)[:4]

    def f(x, rois, boxes, scores):
        return (tv.roi_align(x, rois, 3, 0.5, 2, True), tv.roi_pool(x, rois, 2, 0.5),
                tv.nms(boxes, scores, 0.3))

    seen = set()
    with mt.replace_torchvision_kernels(devices=["cpu"]):
        eager = f(x, rois, boxes, scores)
        with mmdispatch.trace(lambda when, call: seen.add(call.op)):
            compiled = torch.compile(f, fullgraph=True)(x, rois, boxes, scores)
    assert {"roi_align_forward_impl", "roi_pool_forward_impl", "nms_impl"} <= seen
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


def test_gradcheck_of_torchvisions_functions_on_our_kernels():
    x, rois = inputs()[:2]
    x = x[:, :8, :8, :8].clone().requires_grad_(True)
    rois = rois[:4] / torch.tensor([1.0, 3, 3, 3, 3], dtype=rois.dtype)   # inside the 8 x 8 map
    with mt.replace_torchvision_kernels(devices=["cpu"]):
        assert torch.autograd.gradcheck(lambda x: tv.roi_align(x, rois, 2, 1.0, 2, True), (x,))
        assert torch.autograd.gradcheck(lambda x: tv.roi_pool(x, rois, 2, 1.0), (x,))


def test_bad_rois_raise_our_clear_error_through_torchvisions_op():
    x, rois = inputs(torch.float32)[:2]
    rois[3, 0] = 5
    out = None
    with mt.replace_torchvision_kernels(devices=["cpu"]):
        with pytest.raises(ValueError, match=re.escape("roi_align_forward_impl: rois[3, 0] "
                                                       "(batch index) must be an integer in "
                                                       "[0, 2)")):
            out = tv.roi_align(x, rois, 3)
    assert out is None


def test_registration_refuses_unknown_devices_and_restores_once():
    with pytest.raises(ValueError, match=re.escape("replace_torchvision_kernels: devices must "
                                                   "be among ['cpu', 'cuda'], got ['mps']")):
        mt.replace_torchvision_kernels(devices=["mps"])
    kernels = mt.replace_torchvision_kernels(devices=["cpu"])
    kernels.restore()
    kernels.restore()   # a second restore changes nothing
    x, rois = inputs(torch.float32)[:2]
    seen = []
    with mmdispatch.trace(lambda when, call: seen.append(call.op)):
        tv.roi_align(x, rois, 3)
    assert not seen


def test_the_replacement_lasts_until_restored_even_when_its_handle_is_dropped():
    """torch removes a Library's registrations when it is collected: the
    handle is kept alive until restore(), so a call whose result is
    dropped still replaces torchvision's kernels. A device may be named
    alone; no device at all is refused."""
    import gc

    from mmdispatch.torch import _torchvision
    x, rois = inputs(torch.float32)[:2]
    before = set(_torchvision._ACTIVE)
    mt.replace_torchvision_kernels("cpu")
    gc.collect()
    (dropped,) = _torchvision._ACTIVE - before
    try:
        seen = []
        with mmdispatch.trace(lambda when, call: seen.append((when, call.op))):
            tv.roi_align(x, rois, 3)
        assert seen == [("begin", "roi_align_forward_impl"), ("end", "roi_align_forward_impl")]
    finally:
        dropped.restore()
    assert _torchvision._ACTIVE == before
    with pytest.raises(ValueError, match=re.escape("devices must be among ['cpu', 'cuda'], "
                                                   "got []")):
        mt.replace_torchvision_kernels([])
