"""CUDA graph capture and replay of mmdispatch's ops on a GPU (the CPU
suite emulates the capture rules: tests/cuda/test_emulated_kernels.py).
Every test skips without a GPU, mmdispatch's CUDA kernels, torch or CuPy.

Written without a GPU (from a review of df2d9d0 by a helper; its draft's
shapes and signatures ran on the CPU): the first GPU run checks them.

  A. torch.cuda.graph: capture after a warm-up, replay on new data, compare
     with eager calls on the same data (default backend within 1e-4: its
     atomics; deterministic backend bit-equal), forward and
     forward+backward, every op but the nms family.
  C. CuPy stream capture: entry points and ops whose arrays the caller keeps.
  D. Deferred errors met by replays; an error pending when a capture
     starts; strict mode refused in a capture.
  E. The nms family: an error under capture, recovered from; nms_impl with
     its outputs given, captured.
  F. First use in a capture (fresh processes), scratch and cuBLAS made
     after the warm-up.
"""
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

import mmdispatch


def _cuda_kernels_usable():
    return any(d["device"] == "cuda" and d["available"] for d in mmdispatch.devices())


@pytest.fixture
def tc():
    """torch with a GPU and mmdispatch's CUDA kernels, mmdispatch.torch
    imported; afterwards the device is waited for and a deferred error a
    test left fails that test."""
    if not _cuda_kernels_usable():
        pytest.skip("mmdispatch's CUDA kernels are unusable here")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    import mmdispatch.torch  # noqa: F401  (registers the ops)
    yield torch
    torch.cuda.synchronize()
    mmdispatch.synchronize("cuda")


@pytest.fixture
def cp():
    if not _cuda_kernels_usable():
        pytest.skip("mmdispatch's CUDA kernels are unusable here")
    cupy = pytest.importorskip("cupy")
    yield cupy
    cupy.cuda.Device().synchronize()
    mmdispatch.synchronize("cuda")


def _chain_text(exc):
    """The messages of an exception and everything chained to it (torch's
    capture_end raises from __exit__, with ours as __context__)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


# ----------------------------------------------------------------- inputs

def _rois(torch, gen, batch, k, height, width, scale, device, dtype=None, rotated=False):
    """k valid rois (batch index, x1, y1, x2, y2) in image coordinates of an
    (height / scale, width / scale) image; rotated: (b, cx, cy, w, h, angle)."""
    H, W = height / scale, width / scale
    b = torch.randint(0, batch, (k, 1), generator=gen).float()
    if rotated:
        c = torch.rand(k, 2, generator=gen) * torch.tensor([W, H])
        wh = torch.rand(k, 2, generator=gen) * torch.tensor([W / 2, H / 2]) + 2
        a = (torch.rand(k, 1, generator=gen) - 0.5) * 3.0
        r = torch.cat([b, c, wh, a], 1)
    else:
        p = torch.rand(k, 2, generator=gen) * torch.tensor([W * 0.7, H * 0.7])
        s = torch.rand(k, 2, generator=gen) * torch.tensor([W * 0.3, H * 0.3]) + 1
        r = torch.cat([b, p, p + s], 1)
    return r.to(device=device, dtype=dtype or torch.float32)


def _cases(torch):
    """name -> (fn(*tensors) -> tensor, make(seed) -> list of tensors,
    indices of the inputs that take a gradient). Shapes fixed per case;
    make(seed) gives new values of the same shapes."""
    from mmdispatch.torch import mmcv
    import mmdispatch.torch as mt
    dev = "cuda"

    def g(seed):
        return torch.Generator().manual_seed(seed)

    def feat(gen, *shape):
        return torch.randn(*shape, generator=gen).to(dev)

    cases = {}
    # roi_align: a small call (per-bin kernel) and a large one (transposed
    # chunks: scratch from the pool, a graph memory node under capture)
    for size, (n, c, h, w, k) in {"small": (2, 8, 16, 16, 12),
                                  "large": (2, 256, 64, 64, 1024)}.items():
        cases[f"roi_align_avg_{size}"] = (
            lambda x, r: mt.roi_align(x, r, 7, 0.25, 2, True),
            lambda s, n=n, c=c, h=h, w=w, k=k: [feat(g(s), n, c, h, w),
                                                 _rois(torch, g(s + 1), n, k, h, w, 0.25, dev)],
            (0,))
    cases["roi_align_max"] = (
        lambda x, r: mmcv.roi_align(x, r, 7, 0.25, 2, "max", True),
        lambda s: [feat(g(s), 2, 8, 16, 16), _rois(torch, g(s + 1), 2, 12, 16, 16, 0.25, dev)],
        (0,))
    cases["roi_pool"] = (
        lambda x, r: mt.roi_pool(x, r, 7, 0.25),
        lambda s: [feat(g(s), 2, 16, 32, 32), _rois(torch, g(s + 1), 2, 64, 32, 32, 0.25, dev)],
        (0,))
    for name, fn in (("ps_roi_align", lambda x, r: mt.ps_roi_align(x, r, 3, 0.25, 2)),
                     ("ps_roi_pool", lambda x, r: mt.ps_roi_pool(x, r, 3, 0.25))):
        cases[name] = (fn, lambda s: [feat(g(s), 2, 18, 16, 16),
                                      _rois(torch, g(s + 1), 2, 12, 16, 16, 0.25, dev)], (0,))
    cases["roi_align_rotated"] = (
        lambda x, r: mmcv.roi_align_rotated(x, r, 7, 0.25, 2, True, False),
        lambda s: [feat(g(s), 2, 8, 16, 16),
                   _rois(torch, g(s + 1), 2, 12, 16, 16, 0.25, dev, rotated=True)],
        (0,))
    # deform_conv2d: float32 takes the process's cuBLAS (torch loaded it) on
    # the default backend; float64 too; the deterministic backend never does
    for dtype in (torch.float32, torch.float64):
        name = "deform_conv2d_" + str(dtype).split(".")[1]
        cases[name] = (
            lambda x, o, m, wt, b: mt.deform_conv2d(x, o, wt, b, padding=(1, 1), mask=m),
            lambda s, dtype=dtype: [t.to(dtype) for t in (
                feat(g(s), 2, 16, 24, 24), feat(g(s + 1), 2, 18, 24, 24) * 2,
                torch.sigmoid(feat(g(s + 2), 2, 9, 24, 24)), feat(g(s + 3), 32, 16, 3, 3) * 0.1,
                feat(g(s + 4), 32))],
            (0, 1, 2, 3, 4))

    def msda_inputs(s):
        shapes = torch.tensor([[16, 16], [8, 8]], device=dev)
        start = torch.tensor([0, 256], device=dev)
        value = feat(g(s), 2, 320, 4, 8)
        loc = torch.rand(2, 30, 4, 2, 4, 2, generator=g(s + 1)).to(dev)
        att = torch.softmax(feat(g(s + 2), 2, 30, 4, 8), -1).view(2, 30, 4, 2, 4)
        return [value, shapes, start, loc, att]
    cases["msda"] = (
        lambda v, sh, st, loc, att: mmcv.multi_scale_deformable_attn(v, sh, st, loc, att, 64),
        msda_inputs, (0, 3, 4))
    cases["sigmoid_focal_loss"] = (
        lambda x, t: mmcv.sigmoid_focal_loss(x, t, 2.0, 0.25, None, "none"),
        lambda s: [feat(g(s), 64, 10), torch.randint(0, 11, (64,), generator=g(s + 1)).to(dev)],
        (0,))
    cases["softmax_focal_loss"] = (
        lambda x, t: mmcv.softmax_focal_loss(x, t, 2.0, 0.25, None, "none"),
        lambda s: [feat(g(s), 64, 10), torch.randint(0, 10, (64,), generator=g(s + 1)).to(dev)],
        (0,))
    cases["bbox_overlaps"] = (
        lambda a, b: mmcv.bbox_overlaps(a, b),
        lambda s: [_rois(torch, g(s), 1, 50, 64, 64, 1.0, dev)[:, 1:].contiguous(),
                   _rois(torch, g(s + 1), 1, 70, 64, 64, 1.0, dev)[:, 1:].contiguous()],
        ())
    cases["box_iou_rotated"] = (
        lambda a, b: mmcv.box_iou_rotated(a, b),
        lambda s: [_rois(torch, g(s), 1, 40, 64, 64, 1.0, dev, rotated=True)[:, 1:].contiguous(),
                   _rois(torch, g(s + 1), 1, 30, 64, 64, 1.0, dev, rotated=True)[:, 1:]
                   .contiguous()],
        ())
    return cases


_CASE_NAMES = ["roi_align_avg_small", "roi_align_avg_large", "roi_align_max", "roi_pool",
               "ps_roi_align", "ps_roi_pool", "roi_align_rotated", "deform_conv2d_float32",
               "deform_conv2d_float64", "msda", "sigmoid_focal_loss", "softmax_focal_loss",
               "bbox_overlaps", "box_iou_rotated"]


def _warm_up_and_capture(torch, step, static, warmups=3):
    """torch's documented recipe: warm-up iterations on a side stream, then
    capture (default capture_error_mode="global")."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*static)
    return graph, out


def _forward_backward(torch, fn, grad_inputs):
    """step(*inputs) -> (output, gradients of the grad_inputs), the gradient
    of sum(output * w) with a fixed w (inside the graph: autograd.grad)."""
    def step(*inputs):
        inputs = list(inputs)
        out = fn(*inputs)
        if not grad_inputs:
            return (out,)
        w = torch.linspace(-1, 1, out.numel(), device=out.device,
                           dtype=out.dtype).view_as(out)
        grads = torch.autograd.grad((out * w).sum(), [inputs[i] for i in grad_inputs])
        return (out, *grads)
    return step


@pytest.mark.parametrize("backend", ["default", "deterministic"])
@pytest.mark.parametrize("with_backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("name", _CASE_NAMES)
def test_torch_graph_replay_matches_eager(tc, name, with_backward, backend):
    torch = tc
    fn, make, grad_inputs = _cases(torch)[name]
    grad_inputs = grad_inputs if with_backward else ()
    step = _forward_backward(torch, fn, grad_inputs)
    deterministic = backend == "deterministic"
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        static = make(0)
        for i in grad_inputs:
            static[i].requires_grad_(True)
        graph, captured = _warm_up_and_capture(torch, step, static)
        for seed in (10, 20, 30):
            fresh = make(seed)
            with torch.no_grad():
                for s, f in zip(static, fresh):
                    s.copy_(f)
            graph.replay()
            torch.cuda.synchronize()
            for i in grad_inputs:
                fresh[i].requires_grad_(True)
            expected = step(*fresh)
            for got, want in zip(captured, expected):
                if deterministic:
                    assert torch.equal(got, want), f"{name}: replay differs in bits"
                else:
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)   # atomics
        mmdispatch.synchronize("cuda")   # no deferred error from the replays
    finally:
        torch.use_deterministic_algorithms(False)


# ----------------------------------------------------------- CuPy capture

def _cupy_rois(cp, seed, batch, k, height, width, scale):
    rng = np.random.default_rng(seed)
    H, W = height / scale, width / scale
    p = rng.random((k, 2)) * [W * 0.7, H * 0.7]
    s = rng.random((k, 2)) * [W * 0.3, H * 0.3] + 1
    r = np.concatenate([rng.integers(0, batch, (k, 1)), p, p + s], 1)
    return cp.asarray(r, dtype=cp.float32)


def test_cupy_capture_entry_points_and_ops(cp):
    """CuPy's begin_capture (relaxed mode) on a non-blocking stream: entry
    points with preallocated outputs and mmdispatch.ops functions whose
    every allocation is returned to the caller."""
    from mmdispatch import ops
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.random.standard_normal((2, 8, 16, 16), dtype=cp.float32)
        r = _cupy_rois(cp, 0, 2, 12, 16, 16, 0.25)
        out = cp.empty((12, 8, 7, 7), cp.float32)
        unused = cp.empty((0,), cp.float32)
        a, b = r[:, 1:].copy(), _cupy_rois(cp, 1, 1, 20, 64, 64, 1.0)[:, 1:].copy()
        ious = cp.empty((12, 20), cp.float32)
        # warm-up
        mmdispatch.roi_align_forward_impl(x, r, out, unused, unused, 7, 7, 0.25, 2, 1, True)
        ops.roi_align(x, r, 7, 0.25, 2)
        mmdispatch.bbox_overlaps_impl(a, b, ious, 0, False, 0)
        s.synchronize()
        s.begin_capture()
        mmdispatch.roi_align_forward_impl(x, r, out, unused, unused, 7, 7, 0.25, 2, 1, True)
        pooled = ops.roi_align(x, r, 7, 0.25, 2)
        mmdispatch.bbox_overlaps_impl(a, b, ious, 0, False, 0)
        graph = s.end_capture()
        for seed in (5, 6):
            x[...] = cp.random.standard_normal(x.shape, dtype=cp.float32)
            r[...] = _cupy_rois(cp, seed, 2, 12, 16, 16, 0.25)
            graph.launch(stream=s)
            s.synchronize()
            want = ops.roi_align(x, r, 7, 0.25, 2)
            cp.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
            cp.testing.assert_allclose(pooled, want, rtol=1e-6, atol=1e-6)
            cp.testing.assert_allclose(ious, ops.bbox_overlaps(a, b), rtol=1e-6)


# ----------------------------------------------------------- deferred errors

def test_replay_with_bad_roi_gives_nan_rows_and_a_deferred_error(tc):
    torch = tc
    import mmdispatch.torch as mt
    x = torch.randn(2, 8, 16, 16, device="cuda")
    r = _rois(torch, torch.Generator().manual_seed(0), 2, 12, 16, 16, 0.25, "cuda")
    graph, out = _warm_up_and_capture(torch, lambda x, r: mt.roi_align(x, r, 7, 0.25, 2, True),
                                      (x, r))
    want = mt.roi_align(x, r, 7, 0.25, 2, True)   # before the replay leaves an error
    r[3, 0] = 7   # batch index outside [0, 2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[3]).all()
    rows = [i for i in range(12) if i != 3]
    with pytest.raises(mmdispatch.DeferredKernelError, match=r"roi_align.*rois\[3, 0\]"):
        mmdispatch.synchronize("cuda")
    mmdispatch.synchronize("cuda")   # raised once, then cleared
    torch.testing.assert_close(out[rows], want[rows])


def test_pending_error_does_not_break_a_capture(tc):
    torch = tc
    import mmdispatch.torch as mt
    x = torch.randn(2, 8, 16, 16, device="cuda")
    good = _rois(torch, torch.Generator().manual_seed(0), 2, 12, 16, 16, 0.25, "cuda")
    mt.roi_align(x, good, 7, 0.25, 2, True)
    bad = good.clone()
    bad[0, 0] = 9
    mt.roi_align(x, bad, 7, 0.25, 2, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):   # the captured call leaves it pending
        out = mt.roi_align(x, good, 7, 0.25, 2, True)
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(mmdispatch.DeferredKernelError, match=r"rois\[0, 0\]"):
        mmdispatch.synchronize("cuda")
    torch.testing.assert_close(out, mt.roi_align(x, good, 7, 0.25, 2, True))


def test_strict_mode_under_capture_names_strict_mode(tc):
    torch = tc
    import mmdispatch.torch as mt
    x = torch.randn(2, 8, 16, 16, device="cuda")
    r = _rois(torch, torch.Generator().manual_seed(0), 2, 12, 16, 16, 0.25, "cuda")
    mt.roi_align(x, r, 7, 0.25, 2, True)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception) as info:
        with mmdispatch.strict(), torch.cuda.graph(graph):
            mt.roi_align(x, r, 7, 0.25, 2, True)
    assert "strict" in _chain_text(info.value)


# ------------------------------------------------------------------ nms family

@pytest.mark.parametrize("which", ["nms", "batched_nms", "mmcv_nms", "soft_nms", "nms_rotated"])
def test_nms_family_under_capture_raises_and_recovers(tc, which):
    torch = tc
    import mmdispatch.torch as mt
    from mmdispatch.torch import mmcv
    gen = torch.Generator().manual_seed(0)
    boxes = _rois(torch, gen, 1, 300, 64, 64, 1.0, "cuda")[:, 1:].contiguous()
    rboxes = _rois(torch, gen, 1, 300, 64, 64, 1.0, "cuda", rotated=True)[:, 1:].contiguous()
    scores = torch.rand(300, generator=gen).cuda()
    idxs = torch.randint(0, 3, (300,), generator=gen).cuda()
    call = {"nms": lambda: mt.nms(boxes, scores, 0.5),
            "batched_nms": lambda: mt.batched_nms(boxes, scores, idxs, 0.5),
            "mmcv_nms": lambda: mmcv.nms(boxes, scores, 0.5)[1],
            "soft_nms": lambda: mmcv.soft_nms(boxes, scores, 0.3)[1],
            "nms_rotated": lambda: mmcv.nms_rotated(rboxes, scores, 0.5)[1]}[which]
    before = call()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception) as info:   # the kept count is read on the host
        with torch.cuda.graph(graph):
            call()
    assert "captur" in _chain_text(info.value).lower(), _chain_text(info.value)
    assert torch.equal(call(), before)
    mmdispatch.synchronize("cuda")


def test_nms_entry_point_with_preallocated_outputs_captures(tc):
    """nms_impl's kernels never wait (nms.cuh:173-233): with keep and
    num_kept given, the call captures; the count stays on the device."""
    torch = tc
    import mmdispatch.torch as mt
    gen = torch.Generator().manual_seed(0)
    n = 500
    boxes = _rois(torch, gen, 1, n, 64, 64, 1.0, "cuda")[:, 1:].contiguous()
    scores = torch.rand(n, generator=gen).cuda()
    keep = torch.empty(n, dtype=torch.int64, device="cuda")
    count = torch.empty(1, dtype=torch.int64, device="cuda")
    graph, _ = _warm_up_and_capture(
        torch, lambda b, s: mmdispatch.nms_impl(b, s, None, keep, count, 0.5, 0), (boxes, scores))
    for seed in (1, 2, 3):
        g2 = torch.Generator().manual_seed(seed)
        boxes.copy_(_rois(torch, g2, 1, n, 64, 64, 1.0, "cuda")[:, 1:])
        scores.copy_(torch.rand(n, generator=g2).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(keep[:int(count.item())], mt.nms(boxes, scores, 0.5))


# ------------------------------------------- first use, scratch and memory

def _run_fresh(code):
    """Runs code in a fresh interpreter (nothing of mmdispatch initialised
    yet); returns (returncode, output)."""
    # (from elsewhere than the source tree, whose mmdispatch/ has no extension)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONFAULTHANDLER="1"),
                          cwd=tempfile.gettempdir())
    return proc.returncode, proc.stdout + proc.stderr


_FRESH_PRELUDE = """
    import torch, mmdispatch, mmdispatch.torch as mt
    x = torch.randn(2, 8, 16, 16, device="cuda")
    r = torch.tensor([[0, 1.0, 1, 30, 30], [1, 4, 4, 50, 40]], device="cuda")
    torch.cuda.synchronize()
"""


def test_first_call_under_capture_is_refused_saying_why_and_does_not_poison_the_device(tc):
    """The first call on a device allocates its state and waits for the
    device, which a capture forbids: a RuntimeError that says to warm up
    first, and the next call outside the capture works (the failure was
    kept for the process)."""
    rc, out = _run_fresh(_FRESH_PRELUDE + """
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            mt.roi_align(x, r, 7, 0.25, 2, True)     # no warm-up
    except Exception as exc:
        print("capture failed:", exc)
    y = mt.roi_align(x, r, 7, 0.25, 2, True)        # must work now
    torch.cuda.synchronize()
    mmdispatch.synchronize("cuda")
    print("OK", float(y.abs().sum()))
    """)
    assert rc == 0 and "OK" in out, out
    assert "capture failed:" in out and "make one call of any mmdispatch op" in out, out


def test_capture_of_a_larger_shape_than_the_warm_up(tc):
    """Warm-up on a small roi_align (no scratch; the first call made the
    scratch pool; the transposed kernels are not loaded), capture a large
    one (transposed chunks: its scratch is a graph memory node; CUDA's lazy
    loading loads kernels during capture)."""
    rc, out = _run_fresh(_FRESH_PRELUDE + """
    mt.roi_align(x, r, 7, 0.25, 2, True)            # error word, no scratch
    big = torch.randn(2, 256, 64, 64, device="cuda")
    g0 = torch.Generator().manual_seed(0)
    k = 1024
    p = torch.rand(k, 2, generator=g0) * 180
    rois = torch.cat([torch.randint(0, 2, (k, 1), generator=g0).float(), p, p + 40], 1).cuda()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mt.roi_align(big, rois, 7, 0.25, 2, True)
    big.normal_()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, mt.roi_align(big, rois, 7, 0.25, 2, True))
    mmdispatch.synchronize("cuda")
    print("OK")
    """)
    assert rc == 0 and "OK" in out, out


def test_capture_of_deform_conv2d_before_its_cublas_handle_exists(tc):
    """Warm-up only on the deterministic backend (no cuBLAS handle), capture
    the default backend: the handle is not made in a capture (the call
    takes our own products) and a later eager call makes it; both captures
    replay the eager values."""
    rc, out = _run_fresh("""
    import torch, mmdispatch, mmdispatch.torch as mt
    x = torch.randn(2, 16, 24, 24, device="cuda"); o = torch.randn(2, 18, 24, 24, device="cuda")
    w = torch.randn(32, 16, 3, 3, device="cuda") * 0.1
    torch.use_deterministic_algorithms(True, warn_only=True)
    mt.deform_conv2d(x, o, w, padding=(1, 1))
    torch.use_deterministic_algorithms(False)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = mt.deform_conv2d(x, o, w, padding=(1, 1))
    want = mt.deform_conv2d(x.double(), o.double(), w.double(), padding=(1, 1)).float()
    g.replay(); torch.cuda.synchronize()
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mt.deform_conv2d(x, o, w, padding=(1, 1)), want,
                               rtol=1e-4, atol=1e-4)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        y2 = mt.deform_conv2d(x, o, w, padding=(1, 1))
    g2.replay(); torch.cuda.synchronize()
    torch.testing.assert_close(y2, want, rtol=1e-4, atol=1e-4)
    print("OK")
    """)
    assert rc == 0 and "OK" in out, out
