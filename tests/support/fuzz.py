#!/usr/bin/env python3
"""Fuzzes mmdispatch's dispatch entry points (mmdispatch.<op>_impl) and user
functions (mmdispatch.ops.*) with arbitrary Python objects, for a fixed time.

    python tests/support/fuzz.py --seconds 600             # the long run (2 workers)
    python tests/support/fuzz.py --seconds 20 --json out   # what tests/test_fuzz.py runs

Arguments are drawn by hypothesis (one long sequence of fresh examples, no
shrinking): None, bools, ints up to 2**100, floats with NaN / inf, strings,
bytes, nested lists and dicts, numpy arrays of every dtype (object, str,
datetime, complex, byte-swapped...) and shape (zero-sized, 9-D), strided /
read-only / unaligned / broadcast / subclass views, memoryviews, and objects
whose __dlpack__, __dlpack_device__, __cuda_array_interface__, __index__,
__float__, __bool__ or __len__ return garbage or raise; half the time they
start from a plausible call of the op so that the kernels run too. A no-op
C kernel (mmdispatch._benchkit) is registered for roi_align_forward_impl on
cuda and vulkan, so CUDA-array and DLPack intake runs even without a GPU.

Outcomes per case: an answer; an allowed error (TypeError, ValueError,
KernelNotFoundError, DeviceMismatchError, MemoryError) whose message starts
with the op's name; or an exception raised by the fuzz objects' own methods,
passed through unchanged ("propagated"). Anything else is a failure: another
exception type or message, a changed input (or a changed output after an
error), an accepted output overlapping an input, or a crash. Cases run in
child processes, so a segfault or abort is recorded (with the case's
description) and the child restarted; a case running longer than --hang
seconds is recorded as a hang.

--known-bugs-off leaves out the argument kinds that trip known, reported
dispatcher bugs (see KNOWN_BUG_KINDS), so the rest of the run can show 0.
--dlpack-lies adds DLPack capsules whose metadata is inconsistent (negative
sizes, negative ndim); DLPack producers are trusted, so these are opt-in.
"""
import argparse
import collections
import ctypes
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback

CASE_FILE_SIZE = 8192  # the case being run: its bytes (hex) and a description

# Argument kinds that trip dispatcher bugs reported but not fixed in this
# tree (mmdispatch/_core.pyx, _intake.pxi): left out by --known-bugs-off.
KNOWN_BUG_KINDS = {}  # none open: the five kinds found so far are fixed


# --- the child: generate, call, classify ------------------------------------------------

def limit_memory():
    """A huge allocation must be a MemoryError here, not the OOM killer.
    RLIMIT_DATA (private writable memory), not RLIMIT_AS: the CUDA driver,
    CuPy and torch reserve far more address space than they use (PROT_NONE
    ranges), which an address-space limit refuses."""
    if "asan" not in os.environ.get("LD_PRELOAD", ""):
        limit = 8 << 30
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def describe(value, depth=0):
    """A short description of an argument, the same in a replay."""
    import numpy as np

    if isinstance(value, np.ndarray):
        flags = "".join(c for c, f in (("C", "C_CONTIGUOUS"), ("W", "WRITEABLE"),
                                       ("A", "ALIGNED")) if value.flags[f])
        return (f"{type(value).__name__}(shape={value.shape}, dtype={value.dtype.str}, "
                f"strides={value.strides}, flags={flags})")
    if isinstance(value, (list, tuple)) and depth < 2:
        inner = ", ".join(describe(v, depth + 1) for v in value[:4])
        return f"{type(value).__name__}[{inner}{', ...' if len(value) > 4 else ''}]"
    text = re.sub(r" at 0x[0-9a-f]+", "", repr(value))
    return text if len(text) < 120 else text[:117] + "..."


class Runner:
    """Runs cases in this (child) process and classifies their outcomes;
    the case being run is kept in the case file, for the parent to save if
    the child dies."""

    def __init__(self, args, cases):
        import mmdispatch

        self.args, self.cases = args, cases
        self.allowed = (TypeError, ValueError, mmdispatch.KernelNotFoundError,
                        mmdispatch.DeviceMismatchError, MemoryError)
        self.state = dict(cases=0, per_target=collections.Counter(),
                          outcomes=collections.Counter(), failures={},
                          propagated=collections.Counter())
        self.case_file = os.open(args.case_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def record_failure(self, signature, description):
        entry = self.state["failures"].setdefault(signature,
                                                  {"count": 0, "example": description})
        entry["count"] += 1

    def call(self, target, fn, values, prefixes, description):
        """Calls fn and returns the exception it raised, or None."""
        import numpy as np

        outcomes = self.state["outcomes"]
        try:
            with np.errstate(all="ignore"):
                fn(*values)
            outcomes["answer"] += 1
            return None
        except self.cases.Boom as exc:
            self.state["propagated"][f"{target}: {exc}"] += 1
            outcomes["propagated"] += 1
            return exc
        except self.allowed as exc:
            outcomes[type(exc).__name__] += 1
            if not str(exc).startswith(prefixes):
                self.record_failure(f"{target}: {type(exc).__name__} without the op name: "
                                    f"{normalise(str(exc))}", description)
            return exc
        except Exception as exc:
            outcomes["other"] += 1
            self.record_failure(f"{target}: {type(exc).__name__}: {normalise(str(exc))}",
                                description)
            return exc

    def check_writes(self, target, snapshots, outputs, error, description):
        """Inputs must be unchanged, and every argument after an error."""
        import numpy as np

        output_arrays = [a for i, a, _ in snapshots if i in outputs]
        for i, a, before in snapshots:
            if a.tobytes() == before:
                continue
            if error is not None:
                self.record_failure(f"{target}: an argument was written by a call that raised",
                                    description)
            elif i not in outputs:
                overlaps = any(o.size and a.size and np.may_share_memory(a, o)
                               for o in output_arrays)
                self.record_failure(f"{target}: " + (
                    "an output overlapping an input was accepted" if overlaps
                    else "an input was written"), description)

    def run(self, data, target, fn, values, outputs, prefixes):
        description = f"{target}({', '.join(describe(v) for v in values)})"
        os.pwrite(self.case_file, (data.hex() + "\n" + description).encode("utf-8", "replace")
                  [:CASE_FILE_SIZE].ljust(CASE_FILE_SIZE), 0)
        snapshots = [(i, a, a.tobytes()) for i, v in enumerate(values)
                     for a in self.cases.arrays_in(v) if a.dtype.kind != "O"]
        self.state["cases"] += 1
        self.state["per_target"][target] += 1
        if self.state["cases"] == self.args.selftest_crash_at:   # proves crashes are caught
            ctypes.string_at(0)
        error = self.call(target, fn, values, prefixes, description)
        self.check_writes(target, snapshots, outputs, error, description)

    def report(self, keys=("cases", "per_target", "outcomes", "failures", "propagated")):
        print(json.dumps({key: self.state[key] for key in keys}), flush=True)


def child_main(args):
    """Generates, calls and classifies cases until --seconds have passed
    (or replays one case), printing a JSON report after each batch."""
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st

    import fuzz_cases as cases   # tests/support, this file's directory
    import mmdispatch
    from mmdispatch import _benchkit

    limit_memory()
    cases.OPTIONS.dlpack_lies = args.dlpack_lies
    cases.OPTIONS.skip = set(KNOWN_BUG_KINDS) if args.known_bugs_off else set()
    noop = _benchkit.noop_roi_align_forward_kernel()
    for device in ("cuda", "vulkan"):
        mmdispatch.register_impl("roi_align_forward_impl", device, noop, override=True)
    runner = Runner(args, cases)

    if args.replay:
        data = bytes.fromhex(open(args.replay).read().split()[0])
        case = cases.make_case(data)
        print(f"replaying {case[0]}({', '.join(describe(v) for v in case[2])})", flush=True)
        runner.run(data, *case)
        runner.report(("outcomes", "failures", "propagated"))
        return

    @settings(max_examples=args.batch, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.binary(min_size=64, max_size=1024))
    def fuzz(data):
        if runner.state["cases"] < len(cases.targets):
            # each child starts with one case per target, so a short run
            # reaches every target whatever bytes hypothesis draws
            data = bytes([runner.state["cases"]]) + data[1:]
        runner.run(data, *cases.make_case(data))

    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        try:
            fuzz()
        except Exception as exc:  # a bug in the generators themselves
            runner.record_failure(f"harness: {type(exc).__name__}: {normalise(str(exc))}",
                                  traceback.format_exc()[-1500:])
        runner.report()
    os.close(runner.case_file)


def normalise(message):
    """The message with numbers and reprs blurred, to group failures."""
    message = re.sub(r"0x[0-9a-f]+", "0x?", message)
    message = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", message)
    return message[:160]


# --- the parent: children, crash detection, summary ------------------------------------------

def run_worker(args, worker, seconds, totals):
    """Runs children until `seconds` have passed, restarting after a crash."""
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left < 1:
            return
        with tempfile.NamedTemporaryFile(prefix="mmd-fuzz-case-", delete=False) as f:
            case_file = f.name
        command = [sys.executable, os.path.abspath(__file__), "--child", "--seconds",
                   f"{left:.1f}", "--case-file", case_file, "--batch", str(args.batch)]
        if args.known_bugs_off:
            command.append("--known-bugs-off")
        if args.dlpack_lies:
            command.append("--dlpack-lies")
        if args.selftest_crash_at and not totals["crashes"]:
            command += ["--selftest-crash-at", str(args.selftest_crash_at)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        last, hung = None, False
        try:
            stdout, stderr = proc.communicate(timeout=left + args.hang)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            hung = True
        for line in stdout.splitlines():
            if line.startswith("{"):
                last = json.loads(line)
        if last:
            merge(totals, last)
        if proc.returncode != 0 or hung:
            with open(case_file, encoding="utf-8", errors="replace") as f:
                case = f.read().strip()
            os.makedirs(args.crash_dir, exist_ok=True)
            saved = os.path.join(args.crash_dir, f"case-{worker}-{len(totals['crashes'])}-"
                                                 f"{int(time.time())}.txt")
            with open(saved, "w") as f:
                f.write(case)
            kind = "hang" if hung else (f"signal {-proc.returncode}" if proc.returncode < 0
                                        else f"exit {proc.returncode}")
            totals["crashes"].append(dict(worker=worker, kind=kind,
                                          case=case.split("\n", 1)[-1], saved=saved,
                                          replay=f"python tests/support/fuzz.py --replay {saved}",
                                          stderr=stderr[-2000:]))
            totals["cases"] += 1
        os.unlink(case_file)
        if proc.returncode == 0 and not hung:
            return


def merge(totals, report):
    totals["cases"] += report["cases"]
    for key in ("per_target", "outcomes", "propagated"):
        totals[key].update(report[key])
    for signature, entry in report["failures"].items():
        mine = totals["failures"].setdefault(signature, {"count": 0, "example": entry["example"]})
        mine["count"] += entry["count"]


def parent_main(args):
    import threading

    totals = dict(cases=0, per_target=collections.Counter(), outcomes=collections.Counter(),
                  propagated=collections.Counter(), failures={}, crashes=[])
    lock = threading.Lock()
    per_worker = []

    def worker(index):
        mine = dict(cases=0, per_target=collections.Counter(), outcomes=collections.Counter(),
                    propagated=collections.Counter(), failures={}, crashes=[])
        run_worker(args, index, args.seconds, mine)
        with lock:
            per_worker.append(mine)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for mine in per_worker:
        merge(totals, dict(mine, failures=mine["failures"]))
        totals["crashes"].extend(mine["crashes"])
    elapsed = time.monotonic() - started
    failures = sum(e["count"] for e in totals["failures"].values()) + len(totals["crashes"])
    summary = dict(seconds=round(elapsed, 1), workers=args.workers, cases=totals["cases"],
                   failures=failures, crashes=totals["crashes"], failure_kinds=totals["failures"],
                   outcomes=dict(totals["outcomes"]), per_target=dict(totals["per_target"]),
                   propagated=sum(totals["propagated"].values()),
                   known_bugs_off=args.known_bugs_off, dlpack_lies=args.dlpack_lies)
    print(f"mmdispatch fuzz: {summary['cases']} cases in {summary['seconds']} s "
          f"({args.workers} workers), {failures} failures, {len(totals['crashes'])} crashes")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(totals["outcomes"].items())))
    print(f"exceptions from the fuzz objects' own methods passed through: "
          f"{summary['propagated']}")
    for signature, entry in sorted(totals["failures"].items(), key=lambda kv: -kv[1]["count"]):
        print(f"FAILURE x{entry['count']}: {signature}\n    e.g. {entry['example'][:600]}")
    for crash in totals["crashes"]:
        print(f"CRASH ({crash['kind']}): {crash['case'][:600]}\n    replay: {crash['replay']}"
              f"\n    {crash['stderr'][-600:]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=500, help="examples per hypothesis run")
    parser.add_argument("--hang", type=float, default=60,
                        help="seconds past the budget after which a child counts as hung")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--crash-dir", default="fuzz-crashes",
                        help="where the case of each crash or hang is saved")
    parser.add_argument("--known-bugs-off", action="store_true")
    parser.add_argument("--dlpack-lies", action="store_true")
    parser.add_argument("--replay", help="run the case saved in this file (a crash's case "
                        "file: its first line is the case's bytes in hex) in this process")
    parser.add_argument("--selftest-crash-at", type=int, default=0,
                        help="segfault on purpose at this case (once), to check that "
                        "crashes are caught, saved and replayable")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or args.replay:
        if args.replay and not args.case_file:
            args.case_file = os.devnull
        child_main(args)
        return 0
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
