"""Instruction counts per call, under valgrind's callgrind: the same count
for the same build, inputs and Python whatever else the machine is doing,
unlike timings on a shared machine. Each figure is (instructions of a run
with 3n calls - instructions of a run with n calls) / 2n, so start-up cancels.

    python tools/count_instructions.py [--calls N]

Prints, per call:
- dispatch: roi_align_forward_impl with the no-op C kernel of
  mmdispatch._benchkit registered (the dispatch-overhead benchmark's first
  side), raw: _benchkit.raw_roi_align_forward (its baseline), and their
  difference, the instructions the dispatcher adds;
- tiny: a whole ops.roi_align call on the tiny input (1x1x4x4, one roi, 1x1);
- tiny+trace, tiny+profile: the same call with mmdispatch.trace(a no-op
  callback) or mmdispatch.profile() active (the hooks' cost);
- allocating: roi_align_forward_impl on it with its outputs None (the
  dispatcher allocates them), the built-in kernel;
- with --torch (torch installed): the same tiny call through
  mmdispatch.torch.roi_align and through torchvision.ops.roi_align, on
  torch tensors, no gradient.

Needs valgrind. The child runs with PYTHONHASHSEED=0 and one thread, and
its loop runs in a function, so dictionary probing is the same every run.
"""
import argparse
import os
import shutil
import subprocess
import sys

CHILD = r"""
import sys
import numpy as np
import mmdispatch
from mmdispatch import _benchkit, ops
which, n = sys.argv[1], int(sys.argv[2])
if which in ("torch", "torchvision"):
    import torch
    torch.set_num_threads(1)
    if which == "torch":
        from mmdispatch.torch import roi_align
    else:
        from torchvision.ops import roi_align
    x = torch.zeros((1, 1, 4, 4))
    rois = torch.tensor([[0, 0, 0, 3, 3.]])
    def loop(f, n):
        for _ in range(n):
            f(x, rois, 1, 1.0, 2)
    loop(roi_align, 10)   # first-call set-up out of the count
    loop(roi_align, n)
    sys.exit()
x = np.zeros((1, 1, 4, 4), np.float32)
rois = np.array([[0, 0, 0, 3, 3]], np.float32)
out = np.empty((1, 1, 1, 1), np.float32)
empty = np.empty((0,), np.float32)
if which.startswith("tiny"):
    def loop(f, n):
        for _ in range(n):
            f(x, rois, 1, 1.0, 2)
    if which == "tiny+trace":
        with mmdispatch.trace(lambda event, call: None):
            loop(ops.roi_align, n)
    elif which == "tiny+profile":
        with mmdispatch.profile() as p:
            loop(ops.roi_align, n)
    else:
        loop(ops.roi_align, n)
elif which == "allocating":
    def loop(f, n):
        for _ in range(n):
            f(x, rois, None, None, None, 1, 1, 1.0, 2, 1, True)
    loop(mmdispatch.roi_align_forward_impl, n)
else:
    f = mmdispatch.roi_align_forward_impl if which == "dispatch" else \
        _benchkit.raw_roi_align_forward
    def loop(f, n):
        for _ in range(n):
            f(x, rois, out, empty, empty, 1, 1, 1.0, 2, 1, True)
    # as mmdispatch.bench does: the no-op kernel in the cpu/default slot
    with mmdispatch.register_impl("roi_align_forward_impl", "cpu",
                                  _benchkit.noop_roi_align_forward_kernel(), override=True):
        loop(f, n)
"""


def instructions(which, calls):
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    # sys.executable as it is, not its real path: in a virtual environment
    # the real path is the base interpreter, which cannot import mmdispatch
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, "-c", CHILD, which, str(calls)],
        capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the {which} run failed under callgrind:\n{proc.stderr[-2000:]}")
    for line in proc.stderr.splitlines():
        if "Collected" in line:
            return int(line.split()[-1])
    raise RuntimeError(f"callgrind gave no count for {which}:\n{proc.stderr[-2000:]}")


def per_call(which, calls):
    return (instructions(which, 3 * calls) - instructions(which, calls)) / (2 * calls)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50000)
    parser.add_argument("--torch", action="store_true",
                        help="also the tiny call through mmdispatch.torch and torchvision")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("count_instructions: valgrind is not installed", file=sys.stderr)
        return 2
    dispatch, raw = per_call("dispatch", args.calls), per_call("raw", args.calls)
    tiny = per_call("tiny", args.calls // 5)
    allocating = per_call("allocating", args.calls // 5)
    print(f"dispatch {dispatch:.0f}  raw {raw:.0f}  dispatcher adds {dispatch - raw:.0f} "
          f"instructions per call")
    traced = per_call("tiny+trace", args.calls // 5)
    profiled = per_call("tiny+profile", args.calls // 5)
    print(f"ops.roi_align tiny call {tiny:.0f} instructions; with trace(no-op) "
          f"{traced:.0f} ({traced / tiny:.2f}x), with profile() {profiled:.0f} "
          f"({profiled / tiny:.2f}x)")
    print(f"roi_align_forward_impl allocating its outputs, tiny call {allocating:.0f} "
          "instructions")
    if args.torch:
        ours, theirs = per_call("torch", args.calls // 10), per_call("torchvision", args.calls // 10)
        print(f"mmdispatch.torch.roi_align tiny call {ours:.0f} instructions, "
              f"torchvision.ops.roi_align {theirs:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
