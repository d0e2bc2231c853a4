"""Registers, stack frame and spills of every CUDA kernel, as ptxas reports
them, without a GPU: what decides a kernel's occupancy (registers per thread
x threads per block against the SM's 64K registers) and whether it keeps
arrays in local memory (a stack frame) or spills. Compiles src/cuda/*.cu
(or the files named) with nvcc's -Xptxas -v for one architecture, the
build's flags, and prints one line per kernel: registers, stack bytes,
spill stores/loads bytes, the warps an SM can hold by registers (65,536
registers over 32 x the thread's registers rounded up to 8, at most 64),
and the demangled name.

    python tools/kernel_resources.py                    # every kernel, sm_90
    python tools/kernel_resources.py src/cuda/roi_align.cu --grep avg_
    python tools/kernel_resources.py --arch 80 --grep "<float>"

Needs nvcc (and c++filt to demangle); run it from anywhere. It writes only
temporary files, and uses build/generated for the registry header (a
`pip install .` of the working tree makes it)."""
import argparse
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
ALLOCATION_UNIT = 8   # registers are given per thread in multiples of 8


def demangle(names):
    if not names or shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return [re.sub(r"\(anonymous namespace\)::|\(.*$", "", name) for name in out]


def kernels(source, arch):
    """[(name, registers, stack, spill_stores, spill_loads)] of one file."""
    generated = ROOT / "build" / "generated"
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            ["nvcc", "-c", str(source), "-o", str(pathlib.Path(tmp) / "k.o"), "-O3",
             "-std=c++17", "-fmad=false", "-Xcompiler", "-fPIC", f"-I{ROOT / 'include'}",
             f"-I{generated}", "-gencode", f"arch=compute_{arch},code=sm_{arch}",
             "-Xptxas", "-v"], capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"nvcc failed on {source}:\n{result.stderr[-2000:]}")
    rows, name, stack = [], None, (0, 0, 0)
    for line in result.stderr.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                      r"loads", line)
        if m:
            stack = tuple(int(v) for v in m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            rows.append((name, int(m.group(1)), *stack))
            name = None
    names = demangle([row[0] for row in rows])
    return [(n, *row[1:]) for n, row in zip(names, rows)]


def warps_per_sm(registers):
    """Warps an SM holds by registers alone (blocks round it down to whole
    blocks: 2 blocks of 256 threads at 96 registers, 16 of its 21 warps)."""
    per_thread = -(-registers // ALLOCATION_UNIT) * ALLOCATION_UNIT
    return min(MAX_WARPS_PER_SM, REGISTERS_PER_SM // (per_thread * 32))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", help="CUDA files (default src/cuda/*.cu)")
    parser.add_argument("--arch", default="90", help="compute capability, e.g. 90 (default)")
    parser.add_argument("--grep", default=None, help="only kernels whose name contains this")
    args = parser.parse_args(argv)
    if shutil.which("nvcc") is None:
        sys.exit("kernel_resources: nvcc is not on PATH")
    if not (ROOT / "build" / "generated" / "mmdispatch_generated.h").exists():
        sys.exit("kernel_resources: build/generated/mmdispatch_generated.h is missing; "
                 "`pip install .` in the repository makes it")
    sources = ([pathlib.Path(s) for s in args.sources] or
               sorted((ROOT / "src" / "cuda").glob("*.cu")))
    print(f"{'regs':>4} {'stack':>5} {'spill st/ld':>11} {'warps':>5}  kernel (sm_{args.arch}; "
          "warps per SM by registers)")
    for source in sources:
        for name, registers, stack, stores, loads in kernels(source, args.arch):
            if args.grep and args.grep not in name:
                continue
            print(f"{registers:>4} {stack:>5} {f'{stores}/{loads}':>11} "
                  f"{warps_per_sm(registers):>5}  {source.name}: {name}")


if __name__ == "__main__":
    main()
