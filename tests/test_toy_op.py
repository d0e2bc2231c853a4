"""Adding an op touches only its own files (CONTRIBUTING.md): a toy op
(tests/support/toy_op: its header, CPU file, Python module and test file)
and one signature line are added to a copy of the source tree, which is
built (CPU only) and tested there: the op's own tests (numpy, errors, its
registry origin, its derived PyTorch op under opcheck), the ops package's
consistency checks, the code generator's tests, and a short fuzz run that
reaches the new entry point and function with no failure."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY = Path(__file__).resolve().parent / "support" / "toy_op"
SIGNATURE = ("toy_scale_impl(Tensor input, Tensor! output, float factor)\n"
             "    output = empty(input.shape)\n")
# where each file of the toy op goes in the tree
OWN_FILES = {
    "toy_scale.h": "include/mmdispatch/ops/toy_scale.h",
    "toy_scale.cpp": "src/cpu/toy_scale.cpp",
    "toy_scale.py": "mmdispatch/ops/toy_scale.py",
    "test_toy_scale.py.in": "tests/ops/test_toy_scale.py",
}

pytestmark = [
    pytest.mark.skipif(not (ROOT / "setup.py").exists() or not (ROOT / ".git").exists(),
                       reason="needs the source tree as a git checkout (this is a copy of "
                       "tests/ alone)"),
]


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [name for name in out.stdout.decode().split("\0") if name]


def copy_tree(destination):
    for name in tracked_files():
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


def snapshot(tree):
    return {str(p.relative_to(tree)): p.read_bytes() for p in tree.rglob("*") if p.is_file()}


def run(cmd, tree, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(tree), MMDISPATCH_WITH_CUDA="0")
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, **kwargs)


def test_an_op_added_with_its_own_files_and_a_signature_line_builds_and_works(tmp_path):
    pytest.importorskip("Cython", reason="building the copy needs Cython")
    tree = tmp_path / "tree"
    copy_tree(tree)
    before = snapshot(tree)
    with open(tree / "mmdispatch" / "signatures.txt", "a") as f:
        f.write(SIGNATURE)
    for source, target in OWN_FILES.items():
        shutil.copy2(TOY / source, tree / target)
    changed = {name for name, data in snapshot(tree).items() if before.get(name) != data}
    assert changed == {"mmdispatch/signatures.txt", *OWN_FILES.values()}

    build = run([sys.executable, "setup.py", "build_ext", "--inplace"], tree, timeout=1200)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]

    tests = run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                 "tests/ops/test_toy_scale.py", "tests/ops/test_package.py",
                 "tests/test_codegen.py"], tree, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    assert "passed" in tests.stdout.splitlines()[-1]
    # nothing skips but the CUDA opcheck (the toy op has no CUDA kernel)
    skips = [line for line in tests.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all(line.endswith(("CUDA kernels unusable here", "toy_scale_impl has no CUDA kernel"))
               for line in skips), skips

    summary = tmp_path / "fuzz.json"
    fuzz = run([sys.executable, "tests/support/fuzz.py", "--seconds", "4", "--workers", "1",
                "--json", str(summary), "--crash-dir", str(tmp_path / "crashes")], tree,
               timeout=300)
    assert fuzz.returncode == 0, fuzz.stdout[-3000:] + fuzz.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["failures"] == 0
    assert result["per_target"].get("toy_scale_impl", 0) > 0
    assert result["per_target"].get("ops.toy_scale", 0) > 0
