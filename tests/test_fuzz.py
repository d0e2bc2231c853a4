"""A short run of the fuzz harness (tests/support/fuzz.py): arbitrary Python objects
into every dispatch entry point and user function for a few seconds, in a
child process; no crash and no failure. The long run is
`python tests/support/fuzz.py --seconds 600`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hypothesis", reason="the fuzz harness draws its bytes with hypothesis")

FUZZ = Path(__file__).resolve().parent / "support" / "fuzz.py"


def run_fuzz(tmp_path, *extra):
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(FUZZ), "--workers", "1", "--json", str(summary), "--crash-dir",
         str(tmp_path / "crashes"), *extra],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONHASHSEED="0"))
    assert summary.exists(), proc.stdout + proc.stderr
    return proc, json.loads(summary.read_text())


def test_short_fuzz_run_has_no_crash_and_no_failure(tmp_path):
    # every argument kind, the ones that found bugs before included
    proc, summary = run_fuzz(tmp_path, "--seconds", "6", "--batch", "100")
    print(proc.stdout)
    assert summary["crashes"] == []
    assert summary["failure_kinds"] == {}
    assert summary["failures"] == 0 and proc.returncode == 0
    assert summary["cases"] >= 300
    # every entry point and user function was reached, and some calls succeeded
    import mmdispatch
    from mmdispatch import ops
    targets = set(mmdispatch.op_signatures()) | {f"ops.{name}" for name in ops.__all__}
    assert set(summary["per_target"]) == targets
    assert summary["outcomes"].get("answer", 0) > 0


def test_a_crash_in_the_child_is_caught_saved_and_replayable(tmp_path):
    proc, summary = run_fuzz(tmp_path, "--seconds", "2", "--batch", "100", "--known-bugs-off",
                             "--selftest-crash-at", "20")
    assert proc.returncode == 1
    [crash] = summary["crashes"]
    # SIGSEGV; under a sanitizer, its report and exit status 1
    assert crash["kind"] in ("signal 11", "exit 1"), crash
    saved = Path(crash["saved"])
    # the saved case (its bytes) replays the same call
    replay = subprocess.run([sys.executable, str(FUZZ), "--replay", str(saved)],
                            capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr
    assert replay.stdout.startswith(f"replaying {crash['case'][:200]}")
