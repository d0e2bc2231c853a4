"""mmdispatch.profile(): a dispatch hook that records every call.

    with mmdispatch.profile() as p:
        run_model()
    print(p.table())
    p.export_chrome_trace("trace.json")   # Perfetto, chrome://tracing

Each record (a CallRecord) holds the op, device, backend, kernel kind,
dtypes, shapes, thread and host time around the kernel. On a CUDA device
the profiler also records a pair of CUDA events on the kernel's stream
(with CuPy, or torch, whichever is imported) and reads the device time
between them when the profile is read; only then does it wait for the
device.
"""
import json
import os
import sys
import threading

from mmdispatch import _core

__all__ = ["profile"]


class _Events:
    """A start and end CUDA event on one stream, of CuPy or torch."""

    def __init__(self, stream):
        cupy, torch = sys.modules.get("cupy"), sys.modules.get("torch")
        if cupy is not None:
            self.library = "cupy"
            self.stream = cupy.cuda.ExternalStream(stream)
            self.start, self.end = cupy.cuda.Event(), cupy.cuda.Event()
        elif torch is not None:
            self.library = "torch"
            self.stream = torch.cuda.ExternalStream(stream)
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
        else:
            raise LookupError("neither CuPy nor torch is imported")
        self.start.record(self.stream)

    def stop(self):
        self.end.record(self.stream)

    def elapsed_ns(self):
        self.end.synchronize()
        if self.library == "cupy":
            return round(sys.modules["cupy"].cuda.get_elapsed_time(self.start, self.end) * 1e6)
        return round(self.start.elapsed_time(self.end) * 1e6)


class profile:
    """Records every dispatched call while active (a ``with`` block, or
    ``start()`` / ``stop()``), from every thread. ``device_time=False``
    skips the CUDA events. ``calls`` is the list of CallRecords, in the
    order the calls ended."""

    def __init__(self, *, device_time=True):
        self.device_time = device_time
        self.calls = []
        self._handle = None
        self._lock = threading.Lock()

    # the hook protocol (mmdispatch.add_hook)
    def begin(self, call):
        if self.device_time and call.stream is not None:
            try:
                call.notes["profile_events"] = _Events(call.stream)
            except LookupError:
                pass

    def end(self, call):
        if call.stream is not None:
            events = call.notes.get("profile_events")
            if events is not None:
                events.stop()
        self.calls.append(call)

    def start(self):
        with self._lock:
            if self._handle is not None:
                raise RuntimeError("profile: already started")
            self._handle = _core.add_hook(self)
        return self

    def stop(self):
        with self._lock:
            if self._handle is not None:
                self._handle.remove()
                self._handle = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @staticmethod
    def device_ns(call):
        """Device time of a recorded call in ns (waits for its end event),
        or None where none was recorded (not a CUDA call)."""
        events = call.notes.get("profile_events") if call.stream is not None else None
        if events is None:
            return None
        if "profile_device_ns" not in call.notes:
            call.notes["profile_device_ns"] = events.elapsed_ns()
        return call.notes["profile_device_ns"]

    def summary(self):
        """One dict per op: op, calls, host_ns (total), mean_host_ns,
        device_ns (total, None without device times), errors; sorted by
        total time, device time where there is one, descending."""
        rows = {}
        for call in list(self.calls):
            row = rows.setdefault(call.op, {"op": call.op, "calls": 0, "host_ns": 0,
                                            "device_ns": None, "errors": 0})
            row["calls"] += 1
            row["host_ns"] += call.host_ns
            row["errors"] += call.error is not None
            device = self.device_ns(call)
            if device is not None:
                row["device_ns"] = (row["device_ns"] or 0) + device
        for row in rows.values():
            row["mean_host_ns"] = row["host_ns"] / row["calls"]
        return sorted(rows.values(), key=lambda r: (-max(r["host_ns"], r["device_ns"] or 0),
                                                    r["op"]))

    def table(self):
        """The per-op summary as a text table, sorted by total time."""
        head = ("op", "calls", "host total", "host mean", "device total", "errors")
        lines = [head]
        for row in self.summary():
            device = row["device_ns"]
            lines.append((row["op"], str(row["calls"]), _ms(row["host_ns"]),
                          _ms(row["mean_host_ns"]), "-" if device is None else _ms(device),
                          str(row["errors"])))
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        text = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                          for i, (cell, w) in enumerate(zip(line, widths))) for line in lines]
        text.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(text)

    def __str__(self):
        return self.table()

    def export_chrome_trace(self, path):
        """Writes the calls as a Chrome trace (JSON, "X" events, times in
        µs on the host clock): one track per thread, and one per CUDA device
        for device times, placed at the host start of each call (CUDA events
        give a duration, not a time on the host clock)."""
        pid = os.getpid()
        events = [{"name": "process_name", "ph": "M", "pid": pid,
                   "args": {"name": "mmdispatch"}}]
        device_tracks = {}
        for call in list(self.calls):
            args = {"device": call.device, "backend": call.backend, "kernel": call.kernel,
                    "shapes": {n: s for n, s in zip(call.names, call.shapes) if s is not None},
                    "dtypes": {n: d for n, d in zip(call.names, call.dtypes) if d is not None}}
            if call.error is not None:
                args["error"] = f"{type(call.error).__name__}: {call.error}"
            events.append({"name": call.op, "cat": "host", "ph": "X", "pid": pid,
                           "tid": call.thread, "ts": call.start_ns / 1e3,
                           "dur": call.host_ns / 1e3, "args": args})
            device = self.device_ns(call)
            if device is not None:
                tid = device_tracks.get(call.device)
                if tid is None:   # a numbered track per device, named by metadata
                    tid = device_tracks[call.device] = -1 - len(device_tracks)
                    events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                   "args": {"name": f"{call.device} (device time)"}})
                events.append({"name": call.op, "cat": "device", "ph": "X", "pid": pid,
                               "tid": tid, "ts": call.start_ns / 1e3, "dur": device / 1e3,
                               "args": args})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return path


def _ms(ns):
    return f"{ns / 1e6:.3f} ms"
