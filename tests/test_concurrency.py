"""Threads: dispatching from many threads while others register and remove
Python kernels gives single-threaded results and loses no registration;
the C kernels run without the GIL (shown in a subprocess with
OMP_NUM_THREADS=1, where overlap can only come from two Python threads)."""
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np

import mmdispatch
from mmdispatch import ops
from mmdispatch._codegen import parse_signature
from stand_ins import FakeDeviceArray  # tests/support, see conftest.py

THREADS_DISPATCHING = 4
THREADS_REGISTERING = 4
ROUNDS = 150


def workload():
    """(name, fn) pairs: CPU calls of every op, each deterministic, so every
    thread must get bit-identical results."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 8, 12, 12))
    rois = np.array([[0, 1, 1, 9, 9], [1, 0, 2, 11, 7], [0, 3, 3, 4, 10]], dtype=np.float64)
    boxes = np.concatenate([rng.uniform(0, 40, (60, 2)), rng.uniform(0, 40, (60, 2)) + 5], 1)
    boxes[:, 2:] = np.maximum(boxes[:, 2:], boxes[:, :2] + 1)
    scores = rng.random(60)
    logits, target = rng.standard_normal((16, 5)), rng.integers(0, 6, 16)

    def roi_align_fwd_bwd():
        out, ay, ax = ops.roi_align_forward(x, rois, 3, 0.5, 2, "max", True)
        return out, ops.roi_align_backward(out, rois, ay, ax, x.shape, 0.5, 2, "max", True)

    def roi_align_reference_backend():
        with mmdispatch.use_backend("cpu", "reference"):   # thread-local selection
            return ops.roi_align(x, rois, (2, 3), 0.5, 0, "avg", False)

    def nms_reference_backend():
        with mmdispatch.use_backend("cpu", "reference"):
            return ops.nms(boxes, scores, 0.3)

    return [
        ("roi_align", roi_align_fwd_bwd),
        ("roi_align/reference", roi_align_reference_backend),
        ("roi_pool", lambda: ops.roi_pool_forward(x, rois, (2, 2), 0.5)),
        ("nms", lambda: ops.nms(boxes, scores, 0.3)),
        ("nms/reference", nms_reference_backend),
        ("batched_nms", lambda: ops.batched_nms(boxes, scores, np.arange(60) % 3, 0.5)),
        ("bbox_overlaps", lambda: ops.bbox_overlaps(boxes[:20], boxes, "iof")),
        ("sigmoid_focal_loss", lambda: ops.sigmoid_focal_loss_backward(logits, target)),
    ]


def as_bytes(result):
    arrays = result if isinstance(result, tuple) else (result,)
    return [np.asarray(a).tobytes() for a in arrays]


def python_rows():
    return sorted((r["op"], r["device"], r["backend"], r["origin"], r["active"])
                  for r in mmdispatch.registry_table() if r["kind"] == "python")


def test_dispatch_while_other_threads_register_and_remove_kernels():
    calls = workload()
    expected = {name: as_bytes(fn()) for name, fn in calls}
    table_before = mmdispatch.registry_table()
    # registering threads own distinct device types (and share two new
    # backend names, created concurrently); dispatching threads use the CPU
    devices = {0: ("vulkan", 7), 1: ("metal", 8), 2: ("opencl", 4), 3: ("oneapi", 14)}
    backends = ["default", "concurrent_a", "concurrent_b"]
    op_names = sorted(mmdispatch.op_signatures())
    # parsed here: ast.parse in several threads at once can fail inside
    # CPython 3.11 ("AST constructor recursion depth mismatch")
    array_params = {name: [p.is_array for p in parse_signature(
        mmdispatch.op_signatures()[name]).params] for name in op_names}
    failures, kept = [], {}
    start = threading.Barrier(THREADS_DISPATCHING + THREADS_REGISTERING)

    def dispatcher(index):
        start.wait()
        try:
            for round_ in range(ROUNDS // 3):
                name, fn = calls[(index + round_) % len(calls)]
                if as_bytes(fn()) != expected[name]:
                    failures.append(f"dispatcher {index}: {name} differs from single-threaded")
        except Exception as exc:  # reported below, not lost in the thread
            failures.append(f"dispatcher {index}: {type(exc).__name__}: {exc}")

    def registrar(index):
        device, code = devices[index]
        live = kept[index] = []
        start.wait()
        try:
            for round_ in range(ROUNDS):
                op_name = op_names[round_ % len(op_names)]
                backend = backends[round_ % len(backends)]
                marker = (index, round_)

                def kernel(*args, marker=marker):
                    return marker
                handle = mmdispatch.register_impl(op_name, device, kernel, backend=backend,
                                                  override=True)
                live.append(handle)
                # the slot now dispatches to this kernel, in this thread's backend
                arrays = [FakeDeviceArray(code) if is_array else 0
                          for is_array in array_params[op_name]]
                with mmdispatch.use_backend(device, backend):
                    got = getattr(mmdispatch, op_name)(*arrays)
                if got != marker:
                    failures.append(f"registrar {index}: {op_name} on {device}/{backend} "
                                    f"called {got}, expected {marker}")
                if round_ % 3 != 2:   # remove two of every three, in mixed order
                    live.pop(round_ % len(live)).remove()
        except Exception as exc:
            failures.append(f"registrar {index}: {type(exc).__name__}: {exc}")

    threads = ([threading.Thread(target=dispatcher, args=(i,))
                for i in range(THREADS_DISPATCHING)]
               + [threading.Thread(target=registrar, args=(i,))
                  for i in range(THREADS_REGISTERING)])
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    live = [h for handles in kept.values() for h in handles]
    try:
        assert not any(t.is_alive() for t in threads), "a thread hung"
        assert failures == []

        # no lost registration: exactly the handles still held are in the
        # table, and in each slot the newest one is active
        assert live and all(h.kind == "python" for h in live)
        expected_rows = []
        for h in live:
            same_slot = [o for o in live
                         if (o.op, o.device, o.backend) == (h.op, h.device, h.backend)]
            expected_rows.append((h.op, h.device, h.backend, h.origin, h.active))
            assert sum(o.active for o in same_slot) == 1
        assert python_rows() == sorted(expected_rows)
    finally:   # a failure here must not leave kernels for later tests
        for h in live:
            h.remove()
    assert mmdispatch.registry_table() == table_before
    # the dispatchers' kernels were never replaced: results still identical
    assert {name: as_bytes(fn()) for name, fn in calls} == expected


def test_use_backend_in_one_thread_does_not_leak_into_others():
    x = np.random.default_rng(3).standard_normal((1, 2, 6, 6))
    rois = np.array([[0, 0.3, 0.7, 4.2, 5.1]])
    seen, barrier = [], threading.Barrier(6)

    def worker(backend):
        barrier.wait()
        for _ in range(30):
            with mmdispatch.use_backend("cpu", backend):
                seen.append((backend, mmdispatch.get_backend("cpu")))
                ops.roi_align(x, rois, 2, 1.0, 0)
            seen.append(("default", mmdispatch.get_backend("cpu")))

    threads = [threading.Thread(target=worker, args=(b,))
               for b in ["default", "reference"] * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(want == got for want, got in seen)
    assert len(seen) == 6 * 60


# --- the GIL ---------------------------------------------------------------------------

GIL_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    import numpy as np
    import mmdispatch
    from mmdispatch import ops

    rng = np.random.default_rng(0)
    n = int(sys.argv[1])
    # disjoint boxes: nothing is suppressed, so the reference backend's
    # O(kept * n) loop does n * (n - 1) / 2 IoU tests
    boxes = np.zeros((n, 4))
    boxes[:, 0] = np.arange(n) * 10.0
    boxes[:, 2] = boxes[:, 0] + 5
    boxes[:, 3] = 5
    scores = rng.random(n)
    x = rng.standard_normal((1, 4, 256, 256)).astype(np.float32)
    rois = np.tile(np.array([[0, 0, 0, 255, 255]], np.float32), (512, 1))

    def nms():
        with mmdispatch.use_backend("cpu", "reference"):
            ops.nms(boxes, scores, 0.5)

    def roi_align():   # adaptive: 37x37 samples per bin, one at a time
        with mmdispatch.use_backend("cpu", "reference"):
            ops.roi_align(x, rois, 7, 1.0, 0)

    def run(fn, threads):
        barrier = threading.Barrier(len(threads))
        spans = [None] * len(threads)
        ticks = []
        done = threading.Event()

        def worker(i):
            barrier.wait()
            start = time.perf_counter()
            fn()
            spans[i] = (start, time.perf_counter())

        def ticker():   # pure Python: it runs only while no thread holds the GIL
            while not done.is_set():
                ticks.append(time.perf_counter())
                time.sleep(0.0005)

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(len(threads))]
        observer = threading.Thread(target=ticker)
        observer.start()
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
        done.set()
        observer.join()
        return spans, ticks, wall

    result = {}
    for name, fn in (("nms", nms), ("roi_align", roi_align)):
        fn()   # warm up
        one_spans, _, one_wall = run(fn, [0])
        spans, ticks, wall = run(fn, [0, 1])
        result[name] = dict(spans=spans, ticks=ticks, wall_two_threads=wall,
                            wall_one_call=one_wall)
    print(json.dumps(result))
""")


def test_kernels_release_the_gil_two_threads_overlap(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # cwd outside the source tree: `python -c` puts the cwd first on sys.path,
    # and the source tree's mmdispatch has no compiled extension
    proc = subprocess.run([sys.executable, "-c", GIL_SCRIPT, "9000"], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for name, r in result.items():
        (s0, e0), (s1, e1) = r["spans"]
        overlap = min(e0, e1) - max(s0, s1)
        shorter = min(e0 - s0, e1 - s1)
        print(f"{name}: calls {e0 - s0:.3f} s and {e1 - s1:.3f} s, overlapping {overlap:.3f} s; "
              f"one call alone {r['wall_one_call']:.3f} s, two threads {r['wall_two_threads']:.3f} s")
        # the two calls' intervals intersect for most of their length...
        assert overlap > 0.5 * shorter, (name, r["spans"])
        # ...and Python code ran in a third thread in the middle of both calls,
        # which holding the GIL (switch interval 5 ms) would have made impossible
        lo, hi = max(s0, s1) + 0.25 * overlap, min(e0, e1) - 0.25 * overlap
        assert hi - lo > 0.02, (name, "calls too short to tell", r["spans"])
        assert any(lo < t < hi for t in r["ticks"]), (name, "no Python ran during the calls")
