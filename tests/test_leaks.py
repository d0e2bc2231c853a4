"""A short run of tests/support/leakcheck.py (answered and refused dispatches of
every kind, RSS from /proc/self/statm) in a fresh process; the long run is
`python tests/support/leakcheck.py` (a million calls)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LEAKCHECK = Path(__file__).resolve().parent / "support" / "leakcheck.py"


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc/self/statm")
def test_small_calls_and_error_paths_keep_rss_flat(tmp_path):
    figures = tmp_path / "leak.json"
    # one thread: the check is about memory, and waking workers
    # for every tiny call is slow on a busy 2-core machine
    proc = subprocess.run(
        [sys.executable, str(LEAKCHECK), "--calls", "30000", "--max-growth-kib", "2048",
         "--json", str(figures)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(figures.read_text())
    # 27000 calls after the warm-up; a leak of even 100 bytes per call would
    # be 2.6 MiB
    assert result["growth_kib"] <= 2048
