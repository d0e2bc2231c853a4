"""The torch.library ops derived from signatures.txt
(mmdispatch/torch/_library.py): schemas, opcheck, fake tensors, autograd,
allocation with torch, the CPU's float32 compute for 16-bit floats, and the
eager path that skips torch.library's machinery."""
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the test extra has it)")

import mmdispatch  # noqa: E402
import mmdispatch.torch  # noqa: E402,F401  (registers the ops)
from mmdispatch.torch._library import DERIVED, _plain_eager  # noqa: E402
from torch_models import needs_data_dependent_tracing  # noqa: E402

OPS = torch.ops.mmdispatch


def roi_args(dtype=torch.float64, mode=1, requires_grad=False, device="cpu"):
    x = torch.randn(2, 3, 8, 8, dtype=dtype, device=device, requires_grad=requires_grad)
    rois = torch.tensor([[0, 0.5, 0.5, 5, 6], [1, 1, 1, 6, 5], [0, 2, 1, 7, 7]], dtype=dtype,
                        device=device)
    return (x, rois, 2, 2, 1.0, 2, mode, True)


def test_every_entry_point_has_a_derived_op_with_its_schema():
    assert {op.signature.name for op in DERIVED.values()} == set(mmdispatch.op_signatures())
    schema = str(OPS.roi_align_forward.default._schema)
    assert schema == (
        "mmdispatch::roi_align_forward(Tensor input, Tensor rois, int aligned_height, "
        "int aligned_width, float spatial_scale, int sampling_ratio, int pool_mode, "
        "bool aligned) -> (Tensor, Tensor, Tensor)")
    # an output without an allocation line takes its shape and dtype as arguments
    assert str(OPS.roi_pool_backward.default._schema) == (
        "mmdispatch::roi_pool_backward(Tensor grad_output, Tensor rois, Tensor argmax, "
        "SymInt[] grad_input_shape, ScalarType grad_input_dtype, int pooled_height, "
        "int pooled_width, float spatial_scale, int convention) -> Tensor")
    # a trimmed output is returned trimmed; the output holding its length is not returned
    assert str(OPS.nms.default._schema).endswith("float iou_threshold, int offset) -> Tensor")
    assert "Tensor? idxs" in str(OPS.nms.default._schema)


@needs_data_dependent_tracing
def test_fake_tensors_propagate_shapes_and_nms_gets_a_data_dependent_length():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    with FakeTensorMode(shape_env=ShapeEnv()):
        out, ay, ax = OPS.roi_align_forward(*roi_args(mode=0))
        assert out.shape == ay.shape == (3, 3, 2, 2) and out.dtype == torch.float64
        keep = OPS.nms(torch.zeros(7, 4), torch.zeros(7), None, 0.5, 0)
        assert keep.dtype == torch.int64 and not isinstance(keep.shape[0], int)


def test_tracing_a_data_dependent_size_on_a_torch_that_miscompiles_it_is_refused(monkeypatch):
    """torch 2.4's inductor computed wrong values from soft_nms's dets (a
    data-dependent size): where torch is older than 2.7, tracing such an op
    is an error naming the op and what to do, not a silent wrong answer."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from mmdispatch.torch import _library
    monkeypatch.setattr(_library, "_DATA_DEPENDENT_COMPILE", False)
    with FakeTensorMode(shape_env=ShapeEnv()):
        with pytest.raises(RuntimeError, match=r"^nms: tracing an op whose output size depends "
                                               r"on its data needs torch 2\.7 or newer .*call "
                                               r"nms outside the compiled region"):
            OPS.nms(torch.zeros(7, 4), torch.zeros(7), None, 0.5, 0)
        out = OPS.roi_align_forward(*roi_args(mode=0))[0]   # fixed sizes: traced as before
        assert out.shape == (3, 3, 2, 2)


@pytest.mark.parametrize("version, release", [
    ("2.7.0", (2, 7)), ("2.7.0a0+git79aa174", (2, 7)), ("2.7.0a0+79aa174.nv25.04", (2, 7)),
    ("2.6.1+cpu", (2, 6)), ("2.11.0+cu130", (2, 11)), ("2.10.0.dev20260101", (2, 10))])
def test_torchs_release_counts_a_pre_release_or_vendor_build_as_its_release(monkeypatch, version,
                                                                          release):
    from mmdispatch.torch._library import torch_release
    monkeypatch.setattr(torch, "__version__", version)
    assert torch_release() == release


def test_outputs_come_from_torch_and_only_strided_inputs_are_copied():
    """Contiguous inputs reach the kernel as they are, a strided one with one
    contiguous copy; outputs are allocated with torch (no numpy, no CuPy)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    args = list(roi_args())
    with Log() as log:
        DERIVED["roi_align_forward_impl"].run(*args)
    assert log.calls == ["aten.empty"] * 3
    args[0] = torch.randn(2, 3, 8, 16, dtype=torch.float64)[..., ::2]
    with Log() as log:
        DERIVED["roi_align_forward_impl"].run(*args)
    assert sorted(log.calls) == sorted(["aten.clone"] + ["aten.empty"] * 3)


def test_large_cpu_outputs_are_advised_into_2mb_pages_and_keep_their_values(monkeypatch):
    """An output of 4 MB or more has the 2 MB-aligned pages inside it
    advised (MADV_HUGEPAGE) before its first write, as numpy does for its
    arrays; smaller ones are left alone; values are unchanged."""
    from mmdispatch.torch import _library
    if _library._MADV_HUGEPAGE is None or _library._madvise() is None:
        pytest.skip("no madvise(MADV_HUGEPAGE) on this platform")
    advised = []

    def record(start, length, advice):
        advised.append((start, length, advice))
        return 0
    monkeypatch.setattr(_library, "_madvise", lambda: record)
    x = torch.randn(1, 2, 768, 1024)   # 6 MB: grad_input is large
    rois = torch.tensor([[0, 3.0, 5.0, 700.0, 600.0], [0, 0.0, 0.0, 40.0, 30.0]])
    grad_out = torch.ones(2, 2, 3, 3)
    out, argmax = OPS.roi_pool_forward(x, rois, 3, 3, 1.0, 0)   # 72-byte outputs
    assert advised == []
    grad = OPS.roi_pool_backward(grad_out, rois, argmax, list(x.shape), x.dtype, 3, 3, 1.0, 0)
    [(start, length, advice)] = advised
    assert advice == _library._MADV_HUGEPAGE and start % (1 << 21) == 0 and length % (1 << 21) == 0
    assert grad.data_ptr() <= start and start + length <= grad.data_ptr() + grad.numel() * 4
    expected = mmdispatch.ops.roi_pool_backward(grad_out.numpy(), rois.numpy(), argmax.numpy(),
                                                tuple(x.shape), 1.0)
    assert torch.equal(grad, torch.from_numpy(expected))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_computes_16_bit_floats_in_float32(dtype):
    args = list(roi_args(dtype=dtype))
    out = OPS.roi_align_forward(*args)[0]
    assert out.dtype == dtype
    args32 = list(roi_args(dtype=torch.float32))
    args32[0], args32[1] = args[0].float(), args[1].float()
    expected = OPS.roi_align_forward(*args32)[0]
    torch.testing.assert_close(out, expected.to(dtype))


def test_the_eager_path_is_taken_only_for_plain_tensors_outside_tracing():
    x = torch.zeros(2, 2)
    assert _plain_eager((x, x), (0, 1)) is False
    assert _plain_eager((x.requires_grad_(), x), (0, 1)) is True
    with torch.no_grad():
        assert _plain_eager((x, x), (0, 1)) is False

    class Tagged(torch.Tensor):
        pass

    assert _plain_eager((torch.zeros(2).as_subclass(Tagged),), (0,)) is None
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert _plain_eager((torch.zeros(2),), (0,)) is None


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")   # as torchvision's
def test_torch_func_transforms_take_the_registered_ops_and_match_a_loop():
    """Under torch.func's vmap and grad, tensors are of type torch.Tensor
    but wrap others and hold no storage: the calls go through torch's
    dispatch (the eager path refused them with 'cannot view a torch
    tensor'), vmap's fallback runs each op once per batch entry, and grad
    differentiates through ops whose inputs are constants."""
    from mmdispatch.torch import box_iou, nms, roi_align, roi_pool
    x = torch.randn(3, 1, 2, 8, 8, dtype=torch.float64)
    rois = torch.tensor([[0, 1, 1, 6, 6], [0, 0.5, 2, 7, 5]], dtype=torch.float64)
    boxes = torch.tensor([[0, 0, 4, 4], [1, 1, 5, 5], [6, 6, 9, 9]], dtype=torch.float64)
    scores = torch.rand(4, 3, dtype=torch.float64)
    for op, args in ((roi_align, (rois, 2, 0.5, 2, True)), (roi_pool, (rois, 2, 0.5))):
        batched = torch.func.vmap(lambda v: op(v, *args))(x)
        torch.testing.assert_close(batched, torch.stack([op(v, *args) for v in x]), rtol=0,
                                   atol=0)
    kept = torch.func.vmap(lambda s: nms(boxes, s, 0.5).sum())(scores)
    torch.testing.assert_close(kept, torch.stack([nms(boxes, s, 0.5).sum() for s in scores]))
    weights = torch.ones(3, dtype=torch.float64)
    grad = torch.func.grad(lambda w: (w * box_iou(boxes, boxes).sum(1)).sum())(weights)
    torch.testing.assert_close(grad, box_iou(boxes, boxes).sum(1))
    grad = torch.func.grad(lambda w: w[nms(boxes, scores[0], 0.5)].sum())(weights)
    expected = torch.zeros(3, dtype=torch.float64)
    expected[nms(boxes, scores[0], 0.5)] = 1
    torch.testing.assert_close(grad, expected)


def test_eager_path_and_registered_op_give_the_same_results_and_gradients():
    derived = DERIVED["roi_align_forward_impl"]
    for mode in (0, 1):
        args = roi_args(mode=mode, requires_grad=True)
        eager = derived(*args)[0]
        (eager_grad,) = torch.autograd.grad(eager.sum(), args[0])
        registered = derived.op(*args)[0]
        (registered_grad,) = torch.autograd.grad(registered.sum(), args[0])
        assert eager.grad_fn is not None and registered.grad_fn is not None
        torch.testing.assert_close(eager, registered, rtol=0, atol=0)
        torch.testing.assert_close(eager_grad, registered_grad, rtol=0, atol=0)


def test_eager_autograd_calls_share_unused_empty_outputs_without_tying_their_versions():
    """In avg mode roi_align's argmax pair is unused: eager calls, with
    autograd too, return one shared (0,) tensor for each, untouched by
    autograd and not among the saved tensors, so an in-place op on it by
    one caller breaks no other call's backward."""
    derived = DERIVED["roi_align_forward_impl"]
    first, second = roi_args(requires_grad=True), roi_args(requires_grad=True)
    out1, argmax_y1, _ = derived(*first)
    out2, argmax_y2, _ = derived(*second)
    assert argmax_y1 is argmax_y2 and argmax_y1.shape == (0,)
    assert not argmax_y1.requires_grad and argmax_y1.grad_fn is None
    assert out1.grad_fn is not None
    argmax_y1.add_(1)   # bumps its version
    out2.sum().backward()
    out1.sum().backward()
    for args in (first, second):   # the registered op's gradient
        x = args[0].detach().requires_grad_()
        OPS.roi_align_forward(x, *args[1:])[0].sum().backward()
        torch.testing.assert_close(args[0].grad, x.grad, rtol=0, atol=0)


def test_a_differentiable_empty_output_is_each_calls_own_tensor():
    """softmax_focal_loss of no rows, unreduced, returns a (0,) loss: with
    autograd each call gets its own tensor (not the shared empty one that
    unused outputs are), with its own history."""
    from mmdispatch.torch import mmcv
    target = torch.zeros(0, dtype=torch.int64)
    x1, x2 = torch.zeros(0, 4, requires_grad=True), torch.zeros(0, 4, requires_grad=True)
    loss1 = mmcv.softmax_focal_loss(x1, target, reduction="none")
    loss2 = mmcv.softmax_focal_loss(x2, target, reduction="none")
    assert loss1 is not loss2 and loss1.grad_fn is not loss2.grad_fn
    loss1.sum().backward()
    assert x1.grad is not None and x1.grad.shape == (0, 4) and x2.grad is None
    plain = mmcv.softmax_focal_loss(torch.zeros(0, 4), target, reduction="none")
    assert not plain.requires_grad and plain.grad_fn is None


def test_eager_backward_fills_no_zero_gradient_for_an_argmax_output():
    """roi_pool's argmax is an output as large as its values but never has
    a gradient: the eager backward does not have autograd fill one with
    zeros (20 ms of the bench's 270 ms roi_pool forward+backward), and the
    gradient is the registered op's."""
    x = torch.randn(2, 3, 9, 11, dtype=torch.float64, requires_grad=True)
    rois = torch.tensor([[0, 0, 0, 6, 5], [1, 2, 1, 10, 8], [0, 1, 1, 3, 3.]],
                        dtype=torch.float64)
    output, argmax = DERIVED["roi_pool_forward_impl"](x, rois, 4, 4, 1.0, 0)   # eager
    assert output.shape == argmax.shape == (3, 3, 4, 4)
    with torch.profiler.profile(record_shapes=True) as profile:
        output.sum().backward()
    filled = [e for e in profile.events() if e.name in ("aten::zero_", "aten::fill_", "aten::zeros")
              and e.input_shapes and list(e.input_shapes[0]) == [3, 3, 4, 4]]
    assert filled == []
    y = x.detach().requires_grad_()
    OPS.roi_pool_forward(y, rois, 4, 4, 1.0, 0)[0].sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)


def test_ops_without_a_gradient_give_outputs_that_need_none_as_mmcvs_do():
    """bbox_overlaps of boxes that need a gradient: a constant IoU (MMCV's
    behaviour), and a loss beside it still has its backward."""
    from mmdispatch.torch import mmcv
    boxes = torch.tensor([[0., 0, 2, 2], [1, 1, 3, 3]], requires_grad=True)
    iou = mmcv.bbox_overlaps(boxes, boxes)
    assert not iou.requires_grad and iou.grad_fn is None
    (iou.sum() + boxes.sum()).backward()
    assert torch.equal(boxes.grad, torch.ones(2, 4))


def test_compiled_max_roi_align_on_a_data_dependent_number_of_rois_matches_eager():
    """Under torch.compile the autograd setup sees FakeTensors of unbacked
    size (rois chosen by score): it must not guard on their size."""
    from mmdispatch.torch import mmcv
    import torch._dynamo
    config = torch._dynamo.config

    def f(x, boxes, scores):
        rois = boxes[scores > 0.5]
        return mmcv.roi_align(x, rois, (2, 2), 1.0, 2, "max", True).sum()

    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    boxes = torch.tensor([[0, 0, 0, 4, 4], [0, 1, 1, 6, 5], [0, 2, 2, 7, 7.]])
    scores = torch.tensor([0.9, 0.1, 0.8])
    eager = f(x, boxes, scores)
    (expected,) = torch.autograd.grad(eager, x)
    torch._dynamo.reset()
    with config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x, boxes, scores)
    (got,) = torch.autograd.grad(compiled, x)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(got, expected)


def test_kernel_errors_reach_torch_users_with_the_op_and_parameter():
    args = list(roi_args())
    args[1] = torch.tensor([[5, 0, 0, 1, 1.]], dtype=torch.float64)
    for call in (DERIVED["roi_align_forward_impl"], OPS.roi_align_forward):
        with pytest.raises(ValueError, match=re.escape(
                "roi_align_forward_impl: rois[0, 0] (batch index) must be an integer in "
                "[0, 2)")):
            call(*args)


def test_registered_backends_and_python_kernels_apply_to_torch_calls():
    seen = []

    def kernel(input, rois, output, *rest):
        seen.append(type(input).__name__)
        output.fill_(7)

    # "probe", a name other tests create too: backend names are a process's,
    # at most 8 of them, and the whole suite may run in one process
    with mmdispatch.register_impl("roi_align_forward_impl", "cpu", kernel, backend="probe"):
        with mmdispatch.use_backend("cpu", "probe"):
            out = OPS.roi_align_forward(*roi_args())[0]
    assert seen == ["Tensor"] and bool((out == 7).all())
    np.testing.assert_array_equal(out.numpy(), 7)


def probe_backward_kernel():
    """(seen, kernel): a roi_align backward kernel for the "probe" backend
    that records the thread it runs in and fills grad_input with 7; skips
    the test on a torch without the thread-local objects it hands to
    autograd's threads (mmdispatch.torch then hands no selection over)."""
    import threading
    from mmdispatch.torch import _library
    if not _library._SELECTION_TLS:
        pytest.skip(f"torch {torch.__version__} lacks the thread-local objects it hands over")
    seen = []

    def kernel(grad_output, rois, argmax_y, argmax_x, grad_input, *rest):
        seen.append(threading.get_ident())
        grad_input.fill_(7)

    return seen, kernel


def test_a_backward_pass_in_another_thread_takes_the_selection_handed_over_with_torchs_state():
    """use_backend and strict are thread-local, and autograd runs a CUDA
    backward pass in a thread of its own, handing it the starting thread's
    ThreadLocalState, whose Python objects carry mmdispatch's selection. On
    the CPU autograd runs in the calling thread, so here a thread receives
    the selection as torch hands it over (torch._C._stash_obj_in_tls, what
    its ThreadLocalState restores) and runs a backward pass: its backward
    call takes the "probe" backend selected in the main thread, though the
    thread's own selection is the default; its forward calls, outside a
    backward pass, do not look. The real thing:
    test_a_cuda_backward_pass_takes_the_backend_selected_around_backward."""
    import threading
    from mmdispatch.torch import _library
    seen, kernel = probe_backward_kernel()
    result = {}

    def autograd_thread():
        torch._C._stash_obj_in_tls(_library._SELECTION_KEY, handed_over)
        x, rois, *_ = roi_args(torch.float64, requires_grad=True)
        out = mmdispatch.torch.roi_align(x, rois, 2, 1.0, 2, True)
        result["own"] = mmdispatch.get_backend("cpu")
        out.sum().backward()
        result["grad"] = x.grad
        result["after"] = mmdispatch.get_backend("cpu")

    with mmdispatch.register_impl("roi_align_backward_impl", "cpu", kernel, backend="probe"):
        with mmdispatch.use_backend("cpu", "probe"):
            handed_over = torch._C._get_obj_in_tls(_library._SELECTION_KEY)
        thread = threading.Thread(target=autograd_thread)
        thread.start()
        thread.join()
    assert seen == [thread.ident]
    assert bool((result["grad"] == 7).all())
    assert result["own"] == result["after"] == "default"


def test_a_cuda_backward_pass_takes_the_backend_selected_around_backward(torch_cuda):
    """autograd runs a CUDA backward pass in a thread of its own, where the
    calling thread's use_backend is not seen but for the selection torch
    hands over: `with use_backend("cuda", name): loss.backward()` runs the
    named backend's backward (the deterministic one, say)."""
    seen, kernel = probe_backward_kernel()
    x, rois, *rest = roi_args(torch.float32, mode=1, requires_grad=True, device="cuda")
    out = mmdispatch.torch.roi_align(x, rois, 2, 1.0, 2, True)
    with mmdispatch.register_impl("roi_align_backward_impl", "cuda", kernel, backend="probe"):
        with mmdispatch.use_backend("cuda", "probe"):
            out.sum().backward()
    assert len(seen) == 1
    assert bool((x.grad == 7).all())


def test_ops_whose_length_is_read_back_are_tagged_and_refuse_a_cuda_graph_capture():
    """The nms family reads its kept count back from the device, which a
    CUDA graph capture forbids: those ops carry torch.Tag.cudagraph_unsafe
    (torch.compile's CUDA graphs leave them out) and, on CUDA tensors while
    torch's current stream captures, raise a RuntimeError saying so before
    launching anything (tests/cuda/test_graphs.py on a GPU); no other op
    pays for the check."""
    counted = {name for name, op in DERIVED.items() if op.counted}
    assert counted == {"nms_impl", "nms_rotated_impl", "soft_nms_impl"}
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    for name, op in DERIVED.items():
        tags = getattr(OPS, op.name).default.tags
        if tag is not None:
            assert (tag in tags) == op.counted, name
        assert ("_refuse_capture()" in op.run.source) == op.counted, name
    message = pytest.raises(RuntimeError, DERIVED["nms_impl"].refuse_capture).value
    assert str(message).startswith("nms: its output's length depends on the data and is read "
                                   "back from the device, so it cannot be captured into a CUDA "
                                   "graph")


def test_mmdispatch_works_without_torch_and_its_torch_layer_says_what_it_needs(tmp_path):
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\n"   # as if torch were not installed
            "import numpy as np, mmdispatch\n"
            "x = np.ones((1, 1, 4, 4), np.float32)\n"
            "mmdispatch.ops.roi_align(x, np.array([[0, 0, 0, 2, 2]], np.float32), 2)\n"
            "try:\n"
            "    import mmdispatch.torch\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("mmdispatch.torch needs PyTorch: pip install 'mmdispatch[torch]'")


@pytest.mark.parametrize("forward", [DERIVED["roi_align_forward_impl"], OPS.roi_align_forward],
                         ids=["eager", "torch.library"])
def test_a_second_backward_through_a_backward_op_is_refused_as_torch_library_refuses_it(forward):
    """Eager backward calls take the implementation straight away, but
    with create_graph=True the backward op goes through torch.library: its
    result needs a gradient, and a backward through it is torch.library's
    error, not a silent zero."""
    args = roi_args(requires_grad=True)
    out = forward(*args)[0]
    (grad,) = torch.autograd.grad((out * out).sum(), args[0], create_graph=True)
    assert grad.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        grad.sum().backward()
    (plain,) = torch.autograd.grad(forward(*args)[0].sum(), args[0])
    assert not plain.requires_grad


def test_jit_trace_records_the_ops_and_reruns_them_on_new_inputs():
    """torch.jit.trace sees only what reaches torch's dispatcher: a traced
    call goes through it (not straight to the kernel), so the trace holds
    the op and gives the eager result on other inputs, a different nms
    count included."""
    import mmdispatch.torch as mt

    def f(x, rois, boxes, scores):
        return mt.roi_align(x, rois, 3, 0.5, 2, True), mt.nms(boxes, scores, 0.5)

    g = torch.Generator().manual_seed(0)

    def case(n):
        boxes = torch.rand(n, 4, generator=g) * 10
        boxes[:, 2:] += boxes[:, :2]
        rois = torch.cat([torch.zeros(n, 1), boxes], 1)
        return torch.randn(1, 3, 8, 8, generator=g), rois, boxes, torch.rand(n, generator=g)

    traced = torch.jit.trace(f, case(6), check_trace=False)
    assert "mmdispatch::nms" in str(traced.graph)
    for n in (6, 11):
        args = case(n)
        for ours, expected in zip(traced(*args), f(*args)):
            assert torch.equal(ours, expected)


def tf32_probe_kernels():
    """(seen, forward, backward, other): deform_conv2d kernels for the
    "probe" backend, and roi_align's forward, that record whether their
    call may run float32 products in TF32 (the thread's setting, read and
    put back) and write zeros."""
    seen = []

    def state():
        value = mmdispatch._core._swap_thread_tf32(-1)
        mmdispatch._core._swap_thread_tf32(value)
        return value

    def forward(input, offset, mask, weight, bias, output, *geometry):
        seen.append(("forward", state()))
        output.zero_()

    def backward(grad_output, input, offset, mask, weight, *outputs_and_geometry):
        seen.append(("backward", state()))
        for output in outputs_and_geometry[:5]:
            output.zero_()

    def other(input, rois, output, *rest):   # roi_align's forward: no products
        seen.append(("roi_align", state()))
        output.zero_()

    return seen, forward, backward, other


def test_deform_conv2d_calls_take_torchs_float32_matmul_precision_for_their_products():
    """deform_conv2d's forward and backward calls run with torch's float32
    matmul precision as the thread's setting for their products (TF32 on
    CUDA, as torchvision's at::addmm takes it), whatever mmdispatch's own
    setting; calls of ops without products, and the thread after a call,
    keep the thread's own (-1: the process's setting)."""
    from mmdispatch.torch import deform_conv2d, roi_align
    seen, forward, backward, other = tf32_probe_kernels()
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    offset = torch.zeros(1, 18, 3, 3)
    weight = torch.randn(3, 2, 3, 3)
    try:
        with mmdispatch.register_impl("deform_conv2d_forward_impl", "cpu", forward,
                                      backend="probe"), \
                mmdispatch.register_impl("deform_conv2d_backward_impl", "cpu", backward,
                                         backend="probe"), \
                mmdispatch.register_impl("roi_align_forward_impl", "cpu", other,
                                         backend="probe"), \
                mmdispatch.use_backend("cpu", "probe"):
            for precision, expected in (("high", 1), ("highest", 0), ("medium", 1)):
                torch.set_float32_matmul_precision(precision)
                mmdispatch.set_float32_matmul_precision("highest" if expected else "high")
                deform_conv2d(x, offset, weight).sum().backward()
                # a strided input: the general implementation (run_general)
                deform_conv2d(x.detach().transpose(2, 3), offset, weight)
                assert seen == [("forward", expected), ("backward", expected),
                                ("forward", expected)], precision
                assert mmdispatch._core._swap_thread_tf32(-1) == -1
                seen.clear()
                roi_align(x, torch.tensor([[0, 0, 0, 3, 3.]]), 2)
                assert seen == [("roi_align", -1)]
                seen.clear()
    finally:
        torch.set_float32_matmul_precision("highest")
        mmdispatch.set_float32_matmul_precision("highest")


def test_torchs_float32_matmul_precision_is_read_from_each_of_its_settings(tmp_path):
    """_torch_tf32 reads torch's matmul precision however a program set
    it: set_float32_matmul_precision, matmul.allow_tf32, and (torch 2.9
    and later) matmul.fp32_precision, or the cuda or generic
    fp32_precision where matmul's is "none", mixed settings included
    (where torch's own allow_tf32 getter raises); a fresh process each."""
    import subprocess
    import sys
    cases = [("pass", 0), ("torch.set_float32_matmul_precision('high')", 1),
             ("torch.backends.cuda.matmul.allow_tf32 = True", 1)]
    if hasattr(torch._C, "_get_fp32_precision_getter"):
        cases += [("torch.backends.cuda.matmul.fp32_precision = 'tf32'", 1),
                  ("torch.backends.fp32_precision = 'tf32'", 1),
                  ("torch.backends.fp32_precision = 'tf32'\n"
                   "torch.backends.cuda.matmul.fp32_precision = 'ieee'", 0),
                  ("torch.set_float32_matmul_precision('high')\n"
                   "torch.backends.cuda.matmul.fp32_precision = 'ieee'", 0)]
    code = ("import torch\n"
            "from mmdispatch.torch._library import _torch_tf32\n"
            "{}\n"
            "print(_torch_tf32())\n")
    for setting, expected in cases:
        out = subprocess.run([sys.executable, "-c", code.format(setting)], capture_output=True,
                             text=True, cwd=tmp_path, timeout=120)
        assert out.returncode == 0, (setting, out.stderr)
        assert out.stdout.split() == [str(expected)], setting


@pytest.mark.parametrize("mode", [0, 1])
def test_eager_calls_under_autocast_cast_as_the_autocast_kernel_without_torch_library(
        monkeypatch, mode):
    """Under torch.autocast, a call on plain tensors takes the autocast
    kernel's casts (bfloat16 features and float32 rois computed in float32,
    the result in bfloat16) and then the implementation straight away: the
    outputs and the gradient bit for bit those of torch.library's dispatch
    through the registered autocast kernel, which it does not call. With
    autocast on for another device type only, the call is the plain one."""
    derived = DERIVED["roi_align_forward_impl"]
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    rois = torch.tensor([[0, 0.5, 0.5, 5, 6], [1, 1, 1, 6, 5], [0, 2, 1, 7, 7]])
    args = (x, rois, 2, 2, 1.0, 2, mode, True)
    runs = []
    for call in (derived.op, derived):   # dispatched (the autocast kernel), then eager
        leaf = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs = call(leaf, *args[1:])
        (grad,) = torch.autograd.grad(outputs[0].float().square().sum(), leaf)
        runs.append((outputs, grad))
        monkeypatch.setattr(derived, "op", None)   # the eager call must not dispatch
    (dispatched, grad_dispatched), (eager, grad_eager) = runs
    assert eager[0].dtype == torch.bfloat16 and eager[0].grad_fn is not None
    for a, b in zip(dispatched, eager):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(grad_dispatched, grad_eager, rtol=0, atol=0)
    # autocast on for another device type only (as if for CUDA, here for no
    # type torch would dispatch these CPU tensors' autocast kernel on)
    from mmdispatch.torch import _library
    monkeypatch.setattr(_library, "_autocast_on", lambda device_type: False)
    monkeypatch.setattr(derived, "autocast_arguments", None)   # no casts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = derived(*args)
    for a, b in zip(plain, derived(*args)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_modules_parameters_take_the_eager_path_with_the_dispatched_gradients(monkeypatch):
    """nn.Parameter arguments (deform_conv2d's weight and bias in a module)
    are plain tensors to the eager path: the call does not go through
    torch.library (whose autograd wrapper cost about 100 us more a call,
    2026-11-28), and gives its outputs and gradients bit for bit."""
    from mmdispatch.torch import DeformConv2d, _library
    torch.manual_seed(4)
    module = DeformConv2d(2, 3, 3, padding=1)
    assert type(module.weight) is torch.nn.Parameter
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    offset = torch.randn(1, 18, 5, 5)
    derived = DERIVED["deform_conv2d_forward_impl"]
    runs = []
    for eager in (False, True):
        with monkeypatch.context() as patch:
            if eager:   # the eager call must not dispatch
                patch.setattr(derived, "op", None)
            else:       # every call through torch.library
                patch.setattr(_library, "_plain_eager", lambda args, tensor_args: None)
            module.zero_grad()
            x.grad = None
            out = module(x, offset)
            out.square().sum().backward()
            runs.append((out, x.grad, module.weight.grad, module.bias.grad))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_eager_calls_show_in_torchs_profiler_by_the_ops_name():
    """An eager call skips torch's dispatcher, which records an op's name
    for torch.profiler: under the profiler it records the same name itself
    (the forward, and the backward op autograd calls)."""
    from mmdispatch.torch import roi_align
    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    with torch.profiler.profile() as profile:
        roi_align(x, torch.tensor([[0, 0, 0, 4, 4.]]), 2).sum().backward()
    names = [event.name for event in profile.events()]
    assert "mmdispatch::roi_align_forward" in names
    assert "mmdispatch::roi_align_backward" in names
    assert names.count("mmdispatch::roi_align_forward") == 1


def test_an_ops_shared_empty_output_is_one_tensor_even_when_threads_make_it_at_once():
    """Two threads that both find no shared (0,) output for a key make one
    each; the op keeps the first stored and both get it, and only its id is
    among those the autograd setup takes for the shared one (a dropped
    tensor's id, reused by a later tensor, would make that tensor's argmax
    skip save_for_backward and its in-place changes go unnoticed)."""
    derived = DERIVED["roi_pool_forward_impl"]

    class Raced(dict):   # as if another thread stored the key between get and store
        def get(self, key, default=None):
            return None

    original, original_ids = derived.empties, derived.empty_ids
    derived.empties, derived.empty_ids = Raced(), set()
    try:
        first = derived.empty(1, torch.int64, torch.device("cpu"))
        second = derived.empty(1, torch.int64, torch.device("cpu"))
        assert first is second
        assert derived.empty_ids == {id(first)}
    finally:
        derived.empties, derived.empty_ids = original, original_ids


def test_under_autocast_a_python_kernel_runs_with_autocast_off_as_in_the_autocast_kernel():
    """The autocast kernel runs the op inside autocast(enabled=False); the
    eager call under autocast does too, so a registered Python kernel's
    torch ops compute in the dtypes they are given (not in 16 bits)."""
    seen = []

    def kernel(boxes1, boxes2, output, *rest):
        seen.append(torch.is_autocast_enabled("cpu"))
        output.copy_(torch.mm(boxes1, boxes2.t()))

    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 2, 3, 400]])
    with mmdispatch.register_impl("bbox_overlaps_impl", "cpu", kernel, backend="probe"), \
            mmdispatch.use_backend("cpu", "probe"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = DERIVED["bbox_overlaps_impl"](boxes, boxes, 0, False, 0)
            assert torch.is_autocast_enabled("cpu")
    assert seen == [False]
    torch.testing.assert_close(got, torch.mm(boxes, boxes.t()), rtol=0, atol=0)


def test_an_ops_shared_empty_output_made_in_inference_mode_serves_later_calls_with_autograd():
    """nms of no boxes returns (a view of) the op's shared (0,) tensor:
    made first inside torch.inference_mode, it is still an ordinary
    tensor, so a later call's keep indexes boxes that need a gradient."""
    from mmdispatch.torch import nms
    derived = DERIVED["nms_impl"]
    original, original_ids = derived.empties, derived.empty_ids
    derived.empties, derived.empty_ids = {}, set()
    try:
        none = torch.zeros(0, 4)
        with torch.inference_mode():
            nms(none, torch.zeros(0), 0.5)
        keep = nms(none, torch.zeros(0), 0.5)
        assert not keep.is_inference()
        boxes = none.clone().requires_grad_(True)
        boxes[keep].sum().backward()
        assert boxes.grad.shape == (0, 4)
    finally:
        derived.empties, derived.empty_ids = original, original_ids
