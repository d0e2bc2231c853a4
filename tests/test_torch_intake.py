"""The dispatcher's view of torch tensors (mmdispatch/_intake.pxi,
KIND_TORCH): read through torch's DLPack C exchange API where torch has one
(2.10 and later) and through its own accessors otherwise, without DLPack
exports or copies, on the CPU and on CUDA devices (on torch's current
stream); other devices and tensor subclasses take the DLPack path. Every
test runs on both paths."""
import re

import numpy as np
import pytest

import mmdispatch

torch = pytest.importorskip("torch", reason="torch is not installed (the test extra has it)")

FWD = mmdispatch.roi_align_forward_impl
HAS_EXCHANGE_API = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


@pytest.fixture(autouse=True, params=["exchange-api", "accessors"])
def intake(request):
    """The torch intake path of the test: torch's DLPack C exchange API,
    or the tensors' accessors (as with a torch older than 2.10)."""
    from mmdispatch import _core
    on = request.param == "exchange-api"
    if on and not HAS_EXCHANGE_API:
        pytest.skip(f"torch {torch.__version__} has no __dlpack_c_exchange_api__")
    assert _core._use_torch_dlpack_api(on) == on
    yield request.param
    _core._use_torch_dlpack_api(True)


def test_torch_with_the_exchange_api_is_viewed_through_it():
    """The C exchange API is found wherever torch offers it (torch 2.10 and
    later; CI installs such a torch)."""
    from mmdispatch import _core
    assert _core._use_torch_dlpack_api(True) == HAS_EXCHANGE_API


def forward_args(make=torch.tensor, dtype=torch.float64):
    x = torch.arange(2 * 3 * 6 * 6, dtype=dtype).reshape(2, 3, 6, 6)
    rois = torch.tensor([[0, 0, 0, 4, 4], [1, 1, 1, 5, 3]], dtype=dtype)
    out = torch.zeros(2, 3, 2, 2, dtype=dtype)
    empty = torch.empty(0, dtype=dtype)
    return [x, rois, out, empty, empty.clone()]


def test_cpu_tensors_are_viewed_in_place_and_give_the_numpy_result():
    args = forward_args()
    pointer = args[2].data_ptr()
    FWD(*args, 2, 2, 1.0, 2, 1, True)
    expected = mmdispatch.ops.roi_align(args[0].numpy(), args[1].numpy(), 2, 1.0, 2)
    assert args[2].data_ptr() == pointer   # written where it lies: no copy
    np.testing.assert_array_equal(args[2].numpy(), expected)


def test_parameters_and_tensors_that_require_grad_are_viewed_too():
    args = forward_args()
    args[0] = torch.nn.Parameter(args[0])
    args[1].requires_grad_(True)
    FWD(*args, 2, 2, 1.0, 2, 1, True)
    assert float(args[2].abs().sum()) > 0


def test_torch_outputs_that_require_grad_are_refused_and_others_tell_autograd_of_the_write():
    """An output is written in place, as torch's in-place ops write: one
    that requires grad (in grad mode) is refused, as torch refuses such a
    write to a leaf (a non-leaf's history would not describe the written
    values); any other has its version counter moved on, so that a
    backward through a graph that saved it fails as torch's own in-place
    ops make it fail, where it silently used the new values."""
    weight = torch.rand(2, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    for output in (weight, weight * 2):
        args = forward_args()
        args[2] = output
        with pytest.raises(ValueError, match=re.escape(
                "roi_align_forward_impl: at param 2 (output), output tensor requires grad")):
            FWD(*args, 2, 2, 1.0, 2, 1, True)
    args = forward_args()
    saved = args[2]
    loss = (weight * saved).sum()   # saves `saved` for weight's gradient
    version = saved._version
    FWD(*args, 2, 2, 1.0, 2, 1, True)
    assert saved._version > version and float(saved.abs().sum()) > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.no_grad():   # outside grad mode, as torch allows
        args = forward_args()
        args[2] = weight
        FWD(*args, 2, 2, 1.0, 2, 1, True)
    # a call refused by the kernel's checks writes nothing, and the counter
    # stays (the dispatcher moves it on after the kernel succeeded)
    args = forward_args()
    args[2] = torch.zeros(2, 3, 3, 3, dtype=torch.float64)
    version = args[2]._version
    with pytest.raises(ValueError, match="output"):
        FWD(*args, 2, 2, 1.0, 2, 1, True)
    assert args[2]._version == version and not args[2].any()

    class Tagged(torch.Tensor):   # taken through DLPack: told too
        pass

    args = forward_args()
    args[2] = args[2].as_subclass(Tagged)
    saved_loss = (weight * args[2]).sum()
    FWD(*args, 2, 2, 1.0, 2, 1, True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved_loss.backward()


def test_python_kernels_take_torch_outputs_as_they_are():
    """A Python kernel writes as it writes (with torch's in-place ops,
    autograd sees it): an output that requires grad is its to take."""
    seen = []
    with mmdispatch.register_impl("roi_align_forward_impl", "cpu", lambda *a: seen.append(a),
                                  backend="probe"), \
            mmdispatch.use_backend("cpu", "probe"):
        args = forward_args()
        args[2] = torch.zeros(2, 3, 2, 2, dtype=torch.float64, requires_grad=True) * 1
        FWD(*args, 2, 2, 1.0, 2, 1, True)
    assert seen and seen[0][2] is args[2]


def test_a_tensor_subclass_takes_the_dlpack_path_with_the_same_result():
    class Tagged(torch.Tensor):
        pass

    args, plain = forward_args(), forward_args()
    args[0] = args[0].as_subclass(Tagged)
    FWD(*args, 2, 2, 1.0, 2, 1, True)
    FWD(*plain, 2, 2, 1.0, 2, 1, True)
    assert torch.equal(args[2], plain[2])


def test_strided_views_and_overlapping_outputs_are_refused_with_clear_errors():
    args = forward_args()
    args[0] = torch.zeros(2, 3, 6, 12, dtype=torch.float64)[..., ::2]
    with pytest.raises(ValueError, match=re.escape(
            "roi_align_forward_impl: input must be C-contiguous")):
        FWD(*args, 2, 2, 1.0, 2, 1, True)
    args = forward_args()
    args[2] = args[0][:2, :, :2, :2]   # output aliasing the input
    with pytest.raises(ValueError, match=re.escape(
            "roi_align_forward_impl: at param 2 (output), output memory overlaps param 0 "
            "(input)")):
        FWD(*args, 2, 2, 1.0, 2, 1, True)


@pytest.mark.parametrize("make, message", [
    (lambda: torch.empty(2, 3, 6, 6, dtype=torch.float64, device="meta"),
     "at param 0 (input), the torch tensor has no data (a meta or fake tensor, device meta)"),
    (lambda: torch.ones(2, 3, 6, 6, dtype=torch.float64).to_sparse(),
     "at param 0 (input), cannot view a torch tensor of layout torch.sparse_coo"),
    (lambda: torch.ones(2, 3, 6, 6, dtype=torch.complex64),
     "at param 0 (input), unsupported dtype torch.complex64"),
    # float64 whose memory holds the negation of its values
    (lambda: torch.ones(2, 3, 6, 6, dtype=torch.complex128).conj().imag,
     "at param 0 (input), the torch tensor is a negated view (its negative bit is set"),
])
def test_tensors_without_a_plain_view_are_refused_naming_the_parameter(make, message):
    args = forward_args()
    args[0] = make()
    with pytest.raises(TypeError, match=re.escape(f"roi_align_forward_impl: {message}")):
        FWD(*args, 2, 2, 1.0, 2, 1, True)
    assert not args[2].any()


def test_torch_and_other_devices_are_checked_like_any_array(fake_array):
    args = forward_args()
    args[1] = fake_array(2, 0)
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "roi_align_forward_impl: at param 1 (rois), inconsistent device: cuda:0 vs cpu")):
        FWD(*args, 2, 2, 1.0, 2, 1, True)
    assert not args[1].exported


def test_integer_and_bool_dtypes_map_to_the_kernels_dtypes():
    boxes = torch.tensor([[0, 0, 2, 2], [0, 0, 2, 2.1], [5, 5, 6, 6]], dtype=torch.float32)
    scores = torch.tensor([0.9, 0.8, 0.7])
    keep, count = torch.empty(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    mmdispatch.nms_impl(boxes, scores, torch.tensor([0, 0, 1]), keep, count, 0.5, 0)
    assert keep[:int(count)].tolist() == [0, 2]
    with pytest.raises(TypeError, match=re.escape("nms_impl: idxs has dtype int32")):
        mmdispatch.nms_impl(boxes, scores, torch.tensor([0, 0, 1], dtype=torch.int32), keep,
                            count, 0.5, 0)


def test_cuda_tensors_run_on_torchs_current_stream(torch_cuda):
    rng = np.random.default_rng(0)
    x = torch_cuda.from_numpy(rng.standard_normal((2, 4, 32, 32))).cuda()
    rois = torch_cuda.tensor([[0, 1, 1, 20, 20], [1, 4, 2, 30, 12]], dtype=torch.float64).cuda()
    expected = mmdispatch.ops.roi_align(x.cpu().numpy(), rois.cpu().numpy(), 7)
    stream = torch_cuda.cuda.Stream()
    empty = torch_cuda.empty(0, dtype=torch.float64, device="cuda")
    streams = []
    with mmdispatch.trace(lambda event, call: streams.append(call.stream)):
        with torch_cuda.cuda.stream(stream):
            out = torch_cuda.empty(2, 4, 7, 7, dtype=torch.float64, device="cuda")
            FWD(x, rois, out, empty, empty, 7, 7, 1.0, 0, 1, True)
    # the launch's stream as the dispatcher hands it to the kernel (a later
    # read on the legacy stream would wait for the kernel wherever it ran)
    assert streams == [stream.cuda_stream] * 2
    stream.synchronize()
    np.testing.assert_allclose(out.cpu().numpy(), expected, rtol=1e-12, atol=1e-12)


def test_views_with_an_offset_and_empty_tensors_are_read_where_they_lie():
    """A contiguous view into a larger tensor (its own data pointer), a
    tensor with no rows, and dtypes of every width reach the kernel as
    they are."""
    args = forward_args()
    base = torch.zeros(5, 3, 6, 6, dtype=torch.float64)
    base[3:] = args[0]
    args[0] = base[3:]
    out = torch.zeros(2, 3, 2, 2, dtype=torch.float64)
    args[2] = out
    FWD(*args, 2, 2, 1.0, 2, 1, True)
    expected = mmdispatch.ops.roi_align(args[0].numpy(), args[1].numpy(), 2, 1.0, 2)
    np.testing.assert_array_equal(out.numpy(), expected)
    args = forward_args()
    args[1] = torch.zeros(0, 5, dtype=torch.float64)
    args[2] = torch.zeros(0, 3, 2, 2, dtype=torch.float64)
    FWD(*args, 2, 2, 1.0, 2, 1, True)
    overlaps = torch.full((2, 3), -1.0, dtype=torch.float32)
    boxes = torch.tensor([[0, 0, 2, 2], [1, 1, 3, 3]], dtype=torch.float32)
    mmdispatch.bbox_overlaps_impl(boxes, boxes[:1].expand(3, 4).contiguous(), overlaps, 0,
                                  False, 0)
    np.testing.assert_allclose(overlaps.numpy(), [[1, 1, 1], [1 / 7] * 3], rtol=1e-6)
