"""The CUDA kernels of src/cuda, run on the CPU by the emulator in
tests/support/cuda_emu and reached through the real dispatcher (arrays on
cuda:0 through __cuda_array_interface__): the CPU kernels' errors on odd
calls, deferred and strict errors as documented, 16-bit storage, launches of
many blocks. Every op's valid cases are compared with the CPU kernels in its
own test file (OpProperties.test_emulated_cuda_kernel_matches_the_cpu_kernel).

These run wherever the sources and a C++ compiler are; on a GPU the kernels
also run for real (the `cupy` and `torch_cuda` tests of each op)."""
import numpy as np
import pytest

import mmdispatch

import cuda_emu
import fuzz_cases
from properties import assert_same, in_signalling_guards

OnGpu = cuda_emu.DeviceView
SEEDS = range(16)


@pytest.fixture
def emu(cuda_emulator):
    """The emulated CUDA kernels in mmdispatch's CUDA slots for the test."""
    with cuda_emulator.active():
        yield cuda_emulator


def on_gpu(arrays):
    return [OnGpu(a) if isinstance(a, np.ndarray) else a for a in arrays]


def call_copies(op_name, seed, count=2):
    """`count` copies of the fuzzer's plausible call of op_name for seed
    (arrays copied, so that each call writes its own outputs)."""
    args, _ = fuzz_cases.plausible_call(op_name, seed)
    return [[a.copy() if isinstance(a, np.ndarray) else a for a in args] for _ in range(count)]


def roi_case(batch_index=1):
    """roi_align_forward_impl's arrays (avg mode): a (2, 3, 9, 9) map, two
    rois, 2x2 bins; the second roi on image `batch_index`."""
    rng = np.random.default_rng(0)
    x = rng.random((2, 3, 9, 9), dtype=np.float32)
    rois = np.array([[0, 0, 0, 5, 5], [batch_index, 2, 1, 8, 6.5]], np.float32)
    unused = np.empty(0, np.float32)
    return [x, rois, np.zeros((2, 3, 2, 2), np.float32), unused, unused.copy()], rois


def outcome(emu, op_name, args):
    """The call's result, or (exception type, message); a kernel's own
    message is the emulator library's (see cuda_emu), prefixed as the
    dispatcher prefixes the CPU kernels'."""
    emu.clear_error()
    try:
        return getattr(mmdispatch, op_name)(*args)
    except Exception as exc:   # compared with the CPU kernel's error
        kernel_message = emu.last_error()
        if isinstance(exc, mmdispatch.DeferredKernelError):
            return type(exc), kernel_message
        return type(exc), f"{op_name}: {kernel_message}" if kernel_message else str(exc)


def test_every_op_has_cuda_kernels_in_the_emulated_build(emu):
    ops = {op for op, _, _, _ in emu.kernels}
    assert ops == set(mmdispatch.op_signatures())


@pytest.mark.parametrize("backend", ["default", "deterministic"])
@pytest.mark.parametrize("op_name", sorted(mmdispatch.op_signatures()))
def test_cuda_kernel_matches_the_cpu_kernel_on_odd_calls(emu, op_name, backend):
    """The fuzzer's plausible calls (NaN and huge rois, empty arrays, wrong
    sizes), in strict mode, so that data errors are raised at the call as
    the CPU kernels raise them: the same results or the same errors, inputs
    left alone and no device memory kept."""
    if backend not in emu.backends(op_name):
        pytest.skip(f"{op_name} has no {backend} CUDA kernel")
    for seed in SEEDS:
        on_cpu, device_copies = call_copies(op_name, seed)
        expected = outcome(emu, op_name, on_cpu)
        live = emu.counters()["live_allocations"]
        with mmdispatch.strict(), mmdispatch.use_backend("cuda", backend):
            got = outcome(emu, op_name, on_gpu(device_copies))
        what = f"{op_name} ({backend}) seed {seed}"
        assert emu.counters()["live_allocations"] == live, what
        if isinstance(expected, tuple) and isinstance(expected[0], type):
            assert got == expected, what
            continue
        assert not (isinstance(got, tuple) and isinstance(got[0], type)), (what, got)
        for cpu, device in zip(on_cpu, device_copies):
            if isinstance(cpu, np.ndarray):
                assert_same(device, cpu)


ORDERS = ["reverse", "shuffle:1", "shuffle:2"]


def bits(result):
    """A call's outcome with every array as its bytes (NaN payloads and
    signs of zero included)."""
    if isinstance(result, tuple) and isinstance(result[0], type):
        return result
    arrays = result if isinstance(result, (tuple, list)) else [result]
    return [np.asarray(a).tobytes() if isinstance(a, np.ndarray) else a for a in arrays]


@pytest.mark.parametrize("op_name", sorted(mmdispatch.op_signatures()))
def test_deterministic_kernels_give_the_same_bits_in_any_order_of_threads_and_blocks(
        emu, op_name, monkeypatch):
    """MMD_EMU_ORDER runs a launch's blocks, a block's threads between
    barriers and its warps at warp operations in reverse or shuffled order
    (a GPU runs them at once): the deterministic backend's results and
    errors on the fuzzer's plausible calls do not change, so no kernel reads
    what another thread writes without a barrier between them."""
    if "deterministic" not in emu.backends(op_name):
        pytest.skip(f"{op_name} has no deterministic CUDA kernel")
    for seed in SEEDS[:8]:
        args, _ = fuzz_cases.plausible_call(op_name, seed)
        results = {}
        for order in ["forward"] + ORDERS:
            monkeypatch.setenv("MMD_EMU_ORDER", order)
            copies = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
            with mmdispatch.strict(), mmdispatch.use_backend("cuda", "deterministic"):
                got = outcome(emu, op_name, on_gpu(copies))
            results[order] = (bits(got), [a.tobytes() for a in copies
                                          if isinstance(a, np.ndarray)])
        for order in ORDERS:
            assert results[order] == results["forward"], (op_name, seed, order)


@pytest.mark.parametrize("order", ORDERS)
def test_tiled_deterministic_roi_align_backward_gives_the_same_bits_in_any_order(
        emu, order, monkeypatch):
    """The tiled kernel (lists built by ballots and warp counts, 4 barriers a
    roi) over 40 channels in two chunks, with non-finite bin gradients:
    the bits of the forward order."""
    rng = np.random.default_rng(7)
    x, rois = roi_workload(rng, np.float32, channels=40, num_rois=60, size=(12, 40))
    grad_output = rng.standard_normal((len(rois), 40, 3, 3)).astype(np.float32)
    grad_output[rng.random(grad_output.shape) < 0.01] = np.nan
    expected = deterministic_avg_backward(x, rois, grad_output, 2)
    monkeypatch.setenv("MMD_EMU_ORDER", order)
    got = deterministic_avg_backward(x, rois, grad_output, 2)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_a_bad_roi_is_deferred_to_the_next_call_and_its_bins_are_nan(emu):
    arrays, _ = roi_case(batch_index=7)
    good, _ = roi_case()
    mmdispatch.roi_align_forward_impl(*on_gpu(good), 2, 2, 1.0, 1, 1, True)
    with mmdispatch.strict(False):
        mmdispatch.roi_align_forward_impl(*on_gpu(arrays), 2, 2, 1.0, 1, 1, True)
    output = arrays[2]
    assert np.isnan(output[1]).all()
    np.testing.assert_array_equal(output[0], good[2][0])
    kind, message = outcome(emu, "roi_align_forward_impl", on_gpu(good) + [2, 2, 1.0, 1, 1, True])
    assert kind is mmdispatch.DeferredKernelError
    assert message.startswith("roi_align_forward_impl: rois[1, 0] (batch index) must be an "
                              "integer in [0, 2) (deferred error: found on cuda:0")
    assert emu.synchronize() == (0, "")   # taken once


def test_roi_pools_bad_roi_is_deferred_and_its_bins_are_nan_with_no_argmax(emu):
    """roi_pool's forward (a thread per output element): every bin of a bad
    roi, in every channel, is NaN with argmax -1, the good roi's are the
    CPU's, and the roi is reported once, as a deferred error."""
    x = np.random.default_rng(3).random((2, 3, 9, 9), dtype=np.float32)
    rois = np.array([[0, 0, 0, 5, 5], [7, 2, 1, 8, 6.5], [1, 1, 2, 8, 8]], np.float32)
    expected, expected_argmax = (np.zeros((3, 3, 2, 3), np.float32),
                                 np.zeros((3, 3, 2, 3), np.int64))
    good = rois[[0, 2, 2]]
    mmdispatch.roi_pool_forward_impl(x, good, expected, expected_argmax, 2, 3, 1.0, 0)
    output, argmax = np.zeros_like(expected), np.zeros_like(expected_argmax)
    with mmdispatch.strict(False):
        mmdispatch.roi_pool_forward_impl(*on_gpu([x, rois, output, argmax]), 2, 3, 1.0, 0)
    assert np.isnan(output[1]).all() and (argmax[1] == -1).all()
    np.testing.assert_array_equal(output[[0, 2]], expected[[0, 2]])
    np.testing.assert_array_equal(argmax[[0, 2]], expected_argmax[[0, 2]])
    status, message = emu.synchronize()
    assert status != 0 and message.startswith("roi_pool_forward_impl: rois[1, 0] (batch index)")
    assert emu.synchronize() == (0, "")   # taken once


def test_roi_aligns_max_mode_defers_a_bad_roi_gives_its_bins_nan_and_adds_nothing_for_it(emu):
    """roi_align's max kernels (a thread per element, channel-major): every
    bin of a bad roi (the last: its first element is not the grid's), in
    every channel, is NaN with argmax -1; the backward adds nothing for it
    even where its argmax entries name cells; the good rois give the CPU's
    results; each call's deferred error names the roi."""
    x = np.random.default_rng(6).random((2, 3, 9, 9), dtype=np.float32)
    rois = np.array([[0, 0, 0, 5, 5], [0, 1, 1, 7, 8], [7, 2, 1, 8, 6.5]], np.float32)
    grad_output = np.random.default_rng(7).random((3, 3, 2, 2), dtype=np.float32)

    def forward(wrap, rois):
        out = [np.zeros((len(rois), 3, 2, 2), np.float32) for _ in range(3)]
        mmdispatch.roi_align_forward_impl(*wrap([x, rois, *out]), 2, 2, 1.0, 2, 0, True)
        return out

    def backward(wrap, rois, argmax_y, argmax_x):
        grad = np.zeros_like(x)
        mmdispatch.roi_align_backward_impl(
            *wrap([grad_output[:len(rois)], rois, argmax_y, argmax_x, grad]), 2, 2, 1.0, 2, 0,
            True)
        return grad

    expected = forward(list, rois[:2])
    with mmdispatch.strict(False):
        got = forward(on_gpu, rois)
        status, message = emu.synchronize()
        assert status != 0 and message.startswith(
            "roi_align_forward_impl: rois[2, 0] (batch index)")
        argmax_y, argmax_x = got[1].copy(), got[2].copy()
        argmax_y[2], argmax_x[2] = expected[1][0], expected[2][0]   # cells on the map
        grad = backward(on_gpu, rois, argmax_y, argmax_x)
        status, message = emu.synchronize()
        assert status != 0 and message.startswith(
            "roi_align_backward_impl: rois[2, 0] (batch index)")
    assert emu.synchronize() == (0, "")   # each call's taken by one synchronize
    assert np.isnan(got[0][2]).all() and (got[1][2] == -1).all() and (got[2][2] == -1).all()
    for a, b in zip(got, expected):
        assert_same(a[:2], b)
    assert_same(grad, backward(list, rois[:2], *expected[1:]))


def test_roi_pools_bad_argmax_entry_is_deferred_under_its_flat_index_and_adds_nothing(emu):
    """roi_pool's default backward runs channel-major (every roi's bins of
    a channel, then the next channel): a bad argmax entry of roi 0, channel
    2 is reported under its flat index in argmax (12), not its thread's
    place (36), and adds nothing; the other entries add as on the CPU."""
    x = np.random.default_rng(4).random((2, 3, 9, 9), dtype=np.float32)
    rois = np.array([[0, 0, 0, 5, 5], [1, 2, 1, 8, 6.5], [1, 1, 2, 8, 8]], np.float32)
    output, argmax = np.zeros((3, 3, 2, 3), np.float32), np.zeros((3, 3, 2, 3), np.int64)
    mmdispatch.roi_pool_forward_impl(x, rois, output, argmax, 2, 3, 1.0, 0)
    grad_output = np.random.default_rng(5).random(output.shape, dtype=np.float32)
    expected, grad = np.zeros_like(x), np.zeros_like(x)
    skipped = argmax.copy()
    skipped[0, 2, 0, 0] = -1
    mmdispatch.roi_pool_backward_impl(grad_output, rois, skipped, expected, 2, 3, 1.0, 0)
    argmax[0, 2, 0, 0] = 10 ** 6
    with mmdispatch.strict(False):
        mmdispatch.roi_pool_backward_impl(*on_gpu([grad_output, rois, argmax, grad]), 2, 3, 1.0, 0)
    assert_same(grad, expected)
    status, message = emu.synchronize()
    assert status != 0 and message.startswith(
        "roi_pool_backward_impl: argmax holds a value outside [-1, 81) at flat index 12")


def test_synchronize_raises_the_deferred_error_of_the_last_call(emu):
    arrays, _ = roi_case(batch_index=-1)
    with mmdispatch.strict(False):
        mmdispatch.roi_align_forward_impl(*on_gpu(arrays), 2, 2, 1.0, 1, 1, True)
    status, message = emu.synchronize()
    assert status != 0
    assert "rois[1, 0] (batch index)" in message and "raised by mmdispatch.synchronize()" in message


def test_strict_mode_raises_a_bad_roi_at_the_call_and_writes_nothing(emu):
    arrays, _ = roi_case(batch_index=2)
    with mmdispatch.strict():
        kind, message = outcome(emu, "roi_align_forward_impl",
                                on_gpu(arrays) + [2, 2, 1.0, 1, 1, True])
    assert kind is ValueError
    assert message == ("roi_align_forward_impl: rois[1, 0] (batch index) must be an integer "
                       "in [0, 2)")
    assert not arrays[2].any()


def roi_workload(rng, dtype, channels=5, num_rois=13, size=(21, 26)):
    """A map larger than one block's work: (2, channels, 21, 26), 13 rois of
    all sizes, some reaching past the map."""
    x = rng.standard_normal((2, channels, *size)).astype(dtype)
    corners = rng.uniform(-4, 30, (num_rois, 2, 2))
    rois = np.concatenate([rng.integers(0, 2, (num_rois, 1)),
                           corners.min(axis=1), corners.max(axis=1)], axis=1).astype(dtype)
    rois[:, 1:] *= 2   # spatial_scale 0.5
    return x, rois


@pytest.mark.parametrize("backend", ["default", "deterministic"])
@pytest.mark.parametrize("sampling_ratio", [0, 2, 20])
@pytest.mark.parametrize("pool_mode", [0, 1])
@pytest.mark.parametrize("aligned", [False, True])
def test_roi_align_forward_and_backward_match_the_cpu_over_many_blocks(
        emu, backend, sampling_ratio, pool_mode, aligned):
    """11 channels: the avg kernels' groups of 8 channels, one of them
    partial; sampling_ratio 20: many samples to a row and a column."""
    rng = np.random.default_rng(sampling_ratio * 4 + pool_mode * 2 + aligned)
    x, rois = roi_workload(rng, np.float64, channels=11)
    shape = (len(rois), x.shape[1], 7, 7)

    def forward(wrap):
        out = [np.zeros(shape), np.zeros(shape), np.zeros(shape)]
        mmdispatch.roi_align_forward_impl(*wrap([x, rois, *out]), 7, 7, 0.5, sampling_ratio,
                                          pool_mode, aligned)
        return out

    def backward(wrap, argmax_y, argmax_x):
        grad = np.zeros_like(x)
        mmdispatch.roi_align_backward_impl(*wrap([grad_output, rois, argmax_y, argmax_x, grad]),
                                           7, 7, 0.5, sampling_ratio, pool_mode, aligned)
        return grad

    grad_output = rng.standard_normal(shape)
    expected = forward(list)
    with mmdispatch.use_backend("cuda", backend):
        got = forward(on_gpu)
        for a, b in zip(got, expected):
            assert_same(a, b)
        assert_same(backward(on_gpu, *got[1:]), backward(list, *expected[1:]))


def deterministic_avg_backward(x, rois, grad_output, sampling_ratio, aligned=True,
                               on_device=True):
    """roi_align's avg backward (spatial_scale 0.5) on the emulated
    deterministic backend (on_device=False: the CPU kernel), into a
    grad_input of 3.0s (the backward adds to what it holds)."""
    unused = np.empty(0, x.dtype)
    grad = np.full(x.shape, 3.0, x.dtype)
    with mmdispatch.use_backend("cuda", "deterministic"):
        mmdispatch.roi_align_backward_impl(
            *(on_gpu if on_device else list)([grad_output, rois, unused, unused.copy(), grad]),
            *grad_output.shape[2:], 0.5, sampling_ratio, 1, aligned)
    return grad


def assert_deterministic_avg_backward_is_the_cpus(x, rois, grad_output):
    """roi_align's avg backward (spatial_scale 0.5, sampling_ratio 2) on the
    emulated deterministic backend gives the CPU kernel's results, to their
    rounding (its sums are in another order: a window's bin rows, then the
    rows' cells; the same bits on every run)."""
    expected = deterministic_avg_backward(x, rois, grad_output, 2, on_device=False)
    assert np.isnan(expected).any() and np.isfinite(expected).any()
    assert_same(deterministic_avg_backward(x, rois, grad_output, 2), expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_deterministic_roi_align_backward_in_bands_matches_the_cpu_with_nonfinite_gradients(
        emu, dtype):
    """The deterministic avg backward holds a band of rows of a plane per
    block (the emulator's bands are a few rows, the last one partial): rois
    across band edges, and bins whose gradient is inf or NaN (their rois
    added sample by sample) give the CPU's bits."""
    rng = np.random.default_rng(7)
    x, rois = roi_workload(rng, dtype, channels=3)
    grad_output = rng.standard_normal((len(rois), 3, 7, 7)).astype(dtype)
    grad_output[2, 1, 3, 4] = np.inf
    grad_output[5, 0, 0, 0] = np.nan
    grad_output[7, 2, 6, 6] = -np.inf
    assert_deterministic_avg_backward_is_the_cpus(x, rois, grad_output)


@pytest.mark.parametrize("pooled", [(16, 16), (3, 5)])
def test_deterministic_roi_align_backward_over_windows_of_more_cells_than_threads(
        emu, pooled):
    """The deterministic avg backward's block (256 threads) steps over a
    roi's window, its bin rows and columns, several elements a thread (a
    300-cell-wide map: a band of one row in the emulator's build, wider than
    the block; 16 x 16 bins: more weights than threads), each thread's (row,
    column) stepped without a division: the CPU's results, rois up to the
    whole map."""
    rng = np.random.default_rng(pooled[0])
    x = rng.standard_normal((2, 2, 24, 300)).astype(np.float32)
    rois = np.array([[0, 0, 0, 600, 48], [1, 10, 4, 590, 40], [0, 300, 6, 420, 30],
                     [1, -20, -10, 640, 60]], np.float32)
    grad_output = rng.standard_normal((len(rois), 2, *pooled)).astype(np.float32)
    grad_output[3, 1, pooled[0] // 2, pooled[1] // 2] = np.nan   # on the map
    assert_deterministic_avg_backward_is_the_cpus(x, rois, grad_output)


@pytest.mark.parametrize("num_rois", [256, 257, 600])
def test_deterministic_roi_align_backward_over_several_chunks_of_rois_matches_the_cpu(
        emu, num_rois):
    """The deterministic avg backward computes the rois' geometry a chunk of
    one roi per thread (256) at a time: a chunk exactly full, one roi past
    it, and several chunks, with inf and NaN bin gradients in the last
    chunk, give the CPU's bits."""
    rng = np.random.default_rng(num_rois)
    x, rois = roi_workload(rng, np.float64, channels=2, num_rois=num_rois, size=(13, 9))
    rois[-2:] = [[0, 2, 2, 10, 12], [1, 4, 4, 14, 16]]   # on the map
    grad_output = rng.standard_normal((num_rois, 2, 3, 3))
    grad_output[num_rois - 1, 1, 2, 2] = np.inf
    grad_output[num_rois - 2, 0, 0, 0] = np.nan
    assert_deterministic_avg_backward_is_the_cpus(x, rois, grad_output)


@pytest.mark.parametrize("dtype,sampling_ratio", [(np.float32, 0), (np.float32, 2),
                                                   (np.float32, 20), (np.float64, 2),
                                                   (np.float16, 0)])
def test_deterministic_roi_align_backward_in_tiles_gives_the_bits_of_its_per_plane_kernel(
        emu, dtype, sampling_ratio):
    """16 channels or more take the tiled kernel (tiles of 8 rows x 32
    cells, 16 of float64, a chunk of 32 channels): 70 channels (a last chunk
    of 6) over a 17 x 40 map (tiles cut at both edges), 300 rois (two
    rounds of the block's list) across tile edges, a NaN, an inf and a -inf
    bin gradient in three channels. Channels of each chunk get the bits the
    per-plane kernel gives them (the same call on 3 channels), and all of
    them the CPU's results to their rounding (float16: no CPU kernel)."""
    rng = np.random.default_rng(sampling_ratio)
    x, rois = roi_workload(rng, dtype, channels=70, num_rois=300, size=(17, 40))
    rois[:, [1, 3]] *= 40 / 26   # the workload's corners span 26 cells: reach across the 40
    rois[[4, 280, 290]] = [[0, 2, 2, 30, 20], [1, 10, 4, 70, 30], [0, 40, 10, 78, 33]]
    grad_output = rng.standard_normal((len(rois), 70, 3, 4)).astype(dtype)
    grad_output[4, 1, 2, 3] = np.nan
    grad_output[280, 33, 0, 0] = np.inf
    grad_output[290, 69, 1, 2] = -np.inf
    tiled = deterministic_avg_backward(x, rois, grad_output, sampling_ratio)
    assert np.isnan(tiled).any() and np.isfinite(tiled).any()
    for c in (0, 32, 67):
        per_plane = deterministic_avg_backward(np.ascontiguousarray(x[:, c:c + 3]), rois,
                                               np.ascontiguousarray(grad_output[:, c:c + 3]),
                                               sampling_ratio)
        np.testing.assert_array_equal(tiled[:, c:c + 3].view(np.uint8), per_plane.view(np.uint8))
    if dtype != np.float16:
        assert_same(tiled, deterministic_avg_backward(x, rois, grad_output, sampling_ratio,
                                                      on_device=False))


@pytest.mark.parametrize("width", [40, 160])
def test_deterministic_roi_align_backward_spreads_a_nonfinite_gradient_past_a_roi_above_the_map(
        emu, width):
    """A roi whose rows lie in [-1, 0) (rows -0.9 to -0.3 of the map):
    its samples read row 0 with weight 1 and row 1 with weight 0, so an inf
    bin gradient gives row 1 NaN (0 * inf), as on the CPU, in the tiled
    kernel (16 channels) and in the per-plane one (3), whose bands are a
    row each at width 160 in the emulator's build (the band of row 1 took
    the roi's window, rows [0, 0], to miss it)."""
    x = np.zeros((1, 16, 12, width), np.float32)
    rois = np.array([[0, 20, -0.8, 60, 0.4]], np.float32)
    grad_output = np.ones((1, 16, 2, 2), np.float32)
    grad_output[0, 0, 0, 0] = np.inf
    tiled = deterministic_avg_backward(x, rois, grad_output, 2)
    per_plane = deterministic_avg_backward(np.ascontiguousarray(x[:, :3]), rois,
                                           np.ascontiguousarray(grad_output[:, :3]), 2)
    expected = deterministic_avg_backward(x, rois, grad_output, 2, on_device=False)
    assert np.isnan(expected[0, 0, 1]).any()
    assert_same(tiled, expected)
    np.testing.assert_array_equal(tiled[:, :3].view(np.uint32), per_plane.view(np.uint32))


@pytest.mark.parametrize("seed", SEEDS)
def test_deterministic_roi_align_backward_tiled_and_per_plane_kernels_agree_on_random_calls(
        emu, seed):
    """Random maps (16, 33 or 40 channels, up to 19 x 35 cells), bins,
    sampling ratios, conventions and rois, tiny and degenerate ones near the
    top left edge among them, with inf, NaN and -0.0 bin gradients (float16
    ones large enough to overflow): each channel's bits from the tiled
    kernel are the per-plane kernel's (the same call on 3 channels)."""
    rng = np.random.default_rng(100 + seed)
    dtype = [np.float32, np.float64, np.float16][seed % 3]
    pooled = [(1, 1), (3, 5), (2, 2), (7, 7)][seed % 4]
    channels = int(rng.choice([16, 33, 40]))
    height, width = int(rng.integers(1, 20)), int(rng.integers(1, 36))
    num_rois = int(rng.integers(1, 40))
    corners = rng.uniform(-6, max(height, width) + 6, (num_rois, 2, 2))
    rois = np.concatenate([rng.integers(0, 2, (num_rois, 1)), corners.min(axis=1),
                           corners.max(axis=1)], axis=1)
    for r in range(0, num_rois, 5):
        y, x = rng.uniform(-1.5, 1.0), rng.uniform(-1.5, width)
        rois[r, 1:] = [x, y, x + rng.choice([0, 1e-3, 0.3]), y + rng.choice([0, 1e-3, 0.4])]
    rois[:, 1:] *= 2   # spatial_scale 0.5
    rois = rois.astype(dtype)
    x = np.zeros((2, channels, height, width), dtype)
    grad_output = rng.standard_normal((num_rois, channels, *pooled))
    with np.errstate(over="ignore"):   # float16's past 65504: inf
        grad_output = (grad_output * (3e4 if dtype == np.float16 else 1)).astype(dtype)
    grad_output[rng.random(grad_output.shape) < 0.002] = np.inf
    grad_output[rng.random(grad_output.shape) < 0.002] = np.nan
    grad_output[rng.random(grad_output.shape) < 0.01] = -0.0
    sampling_ratio, aligned = int(rng.choice([0, 1, 2, 5])), bool(seed % 2)
    tiled = deterministic_avg_backward(x, rois, grad_output, sampling_ratio, aligned)
    for c in range(0, channels, 3):
        per_plane = deterministic_avg_backward(
            np.ascontiguousarray(x[:, c:c + 3]), rois,
            np.ascontiguousarray(grad_output[:, c:c + 3]), sampling_ratio, aligned)
        np.testing.assert_array_equal(tiled[:, c:c + 3].view(np.uint8), per_plane.view(np.uint8))


def test_deterministic_roi_align_backward_in_tiles_repeats_its_bits_and_reports_a_bad_roi(emu):
    """The tiled kernel's results do not depend on the run, and a bad roi
    (batch index 5) is a deferred error naming it, the other rois added."""
    rng = np.random.default_rng(3)
    x, rois = roi_workload(rng, np.float32, channels=16, num_rois=40, size=(12, 40))
    rois[17, 0] = 5
    grad_output = rng.standard_normal((len(rois), 16, 2, 2)).astype(np.float32)
    with mmdispatch.strict(False):
        first = deterministic_avg_backward(x, rois, grad_output, 2)
    status, message = emu.synchronize()
    assert status != 0 and message.startswith("roi_align_backward_impl: rois[17, 0] (batch "
                                              "index)")
    good = np.delete(np.arange(len(rois)), 17)
    second = deterministic_avg_backward(x, rois[good], grad_output[good], 2)
    np.testing.assert_array_equal(first.view(np.uint32), second.view(np.uint32))


def roi_pool_run(x, rois, pooled, convention, grad_output=None):
    """run(wrap) -> (output, argmax[, grad_input]) of roi_pool on x and rois
    (spatial_scale 0.5), on the CPU (wrap=list) or the emulated GPU (on_gpu)."""
    shape = (len(rois), x.shape[1], *pooled)

    def run(wrap):
        out, argmax = np.full(shape, 5.0, x.dtype), np.full(shape, 7, np.int64)
        mmdispatch.roi_pool_forward_impl(*wrap([x, rois, out, argmax]), *pooled, 0.5,
                                         convention)
        if grad_output is None:
            return out, argmax
        grad = np.zeros_like(x)
        mmdispatch.roi_pool_backward_impl(*wrap([grad_output, rois, argmax, grad]), *pooled,
                                          0.5, convention)
        return out, argmax, grad

    return run


@pytest.mark.parametrize("convention", [0, 1])
@pytest.mark.parametrize("backend", ["default", "deterministic"])
def test_roi_pool_forward_and_backward_match_the_cpu_over_many_blocks(emu, backend, convention):
    """11 channels (fewer than 16: the per-element forward, not the chunks);
    torchvision's and MMCV's conventions at spatial_scale 0.5."""
    rng = np.random.default_rng(11)
    x, rois = roi_workload(rng, np.float32, channels=11)
    grad_output = rng.standard_normal((len(rois), x.shape[1], 3, 4)).astype(np.float32)
    run = roi_pool_run(x, rois, (3, 4), convention, grad_output)
    expected = run(list)
    with mmdispatch.use_backend("cuda", backend):
        for got, want in zip(run(on_gpu), expected):
            assert_same(got, want)


def test_roi_pool_forward_skips_nan_cells_and_a_bin_of_only_nans_is_nan_with_no_argmax(emu):
    """The forward's max over a bin passes over NaN cells (a bin of some
    takes the largest other cell, -inf included, at its first place) and
    gives NaN with argmax -1 for a bin of NaNs only, as the CPU does."""
    x = np.arange(2 * 6 * 8, dtype=np.float32).reshape(1, 2, 6, 8) % 7
    x[0, 0, :3, :4] = np.nan                           # bin (0, 0) of channel 0: all NaN
    x[0, 1, :3, :4] = -np.inf
    x[0, 1, 1, 1] = np.nan                             # bin (0, 0) of channel 1: -inf, a NaN
    x[0, 0, 3:, 4:] = np.where(np.arange(12).reshape(3, 4) % 2, np.nan, 3.0)   # NaN, 3.0, ...
    rois = np.array([[0, 0, 0, 7, 5], [0, 1, 1, 6, 4]], np.float32)
    shape = (2, 2, 2, 2)

    def run(wrap):
        out, argmax = np.zeros(shape, np.float32), np.zeros(shape, np.int64)
        mmdispatch.roi_pool_forward_impl(*wrap([x, rois, out, argmax]), 2, 2, 1.0, 0)
        return out, argmax

    expected = run(list)
    assert np.isnan(expected[0][0, 0, 0, 0]) and expected[1][0, 0, 0, 0] == -1
    assert expected[0][0, 1, 0, 0] == -np.inf and expected[1][0, 1, 0, 0] == 0
    assert expected[0][0, 0, 1, 1] == 3.0 and expected[1][0, 0, 1, 1] == 3 * 8 + 4
    for got, want in zip(run(on_gpu), expected):
        assert_same(got, want)


@pytest.mark.parametrize("convention", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels", [16, 45, 70])
def test_roi_pool_chunked_forward_matches_the_cpu_in_chunks_of_32_channels(
        emu, channels, dtype, convention):
    """Forwards of 16 channels or more take the chunked kernel (in the
    emulator's build whatever the call's size; on a GPU where the bins read
    the map's cells twice over or more): the map 32 channels at a time in
    (n, h, w, 32) scratch, a warp per bin and a lane per channel, the last
    chunk partial (45, 70), the output and argmax written chunk by chunk.
    Rois of all sizes across the edges (empty bins: 0, argmax -1), both
    conventions; NaN cells (passed over), a bin of NaNs only (NaN, argmax
    -1) and -inf cells. The backward from that argmax adds as the CPU's."""
    rng = np.random.default_rng(channels + convention)
    x, rois = roi_workload(rng, dtype, channels=channels, num_rois=11)
    x[0, channels - 1, :5, :6] = np.nan                  # roi 0's first bins: NaN only
    x[1, 17 % channels, 3:9, 2:12:2] = np.nan            # some NaN cells
    x[0, 3, :6, :7] = -np.inf                            # roi 0's bins: -inf
    rois[0] = [0, 0, 0, 10, 10]
    rois[1] = [1, 4, 4, 26, 20]
    grad_output = rng.standard_normal((len(rois), channels, 3, 4)).astype(dtype)
    run = roi_pool_run(x, rois, (3, 4), convention, grad_output)
    expected = run(list)
    output, argmax = expected[:2]
    assert np.isnan(output[0, -1, 0, 0]) and argmax[0, -1, 0, 0] == -1
    assert np.isneginf(output[0, 3]).all() and (argmax[0, 3] >= 0).all()
    assert np.isfinite(output).any() and (argmax[2:] == -1).any()   # empty bins
    for got, want in zip(run(on_gpu), expected):
        assert_same(got, want)


def test_roi_pool_chunked_forward_gives_a_bad_rois_bins_nan_in_every_chunk(emu):
    """The chunked kernel (40 channels: two chunks) gives every bin of a bad
    roi NaN with argmax -1 in both chunks, the good rois the CPU's values,
    and the call's deferred error names the roi, once."""
    x = np.random.default_rng(9).random((2, 40, 9, 9), dtype=np.float32)
    rois = np.array([[0, 0, 0, 5, 5], [2, 2, 1, 8, 6.5], [1, 1, 1, 7, 8]], np.float32)
    expected, expected_argmax = roi_pool_run(x, rois[[0, 2]], (2, 3), 0)(list)
    with mmdispatch.strict(False):
        output, argmax = roi_pool_run(x, rois, (2, 3), 0)(on_gpu)
    assert np.isnan(output[1]).all() and (argmax[1] == -1).all()
    np.testing.assert_array_equal(output[[0, 2]], expected)
    np.testing.assert_array_equal(argmax[[0, 2]], expected_argmax)
    status, message = emu.synchronize()
    assert status != 0 and message.startswith("roi_pool_forward_impl: rois[1, 0] (batch index)")
    assert emu.synchronize() == (0, "")


@pytest.mark.parametrize("dtype,pooled", [(np.float32, (8, 16)), (np.float32, (11, 12)),
                                          (np.float64, (8, 12)), (np.float64, (1, 97))])
def test_roi_pool_with_many_bins_matches_the_cpu_on_either_side_of_the_shared_limit(
        emu, dtype, pooled):
    """The chunked kernel holds a chunk's 32 channels of maxima and argmaxes
    in 48 KB of shared memory: 128 float bins (8 x 16) or 96 double bins
    (8 x 12) fit, and more (11 x 12, 1 x 97) take the per-element kernel."""
    rng = np.random.default_rng(pooled[0] * pooled[1])
    x, rois = roi_workload(rng, dtype, channels=20, num_rois=3, size=(17, 19))
    grad_output = rng.standard_normal((3, 20, *pooled)).astype(dtype)
    run = roi_pool_run(x, rois, pooled, 0, grad_output)
    for got, want in zip(run(on_gpu), run(list)):
        assert_same(got, want)


def test_roi_pool_chunked_float16_matches_the_cpu_in_float32(emu):
    """float16 maps through the chunked kernel (computed in float32): the
    CPU's float32 maxima on the same values, to float16's rounding, and the
    same argmax."""
    rng = np.random.default_rng(16)
    x, rois = roi_workload(rng, np.float16, channels=36, num_rois=7)
    got = roi_pool_run(x, rois, (3, 3), 0)(on_gpu)
    expected = roi_pool_run(x.astype(np.float32), rois.astype(np.float32), (3, 3), 0)(list)
    assert got[0].dtype == np.float16
    assert_same(got[0], expected[0].astype(np.float16))
    assert_same(got[1], expected[1])


@pytest.mark.parametrize("pooled", [(7, 7), (2, 3)])
def test_deterministic_roi_pool_backward_over_many_rois_and_chunks_matches_the_cpu(
        emu, pooled):
    """The deterministic backward reads ahead (32 rois' geometry at once,
    then 8 chunks of 32 bins): 75 rois (groups of 32, 32 and 11) on two
    images, 7 x 7 bins (chunks of 32 and 17) or 2 x 3 (several rois' chunks
    to a read-ahead), overlapping so that bins of many rois share an argmax;
    equal to the CPU's and the same bits on a second run."""
    rng = np.random.default_rng(pooled[0])
    x, rois = roi_workload(rng, np.float32, channels=3, num_rois=75)
    shape = (len(rois), x.shape[1], *pooled)
    out, argmax = np.zeros(shape, np.float32), np.zeros(shape, np.int64)
    mmdispatch.roi_pool_forward_impl(x, rois, out, argmax, *pooled, 0.5, 0)
    grad_output = rng.standard_normal(shape).astype(np.float32)
    expected = np.zeros_like(x)
    mmdispatch.roi_pool_backward_impl(grad_output, rois, argmax, expected, *pooled, 0.5, 0)
    runs = []
    with mmdispatch.use_backend("cuda", "deterministic"):
        for _ in range(2):
            grad = np.zeros_like(x)
            mmdispatch.roi_pool_backward_impl(*on_gpu([grad_output, rois, argmax, grad]),
                                              *pooled, 0.5, 0)
            runs.append(grad)
    assert_same(runs[0], expected)
    assert runs[0].tobytes() == runs[1].tobytes()


@pytest.mark.parametrize("channels", [3, 20])
@pytest.mark.parametrize("width", [60, 70])
@pytest.mark.parametrize("sampling_ratio", [0, 24])
def test_roi_align_bins_of_many_cells_match_the_cpu_walked_or_sample_by_sample(
        emu, sampling_ratio, width, channels):
    """One bin per roi, 40 to 55 cells a side: the avg kernels walk many
    rows and columns of merged weights (nothing caps them), and on a map
    wider than the emulator's walk limit (64; INT_MAX on a GPU) they sum
    sample by sample; 20 channels: the forward's transposed kernels."""
    rng = np.random.default_rng(sampling_ratio)
    x = rng.standard_normal((1, channels, 50, width))
    rois = np.array([[0, 0, 0, 45, 48], [0, 5, 2, 60, 50], [0, 1, 1, 3, 3]], np.float64)
    grad_output = rng.standard_normal((3, channels, 1, 1))
    unused = np.empty(0)

    def run(wrap):
        out, grad = np.zeros((3, channels, 1, 1)), np.zeros_like(x)
        mmdispatch.roi_align_forward_impl(*wrap([x, rois, out, unused, unused.copy()]), 1, 1,
                                          1.0, sampling_ratio, 1, True)
        mmdispatch.roi_align_backward_impl(*wrap([grad_output, rois, unused, unused.copy(),
                                                  grad]), 1, 1, 1.0, sampling_ratio, 1, True)
        return out, grad

    for got, expected in zip(run(on_gpu), run(list)):
        assert_same(got, expected)


def chunked_calls(x, rois, grad_output):
    """(name, run(wrap)) of the chunked kernels' calls on x (spatial_scale
    0.5, 3 x 2 bins): roi_align's avg forward and backward (sampling_ratio
    2) and roi_pool's forward, each returning its outputs."""
    unused = np.empty(0, x.dtype)

    def align_forward(wrap):
        out = np.full(grad_output.shape, 5.0, x.dtype)
        mmdispatch.roi_align_forward_impl(*wrap([x, rois, out, unused, unused.copy()]), 3, 2,
                                          0.5, 2, 1, True)
        return [out]

    def align_backward(wrap):
        grad = np.full(x.shape, 3.0, x.dtype)
        mmdispatch.roi_align_backward_impl(*wrap([grad_output, rois, unused, unused.copy(), grad]),
                                           3, 2, 0.5, 2, 1, True)
        return [grad]

    return [("roi_align forward", align_forward), ("roi_align backward", align_backward),
            ("roi_pool forward", lambda wrap: list(roi_pool_run(x, rois, (3, 2), 1)(wrap)))]


def test_chunked_kernels_take_two_chunks_a_launch_and_halve_the_group_without_the_memory(emu):
    """The emulator's build gives a launch of the chunked kernels at most 2
    chunks of 32 channels (MMD_CUDA_CHUNK_GROUP_MAX): 70 channels are two
    groups, 64 and 6 channels, a transposition and a launch of the bins'
    kernel each. Where the device has no memory for a group's scratch the
    group is halved (three groups of a chunk: two launches more), and where
    it has none for a chunk's the per-element kernels run (one launch).
    The CPU's results every time."""
    rng = np.random.default_rng(5)
    x, rois = roi_workload(rng, np.float64, channels=70, num_rois=9, size=(11, 14))
    grad_output = rng.standard_normal((len(rois), 70, 3, 2))
    chunk_bytes = 2 * 11 * 14 * 32 * 8   # (batch, cells, 32 channels) of float64
    for name, run in chunked_calls(x, rois, grad_output):
        expected = run(list)
        launches = {}
        for limit in (0, 2 * chunk_bytes - 1, chunk_bytes - 1):   # 0: no limit
            with emu.scratch_limit(limit):
                before = emu.counters()["launches"]
                got = run(on_gpu)
                launches[limit] = emu.counters()["launches"] - before
            for a, b in zip(got, expected):
                assert_same(a, b)
        assert launches[2 * chunk_bytes - 1] - launches[0] == 2, name
        assert launches[0] - launches[chunk_bytes - 1] >= 3, name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels", [16, 45, 70])
@pytest.mark.parametrize("sampling_ratio", [0, 2, 20])
def test_roi_align_transposed_avg_forward_matches_the_cpu_in_chunks_of_32_channels(
        emu, dtype, channels, sampling_ratio):
    """Avg forwards of 16 channels or more take the transposed kernels (in
    the emulator's build whatever the call's size; on a GPU where the bins'
    samples read the map's cells twice over or more): the map 32 channels at
    a time in (n, h, w, 32) scratch, a warp per bin and a lane per channel,
    the last chunk partial (45, 70), the output written chunk by chunk. Rois
    of all sizes across the edges; an inf and a NaN cell (their bins summed
    sample by sample from the map, as the definition gives them)."""
    rng = np.random.default_rng(channels + sampling_ratio)
    x, rois = roi_workload(rng, dtype, channels=channels, num_rois=9, size=(11, 14))
    x[1, channels - 1, 3, 4] = np.inf
    x[0, 17 % channels, 5, 5] = np.nan
    rois[:2] = [[0, 4, 4, 16, 14], [1, 2, 2, 12, 12]]   # over both cells
    # at sampling_ratio 2, bin (1, 0)'s samples at x = 3.0 (weight 0 on the
    # inf cell's column 4: 0 * inf is NaN) and x = 4.0 (weight 1): NaN, where
    # the walk's merged weight 1 would give inf
    rois[2] = [1, 6, 5, 14, 11]
    shape = (len(rois), channels, 3, 2)
    unused = np.empty(0, dtype)

    def run(wrap):
        out = np.full(shape, 5.0, dtype)
        mmdispatch.roi_align_forward_impl(*wrap([x, rois, out, unused, unused.copy()]), 3, 2,
                                          0.5, sampling_ratio, 1, True)
        return out

    expected = run(list)
    assert np.isnan(expected).any() and np.isinf(expected).any() and np.isfinite(expected).any()
    assert np.isnan(expected[2, -1, 1, 0]) or sampling_ratio == 20
    assert_same(run(on_gpu), expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels", [16, 45, 70])
@pytest.mark.parametrize("sampling_ratio", [0, 2, 20])
def test_roi_align_transposed_avg_backward_adds_what_the_cpu_adds_in_chunks_of_32_channels(
        emu, dtype, channels, sampling_ratio):
    """The default avg backward of 16 channels or more takes the transposed
    kernels (as the forward): each chunk's bins add into (n, h, w, 32)
    scratch, a lane per channel, then the scratch into grad_input, which is
    accumulated into. Bins whose gradient is inf or NaN are added sample by
    sample straight into grad_input; a bad roi adds nothing and is reported.
    With negative gradients (a zero weight adds -0.0) the cells no sample
    weighs keep their bits, -0.0 and a signalling NaN included."""
    rng = np.random.default_rng(channels * 7 + sampling_ratio)
    x = np.zeros((2, channels, 11, 14), dtype)
    rois = np.array([[0, 0, 0, 10, 8], [1, 2, 2, 14, 12], [0, -6, -4, 6, 6],
                     [5, 2, 2, 20, 16],   # a bad roi (batch index), on the map
                     [1, 0, 0, 16, 12], [0, 10, 6, 30, 24], [0, 4, 4, 12, 10],
                     [1, 1, 1, 3, 3], [0, 14, 2, 22, 18]], dtype)   # image 1's far corner: none
    grad_output = -abs(rng.standard_normal((len(rois), channels, 3, 2))).astype(dtype)
    grad_output[1, channels - 1, 2, 1] = -np.inf
    grad_output[6, 17 % channels, 0, 0] = np.nan
    prefill = np.where(rng.random(x.shape) < 0.5, -0.0, 0.25).astype(dtype)
    nan_bits = {np.float32: (np.uint32, 0x7FA00000), np.float64: (np.uint64, 0x7FF4000000000000)}
    bits, signalling = nan_bits[dtype]
    unused = np.empty(0, dtype)

    def run(wrap, rois):
        grad = prefill.copy()
        mmdispatch.roi_align_backward_impl(*wrap([grad_output, rois, unused, unused.copy(),
                                                  grad]), 3, 2, 0.5, sampling_ratio, 1, True)
        return grad

    good = rois.copy()
    good[3, 0] = 0
    expected_all = run(list, good)
    # roi 3 adds nothing: the CPU's sum without it
    without = grad_output.copy()
    grad_output[3] = 0
    expected = run(list, good)
    grad_output[3] = without[3]
    assert np.isnan(expected).any() and np.isfinite(expected).any()
    assert not np.array_equal(expected, expected_all, equal_nan=True)
    # a signalling NaN in a cell no sample weighs, which any add would quiet
    quiet = np.flatnonzero(expected.view(bits) == prefill.view(bits))
    prefill.view(bits).flat[quiet[len(quiet) // 2]] = signalling
    expected = np.where(prefill.view(bits) == signalling, prefill, expected)
    with mmdispatch.strict(False):
        got = run(on_gpu, rois)
        status, message = emu.synchronize()
    assert status != 0 and message.startswith("roi_align_backward_impl: rois[3, 0] (batch index)")
    signalling_cell = prefill.view(bits) == signalling
    assert_same(np.where(signalling_cell, 0, got), np.where(signalling_cell, 0, expected))
    untouched = expected.view(bits) == prefill.view(bits)
    assert (prefill.view(bits) == signalling).sum() == 1 and (~untouched).any()
    np.testing.assert_array_equal(got.view(bits)[untouched], prefill.view(bits)[untouched])


@pytest.mark.parametrize("channels", [15, 16])
def test_roi_align_avg_backward_zero_gradients_give_the_cpus_signs_of_zero(emu, channels):
    """Zero bin gradients (rois masked out of a loss) add +0.0, which turns
    a -0.0 cell into +0.0 on the CPU: the per-bin kernel (15 channels) and
    the transposed one (16: its scratch starts at -0.0, so that a sum of
    +0.0 is told from a cell no bin reached) give the CPU's bits, the cells
    no bin reached staying -0.0. (Where gradients cancel, the sign of the
    zero depends on the order of the adds, on the CPU too.)"""
    rng = np.random.default_rng(channels)
    x = np.zeros((1, channels, 9, 11), np.float32)
    rois = np.array([[0, 2, 2, 12, 10], [0, 1, 1, 5, 6], [0, 6, 4, 18, 16]], np.float32)
    grad_output = rng.standard_normal((3, channels, 3, 2)).astype(np.float32)
    grad_output[2] = 0
    prefill = np.full(x.shape, -0.0, np.float32)
    unused = np.empty(0, np.float32)

    def run(wrap):
        grad = prefill.copy()
        mmdispatch.roi_align_backward_impl(*wrap([grad_output, rois, unused, unused.copy(),
                                                  grad]), 3, 2, 0.5, 2, 1, True)
        return grad

    expected = run(list)
    got = run(on_gpu)
    zeros = expected == 0
    assert np.signbit(expected[zeros]).any() and not np.signbit(expected[zeros]).all()
    np.testing.assert_array_equal(np.signbit(got[zeros]), np.signbit(expected[zeros]))
    assert_same(got, expected)


@pytest.mark.parametrize("shape", [(1, 32, 0, 5), (1, 32, 5, 0), (0, 32, 5, 5)])
def test_roi_align_on_a_map_without_cells_and_many_channels_launches_nothing_it_cannot(
        emu, shape):
    """A map with no cells (or no image) and 32 channels takes the per-bin
    kernels, as with fewer channels: the transposed kernels' grids would be
    empty (a launch CUDA refuses). Every bin reads zeros outside the map."""
    x = np.zeros(shape, np.float32)
    rois = np.array([[0, 0, 0, 3, 3]] * 2, np.float32)
    unused = np.empty(0, np.float32)
    if shape[0] == 0:
        rois = rois[:0]
    out = np.full((len(rois), 32, 2, 2), 5.0, np.float32)
    expected = out.copy()
    mmdispatch.roi_align_forward_impl(x, rois, expected, unused, unused.copy(), 2, 2, 1.0, 2, 1,
                                      True)
    grad = np.zeros_like(x)
    with mmdispatch.strict(False):
        mmdispatch.roi_align_forward_impl(*on_gpu([x, rois, out, unused, unused.copy()]), 2, 2,
                                          1.0, 2, 1, True)
        mmdispatch.roi_align_backward_impl(*on_gpu([out, rois, unused, unused.copy(), grad]),
                                           2, 2, 1.0, 2, 1, True)
        assert emu.synchronize() == (0, "")
    assert_same(out, expected)


@pytest.mark.parametrize("dtype,pooled", [(np.float32, (16, 24)), (np.float32, (20, 20)),
                                          (np.float64, (12, 16)), (np.float64, (1, 193))])
def test_roi_align_avg_with_many_bins_matches_the_cpu_on_either_side_of_the_shared_limit(
        emu, dtype, pooled):
    """The transposed kernels hold a chunk's 32 channels of bins in 48 KB of
    shared memory: 384 float bins (16 x 24) or 192 double bins (12 x 16)
    fit, and more (20 x 20, 1 x 193) take the per-bin kernels."""
    rng = np.random.default_rng(pooled[0] * pooled[1])
    x, rois = roi_workload(rng, dtype, channels=20, num_rois=3, size=(9, 11))
    grad_output = rng.standard_normal((3, 20, *pooled)).astype(dtype)
    unused = np.empty(0, dtype)

    def run(wrap):
        out, grad = np.zeros((3, 20, *pooled), dtype), np.zeros_like(x)
        mmdispatch.roi_align_forward_impl(*wrap([x, rois, out, unused, unused.copy()]),
                                          *pooled, 0.5, 2, 1, True)
        mmdispatch.roi_align_backward_impl(*wrap([grad_output, rois, unused, unused.copy(),
                                                  grad]), *pooled, 0.5, 2, 1, True)
        return out, grad

    for got, expected in zip(run(on_gpu), run(list)):
        assert_same(got, expected)


@pytest.mark.parametrize("channels", [20, 40])
def test_roi_align_transposed_float16_matches_the_cpu_in_float32(emu, channels):
    """float16 maps (computed in float32, the backward summed in float32
    scratch) through the transposed kernels: the CPU's float32 results on
    the same values, to float16's rounding."""
    rng = np.random.default_rng(channels)
    x, rois = roi_workload(rng, np.float16, channels=channels, num_rois=7, size=(10, 12))
    grad_output = rng.standard_normal((7, channels, 3, 3)).astype(np.float16)

    def run(wrap, dtype):
        unused = np.empty(0, dtype)
        out, grad = np.zeros((7, channels, 3, 3), dtype), np.zeros(x.shape, dtype)
        mmdispatch.roi_align_forward_impl(*wrap([x.astype(dtype), rois.astype(dtype), out,
                                                 unused, unused.copy()]), 3, 3, 0.5, 0, 1, True)
        mmdispatch.roi_align_backward_impl(*wrap([grad_output.astype(dtype), rois.astype(dtype),
                                                  unused, unused.copy(), grad]), 3, 3, 0.5, 0,
                                           1, True)
        return out, grad

    for got, expected in zip(run(on_gpu, np.float16), run(list, np.float32)):
        assert got.dtype == np.float16
        assert_same(got, expected.astype(np.float16))


def test_roi_align_transposed_avg_forward_gives_a_bad_rois_bins_nan_in_every_chunk(emu):
    """The transposed kernels (40 channels: two chunks) give every bin of a
    bad roi NaN in both chunks, the good rois the CPU's values, and the
    call's deferred error names the roi."""
    x = np.random.default_rng(8).random((2, 40, 9, 9), dtype=np.float32)
    rois = np.array([[0, 0, 0, 5, 5], [2, 2, 1, 8, 6.5], [1, 1, 1, 7, 8]], np.float32)
    unused = np.empty(0, np.float32)

    def run(wrap, rois):
        out = np.zeros((len(rois), 40, 2, 2), np.float32)
        mmdispatch.roi_align_forward_impl(*wrap([x, rois, out, unused, unused.copy()]), 2, 2,
                                          1.0, 2, 1, True)
        return out

    expected = run(list, rois[[0, 2]])
    with mmdispatch.strict(False):
        got = run(on_gpu, rois)
        status, message = emu.synchronize()
    assert status != 0 and message.startswith("roi_align_forward_impl: rois[1, 0] (batch index)")
    assert np.isnan(got[1]).all()
    assert_same(got[[0, 2]], expected)


@pytest.mark.parametrize("lead", [0, 1, 2, 3])
@pytest.mark.parametrize("channels,height,width", [(11, 12, 12), (11, 12, 13), (9, 12, 14),
                                                    (11, 12, 15), (3, 13, 13), (1, 13, 15)])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_roi_align_float32_backward_in_windows_of_four_cells_adds_what_the_cpu_adds(
        emu, channels, height, width, sampling_ratio, lead):
    """float32 avg backward on devices with vector atomics (the emulator has
    them): a row's cells in windows of the 4 of an aligned address, one
    vector atomic per window and channel, where the planes are a multiple of
    4 cells apart (12 rows) or there is one channel; each row's phase in its
    4 differs with the width. Rois across the map's edges (windows cut by a
    row's ends take single atomics). grad_input is accumulated into: the
    cells no sample reads with a weight keep their bits (-0.0, NaN) although
    a window adds to them; grad_input starts 0 to 3 floats past a 16-byte
    boundary, and no window reaches the cells before or after it."""
    rng = np.random.default_rng(channels * 100 + width + sampling_ratio)
    x = rng.standard_normal((2, channels, height, width)).astype(np.float32)
    corners = rng.uniform(-3, [width + 2, height + 2], (40, 2, 2))
    rois = np.concatenate([rng.integers(0, 2, (40, 1)), corners.min(axis=1),
                           corners.max(axis=1)], axis=1).astype(np.float32)
    rois[:4, 1:] = [[0, 0, width - 1, height - 1], [0.5, 0.25, 1.75, 1.5],
                    [width - 2.5, 3, width + 1, 9], [-2, -2, 2.2, 2.6]]
    rois[4] = [1, width - 3.5, height - 2.5, width + 1, height + 1]   # the map's last cells
    # negative: a sample's zero weight adds -0.0, so a -0.0 cell that only
    # such samples read stays -0.0 in any order of the adds, as it does
    # where a window adds -0.0
    grad_output = -abs(rng.standard_normal((40, channels, 3, 3))).astype(np.float32)
    prefill = np.where(rng.random(x.shape) < 0.5, np.float32(-0.0), np.float32(0.25))
    prefill[0, 0, height - 1, width - 1] = np.nan
    unused = np.empty(0, np.float32)

    def run(wrap, grad):
        mmdispatch.roi_align_backward_impl(*wrap([grad_output, rois, unused, unused.copy(),
                                                  grad]), 3, 3, 1.0, sampling_ratio, 1, True)
        return grad

    expected = run(list, prefill.copy())
    got, guards_untouched = in_signalling_guards(prefill, lead)
    run(on_gpu, got)
    assert guards_untouched()
    assert_same(got, expected)
    untouched = expected.view(np.uint32) == prefill.view(np.uint32)
    assert untouched.any() and (~untouched).any()
    np.testing.assert_array_equal(got.view(np.uint32)[untouched],
                                  prefill.view(np.uint32)[untouched])


@pytest.mark.parametrize("op_name", ["roi_align_forward_impl", "roi_pool_forward_impl",
                                     "bbox_overlaps_impl", "nms_impl", "soft_nms_impl"])
def test_float16_kernels_match_the_float32_cpu_kernels(emu, op_name):
    """float16 arrays compute in float32 on CUDA: on values float16 holds
    exactly, the results are the float32 CPU results rounded once."""
    rng = np.random.default_rng(5)
    x, rois = roi_workload(rng, np.float32)
    x, rois = x.astype(np.float16).astype(np.float32), np.round(rois)
    boxes = np.round(rng.uniform(0, 40, (60, 4))).astype(np.float32)
    boxes[:, 2:] += boxes[:, :2] + 1
    scores = rng.permutation(60).astype(np.float32) / 64
    pooled = (len(rois), x.shape[1], 3, 3)
    calls = {
        "roi_align_forward_impl": lambda dt: [x.astype(dt), rois.astype(dt), np.zeros(pooled, dt),
                                              np.zeros(pooled, dt), np.zeros(pooled, dt),
                                              3, 3, 0.5, 2, 1, True],
        "roi_pool_forward_impl": lambda dt: [x.astype(dt), rois.astype(dt), np.zeros(pooled, dt),
                                             np.zeros(pooled, np.int64), 3, 3, 0.5, 1],
        "bbox_overlaps_impl": lambda dt: [boxes.astype(dt), boxes[:17].astype(dt),
                                          np.zeros((60, 17), dt), 0, False, 0],
        "nms_impl": lambda dt: [boxes.astype(dt), scores.astype(dt), None, np.zeros(60, np.int64),
                                np.zeros(1, np.int64), 0.3, 0],
        "soft_nms_impl": lambda dt: [boxes.astype(dt), scores.astype(dt), None,
                                     np.zeros((60, 5), dt), np.zeros(60, np.int64),
                                     np.zeros(1, np.int64), 0.3, 0.5, 1e-3, 1, 0],
    }
    expected = calls[op_name](np.float32)
    getattr(mmdispatch, op_name)(*expected)
    got = calls[op_name](np.float16)
    getattr(mmdispatch, op_name)(*on_gpu(got))
    for a, b in zip(got, expected):
        if isinstance(a, np.ndarray):
            if a.dtype == np.float16:
                b = b.astype(np.float16)
            assert_same(a, b)


def test_a_launch_cuda_would_refuse_fails_the_call(emu):
    """The emulator enforces CUDA's launch limits: the deterministic
    roi_align backward's shared memory grows with the map, and a map too
    large for it is refused before anything runs."""
    x = np.zeros((1, 1, 4000, 4000), np.float32)
    rois = np.array([[0, 0, 0, 10, 10]], np.float32)
    grad_output = np.ones((1, 1, 7, 7), np.float32)
    unused = np.empty(0, np.float32)
    with mmdispatch.use_backend("cuda", "deterministic"):
        kind, message = outcome(emu, "roi_align_backward_impl",
                                on_gpu([grad_output, rois, unused, unused.copy(), x])
                                + [7, 7, 1.0, 2, 1, True])
    assert kind is ValueError
    assert "the deterministic backend needs" in message and "shared memory" in message
    assert not x.any()


@pytest.mark.parametrize("classes", [1, 7])
@pytest.mark.parametrize("n,threshold", [(1000, 0.5), (333, 0.1), (700, 0.8)])
def test_nms_over_many_64_box_blocks_keeps_what_the_cpu_keeps(emu, n, threshold, classes):
    """Enough boxes for the device pipeline's block-by-block reduction: its
    fold of each block's kept boxes into the later blocks, with few columns
    (many threads to a column) and many, its words in shared memory (333
    boxes) and in global memory (the emulator's build moves them there
    past 512 boxes)."""
    rng = np.random.default_rng(n + classes)
    corners = rng.uniform(0, 150, (n, 2))
    boxes = np.concatenate([corners, corners + rng.uniform(4, 80, (n, 2))], axis=1)
    scores = rng.permutation(n).astype(np.float64)
    idxs = rng.integers(0, classes, n) if classes > 1 else None

    def run(wrap):
        keep, count = np.zeros(n, np.int64), np.zeros(1, np.int64)
        mmdispatch.nms_impl(*wrap([boxes, scores, idxs, keep, count]), threshold, 0)
        return keep[:count[0]]

    expected = run(list)
    assert 0 < len(expected) < n
    np.testing.assert_array_equal(run(on_gpu), expected)


def test_scratch_memory_is_kept_across_synchronisations_until_empty_cache(emu):
    """The kernels' scratch (here nms's sort buffers and mask) comes from
    mmdispatch's own pool, which keeps what was freed when the device is
    synchronised (CUDA's default pool would return it to the driver, and
    the next call would map it again): a second call after a
    synchronisation maps nothing new. empty_cache releases it all."""
    n = 300
    rng = np.random.default_rng(1)
    corners = rng.uniform(0, 150, (n, 2))
    boxes = np.concatenate([corners, corners + rng.uniform(4, 80, (n, 2))], axis=1)
    scores = rng.random(n)

    def run():
        keep, count = np.zeros(n, np.int64), np.zeros(1, np.int64)
        mmdispatch.nms_impl(*on_gpu([boxes, scores, None, keep, count]), 0.5, 0)
        assert emu.synchronize() == (0, "")
        return keep[:count[0]]

    live = emu.counters()["live_allocations"]
    expected = run()
    after_first = emu.counters()
    assert after_first["pool_kept_bytes"] >= n * 8 * ((n + 63) // 64)   # the mask at least
    np.testing.assert_array_equal(run(), expected)
    after_second = emu.counters()
    assert after_second["pool_maps"] == after_first["pool_maps"]
    assert after_second["live_allocations"] == live
    assert emu.empty_cache() == 0
    assert emu.counters()["pool_kept_bytes"] == 0
    np.testing.assert_array_equal(run(), expected)
    assert emu.counters()["pool_maps"] > after_second["pool_maps"]


@pytest.mark.parametrize("method", [0, 1, 2])
@pytest.mark.parametrize("classes", [1, 7])
def test_soft_nms_over_more_boxes_than_the_block_has_threads_equals_the_cpu(emu, classes,
                                                                            method):
    """1,300 boxes: each of the block's 512 threads holds two or three, and
    every step's choice goes through all 16 warps' reduction."""
    rng = np.random.default_rng(classes)
    n = 1300
    corners = rng.uniform(0, 300, (n, 2))
    boxes = np.concatenate([corners, corners + rng.uniform(4, 60, (n, 2))], axis=1)
    scores = rng.random(n)
    scores[rng.random(n) < 0.2] = 0.5                         # ties
    idxs = rng.integers(0, classes, n) if classes > 1 else None

    def run(wrap):
        dets, keep, count = np.zeros((n, 5)), np.zeros(n, np.int64), np.zeros(1, np.int64)
        mmdispatch.soft_nms_impl(*wrap([boxes, scores, idxs, dets, keep, count]), 0.3, 0.5,
                                 0.05, method, 0)
        return dets[:count[0]], keep[:count[0]]

    expected = run(list)
    assert 0 < len(expected[1]) < n
    for got, want in zip(run(on_gpu), expected):
        np.testing.assert_array_equal(got, want)


def test_batched_soft_nms_spares_only_the_first_box_of_all_from_min_score(emu):
    """The definition's first step: every class but the first box's drops
    its boxes below min_score before its own first selection."""
    boxes = np.array([[0, 0, 1, 1], [5, 5, 6, 6], [9, 9, 10, 10], [20, 20, 21, 21]], np.float32)
    scores = np.array([0.01, 0.02, 0.03, 0.5], np.float32)
    for idxs, expected in ((np.array([0, 1, 1, 2]), [3]), (np.array([0, 0, 1, 0]), [3])):
        for low_first in (False, True):
            s = scores if not low_first else np.array([0.04, 0.02, 0.03, 0.01], np.float32)
            want = [0] if low_first else expected
            dets, keep, count = np.zeros((4, 5), np.float32), np.zeros(4, np.int64), \
                np.zeros(1, np.int64)
            mmdispatch.soft_nms_impl(*on_gpu([boxes, s, idxs, dets, keep, count]), 0.3, 0.5,
                                     0.1, 1, 0)
            np.testing.assert_array_equal(keep[:count[0]], want)


@pytest.mark.parametrize("method", [0, 1, 2])
def test_batched_soft_nms_whose_decays_raise_negative_scores_equals_the_cpu(emu, method):
    """Negative scores: a decay (towards 0) can raise a score, so a class's
    selections can be out of the output order; the call is then redone by
    the one-block kernel."""
    rng = np.random.default_rng(method)
    n = 300
    corners = rng.integers(0, 40, (n, 2)).astype(np.float64)
    boxes = np.concatenate([corners, corners + rng.integers(2, 15, (n, 2))], axis=1)
    scores = np.round(rng.uniform(-1, 1, n), 2)
    idxs = rng.integers(0, 4, n)

    def run(wrap, min_score):
        dets, keep, count = np.zeros((n, 5)), np.zeros(n, np.int64), np.zeros(1, np.int64)
        mmdispatch.soft_nms_impl(*wrap([boxes, scores, idxs, dets, keep, count]), 0.3, 0.5,
                                 min_score, method, 0)
        return dets[:count[0]], keep[:count[0]]

    for min_score in (-np.inf, -0.5, 0.2):
        for got, want in zip(run(on_gpu, min_score), run(list, min_score)):
            np.testing.assert_array_equal(got, want)


def test_nms_rotated_over_many_64_box_blocks_keeps_what_the_cpu_keeps(emu):
    rng = np.random.default_rng(9)
    n = 300
    boxes = np.concatenate([rng.uniform(0, 200, (n, 2)), rng.uniform(5, 60, (n, 2)),
                            rng.uniform(-np.pi, np.pi, (n, 1))], axis=1)
    scores = rng.permutation(n).astype(np.float64)

    def run(wrap):
        keep, count = np.zeros(n, np.int64), np.zeros(1, np.int64)
        mmdispatch.nms_rotated_impl(*wrap([boxes, scores, None, keep, count]), 0.3, True)
        return keep[:count[0]]

    expected = run(list)
    assert 0 < len(expected) < n
    np.testing.assert_array_equal(run(on_gpu), expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("rows,cols", [(150, 130), (1, 1), (64, 64), (3, 200), (200, 3)])
@pytest.mark.parametrize("mode", [0, 1])
def test_box_iou_rotated_tables_of_many_64_box_tiles_equal_the_cpu(emu, dtype, rows, cols, mode):
    """The table kernel's tiles: a block makes a tile's row and column boxes
    ready once in shared memory, and its threads take the tile's pairs;
    partial tiles on both sides, narrow and tall tables, more row tiles than
    the grid's height (2 in the emulator's build), undefined boxes. float16
    is computed in double and stored through float32, as the CPU's float64
    result rounded so."""
    rng = np.random.default_rng(rows * cols + mode)

    def boxes(n):
        b = np.concatenate([rng.uniform(0, 100, (n, 2)), rng.uniform(5, 60, (n, 2)),
                            rng.uniform(-np.pi, np.pi, (n, 1))], axis=1)
        b[::17, 2] = np.nan
        return b.astype(dtype)

    b1, b2 = boxes(rows), boxes(cols)

    def run(wrap, compute):
        ious = np.full((rows, cols), 7, compute)
        mmdispatch.box_iou_rotated_impl(*wrap([b1.astype(compute), b2.astype(compute), ious]),
                                        mode, False, True)
        return ious

    if dtype == np.float16:
        expected = run(list, np.float64).astype(np.float32).astype(np.float16)
    else:
        expected = run(list, dtype)
    assert not (expected == 7).any()
    np.testing.assert_array_equal(run(on_gpu, dtype), expected)


def test_cupy_outputs_cost_one_allocation_per_call_and_no_device_queries(emu, monkeypatch):
    """Outputs the dispatcher allocates like a CUDA array are CuPy's (here a
    stand-in CuPy that records what it is asked, its arrays emulator memory):
    a tiny avg-mode roi_align allocates its output alone, the (0,) argmax
    pair being one shared array per device and dtype, asks the device count
    once per process, and switches device only when another is current. A
    device id beyond the count is asked about again, and is still an error."""
    import importlib.util
    import sys
    import types
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: its real allocations are the bench's host-cost rows")
    asked = []

    def record(name, result=None):
        def call(*args, **kwargs):
            asked.append(name)
            return result() if callable(result) else result
        return call

    class Switch:
        def __init__(self, device):
            asked.append(f"switch to {device}")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class StandInArray:   # what the dispatcher reads of a CuPy array
        def __init__(self, shape, dtype):
            self.array = np.full(shape, 7, dtype)
            self.dtype, self.shape, self.strides = self.array.dtype, shape, self.array.strides
            self.data = types.SimpleNamespace(ptr=self.array.ctypes.data, device_id=0)

    def allocate(shape, dtype):
        asked.append(f"allocate {shape}")
        return StandInArray(shape, dtype)

    cupy = types.SimpleNamespace(   # cupy.empty(shape, dtype) is cupy.ndarray(shape, dtype)
        ndarray=allocate, zeros=allocate,
        cuda=types.SimpleNamespace(
            Device=Switch, get_current_stream=record("stream"),
            runtime=types.SimpleNamespace(getDeviceCount=record("count", 1),
                                          getDevice=record("current", lambda: current))))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    current = 0   # the device getDevice reports
    (x, rois, _, _, _), _ = roi_case()
    x, rois = OnGpu(x), OnGpu(rois)
    first = mmdispatch.roi_align_forward_impl(x, rois, None, None, None, 2, 2, 1.0, 2, 1, True)
    emu.synchronize()
    del asked[:]
    again = mmdispatch.roi_align_forward_impl(x, rois, None, None, None, 2, 2, 1.0, 2, 1, True)
    emu.synchronize()
    assert asked == ["current", "allocate (2, 3, 2, 2)"]   # the output; no count, no switch
    assert again[1] is again[2] is first[1] and again[1].shape == (0,)
    expected = mmdispatch.roi_align_forward_impl(x.array, rois.array, None, None, None, 2, 2,
                                                 1.0, 2, 1, True)[0]
    np.testing.assert_allclose(again[0].array, expected, rtol=1e-6)
    # another device current: the output is made on the arrays' device, and
    # the current one restored
    current = 1
    del asked[:]
    mmdispatch.roi_align_forward_impl(x, rois, None, None, None, 2, 2, 1.0, 2, 1, True)
    emu.synchronize()
    assert asked == ["current", "switch to 0", "allocate (2, 3, 2, 2)"]


def test_the_emulators_translation_gives_every_static_shared_variable_a_fill_per_block():
    """Static __shared__ variables become function-local statics that each
    block finds filled with 0xff bytes (mmd_emu::shared_region), as a GPU's
    shared memory holds garbage at a block's start; `extern __shared__`
    arrays are the block's dynamic shared memory."""
    source = ("    alignas(16) __shared__ float tile[4][33];\n"
              "    __shared__ mmd_rbox_shape row[8], col[8];\n"
              "    __shared__ int64_t selected;\n"
              "    extern __shared__ unsigned char raw[];\n")
    lines = cuda_emu.translate(source).splitlines()
    assert lines[0] == ("    alignas(16) static float tile[4][33]; "
                        "::mmd_emu::shared_region(&tile, sizeof(tile));")
    assert lines[1] == ("    static mmd_rbox_shape row[8], col[8]; "
                        "::mmd_emu::shared_region(&row, sizeof(row)); "
                        "::mmd_emu::shared_region(&col, sizeof(col));")
    assert lines[2] == ("    static int64_t selected; "
                        "::mmd_emu::shared_region(&selected, sizeof(selected));")
    assert "mmd_emu::block->dynamic_shared" in lines[3] and "static" not in lines[3]


def test_the_emulators_launches_name_the_kernels_whose_address_the_source_takes():
    """A launch carries its kernel's identity, which the emulator keys
    cudaFuncSetAttribute's shared-memory allowance by (per kernel and
    device, kept across calls, as on a GPU), where the source names the
    kernel as a value (given an attribute, or a pointer to one); a kernel
    only launched or defined, such as a template whose arguments the launch
    deduces, launches as nullptr, which no allowance names."""
    source = ("__global__ void big(float *x) {}\n"
              "template <typename A, typename B> __global__ void deduced(A a, B b) {}\n"
              "/* deduced, in a comment, is not named as a value */\n"
              "void run(float *x) {\n"
              "    cudaFuncSetAttribute(big, cudaFuncAttributeMaxDynamicSharedMemorySize, 1);\n"
              "    big<<<1, 1, 65536>>>(x);\n"
              "    deduced<float><<<1, 1>>>(1.0f, x);\n"
              "    auto kernel = cond ? big : other;\n"
              "    kernel<<<2, 32>>>(x);\n"
              "}\n")
    out = cuda_emu.translate(source)
    assert "mmd_emu::Launch(1, 1, 65536)(mmd_emu::kernel_id(big), [&]() { big(x); })" in out
    assert "mmd_emu::Launch(1, 1)(nullptr, [&]() { deduced<float>(1.0f, x); })" in out
    assert "mmd_emu::Launch(2, 32)(mmd_emu::kernel_id(kernel), [&]() { kernel(x); })" in out


CAPTURE_SEEDS = range(4)


@pytest.mark.parametrize("backend", ["default", "deterministic"])
@pytest.mark.parametrize("op_name", sorted(mmdispatch.op_signatures()))
def test_every_cuda_call_after_a_warm_up_can_be_captured_into_a_graph(emu, op_name, backend):
    """A call made while its stream captures a CUDA graph (CUDA's global
    mode: no synchronisation, cudaMalloc, cudaMemset, cudaMemcpy,
    cudaHostAlloc or pool creation, from any thread) after a warm-up call of
    the same op: the fuzzer's plausible calls give the same outcome as the
    warm-up and make none of the calls a capture forbids (a pending
    deferred error among them stays pending: see the next test)."""
    if backend not in emu.backends(op_name):
        pytest.skip(f"{op_name} has no {backend} CUDA kernel")
    for seed in CAPTURE_SEEDS:
        warm, captured = call_copies(op_name, seed)
        emu.synchronize()   # no deferred error of an earlier call
        with mmdispatch.strict(False), mmdispatch.use_backend("cuda", backend):
            expected = bits(outcome(emu, op_name, on_gpu(warm)))
            before = emu.counters()["capture_violations"]
            with emu.capturing():
                got = bits(outcome(emu, op_name, on_gpu(captured)))
        what = f"{op_name} ({backend}) seed {seed}"
        assert emu.counters()["capture_violations"] == before, what
        assert got == expected, what
        assert bits(warm) == bits(captured), what
    emu.synchronize()


def test_a_deferred_error_pending_when_a_capture_starts_stays_pending_for_a_later_call(emu):
    """Taking a pending deferred error waits for the device, which a capture
    forbids: a call in the capture leaves it pending, and the first call
    after the capture raises it, naming the call that found it."""
    bad, _ = roi_case(batch_index=7)
    good, _ = roi_case()
    with mmdispatch.strict(False):
        mmdispatch.roi_align_forward_impl(*on_gpu(bad), 2, 2, 1.0, 1, 1, True)
    before = emu.counters()["capture_violations"]
    with emu.capturing():
        assert outcome(emu, "roi_align_forward_impl", on_gpu(good) + [2, 2, 1.0, 1, 1, True]) \
            is None
    assert emu.counters()["capture_violations"] == before
    kind, message = outcome(emu, "roi_align_forward_impl", on_gpu(good) + [2, 2, 1.0, 1, 1, True])
    assert kind is mmdispatch.DeferredKernelError
    assert message.startswith("roi_align_forward_impl: rois[1, 0] (batch index)")
    assert emu.synchronize() == (0, "")


def test_strict_mode_in_a_graph_capture_is_refused_saying_why_and_writes_nothing(emu):
    arrays, _ = roi_case()
    before = emu.counters()["capture_violations"]
    with mmdispatch.strict(), emu.capturing():
        kind, message = outcome(emu, "roi_align_forward_impl",
                                on_gpu(arrays) + [2, 2, 1.0, 1, 1, True])
    assert kind is RuntimeError
    assert message.startswith("roi_align_forward_impl: strict mode waits for the device, so a "
                              "call in it cannot be captured into a CUDA graph")
    assert emu.counters()["capture_violations"] == before
    assert not arrays[2].any()


FIRST_CALL_IN_A_CAPTURE = """
import numpy as np
import mmdispatch
import cuda_emu
emu = cuda_emu.Emulator(cuda_emu.build())   # the device not yet used in this process
x = np.ones((1, 1, 2, 2), np.float32)
rois = np.array([[0, 0, 0, 1, 1]], np.float32)
args = lambda out: [cuda_emu.DeviceView(a) for a in (x, rois, out, np.empty(0, np.float32),
                                                      np.empty(0, np.float32))]
first = np.zeros((1, 1, 1, 1), np.float32)
with emu.active(), mmdispatch.strict(False):
    with emu.capturing():
        try:
            mmdispatch.roi_align_forward_impl(*args(first), 1, 1, 1.0, 1, 1, True)
        except RuntimeError as exc:   # the kernel's message is the emulator library's
            print("refused:", type(exc).__name__, emu.last_error())
    print("violations:", emu.counters()["capture_violations"], "written:", first.any())
    later = np.zeros((1, 1, 1, 1), np.float32)
    mmdispatch.roi_align_forward_impl(*args(later), 1, 1, 1.0, 1, 1, True)
    print("later:", later.ravel().tolist())
"""


def test_the_first_call_on_a_device_in_a_capture_is_refused_saying_why_and_not_kept(
        cuda_emulator, tmp_path):
    """The first call on a device allocates its error word and waits for the
    device: in a capture it is an error that says to warm up first, and the
    failure is not kept (it was, for the process: every later call on the
    device failed)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    support = str(Path(cuda_emu.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([support, os.environ.get("PYTHONPATH", "")]))
    # (from elsewhere than the source tree, whose mmdispatch/ has no extension)
    done = subprocess.run([sys.executable, "-c", FIRST_CALL_IN_A_CAPTURE], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused: RuntimeError the first mmdispatch call on cuda:0 "
                               "cannot be captured into a CUDA graph"), done.stdout
    assert "make one call of any mmdispatch op on the device before capturing" in lines[0]
    assert lines[1] == "violations: 0 written: False"
    assert lines[2] == "later: [1.0]"
