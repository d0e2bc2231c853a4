"""The CUDA kernels of src/cuda, run on the CPU for the tests.

Most machines that run the tests have no GPU, so the CUDA kernels would
otherwise be compiled and never run. This builds src/cuda/*.cu with the host
C++ compiler against a small emulation of CUDA C++ and its runtime
(include/ here: each CUDA thread a fiber, barriers and warp operations
switching between them, device memory in host memory; runtime.cpp), into a
shared library with its own copy of src/core, and registers its kernels in
mmdispatch's CUDA slots as C kernel capsules (``mmdispatch.register_impl``).
Arrays that claim cuda:0 through ``__cuda_array_interface__`` over host
memory (``DeviceView``) then reach them through the real dispatcher.

What it checks: each kernel's arithmetic, indexing and bounds logic, its
barriers and warp operations (a lane missing from one is an error), launch
sizes CUDA refuses, device memory freed, and host waits counted. What it
cannot: timing, the memory model of a real GPU, float atomics' order.
Threads switch only at barriers and warp operations, by default in index
order, which hides a missing barrier between a write and another thread's
read; MMD_EMU_ORDER=reverse or shuffle:<seed> runs blocks, threads and
warps in other orders (runtime.cpp) to show such races.

The library's copy of src/core keeps its own error message: a failing
kernel's message is ``Emulator.last_error()``, not the exception's text.
"""
import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
CUDA_DIR = ROOT / "src" / "cuda"
# src/core files the kernels call into (messages, deferred errors, roi checks)
CORE_SOURCES = ("errors.c", "deferred.c", "rois.c")
# CUDA_EMU_SANITIZE=address builds the library with AddressSanitizer, the
# CPU's stand-in for compute-sanitizer's memcheck (an out-of-bounds read or
# write in a kernel stops the process with a report). Python must then run
# with the runtime preloaded, and pytest must not capture (the report goes
# to the process's stderr as it dies):
#   CUDA_EMU_SANITIZE=address LD_PRELOAD=$(gcc -print-file-name=libasan.so) \
#   ASAN_OPTIONS=detect_leaks=0 pytest -s tests/cuda tests/ops -k emulated
SANITIZE = [f"-fsanitize={os.environ['CUDA_EMU_SANITIZE']}", "-fno-omit-frame-pointer"] \
    if os.environ.get("CUDA_EMU_SANITIZE") else []
# MMD_CUDA_MAX_GRID_Y (mmdispatch/cuda/common.cuh): kernels that loop over
# the rows their grid's height does not cover run those loops on small
# inputs; MMD_CUDA_BAND_BYTES (roi_align.cu): the deterministic backward
# splits small maps into bands of rows, a partial one last;
# MMD_CUDA_NMS_SHARED_WORDS (nms.cuh): nms over more than 512 boxes keeps
# its reduction's words in global memory, fewer in shared memory;
# MMD_CUDA_CELL_WALK_MAX (roi_align.cu): roi_align's avg kernels sum maps
# wider or taller than 64 sample by sample;
# MMD_CUDA_TRANSPOSED_MIN_READS and _MIN_ROIS (roi_align.cu): every avg
# forward and default backward of 16 channels or more takes the transposed
# kernels, whatever its size; MMD_CUDA_AXIS_CAP (roi_align.cu): those
# kernels take a roi's cells from lists of at most 5 per row or column of
# bins, and walk the bins of rois that read more (both in most calls);
# MMD_CUDA_MAX_BLOCKS (common.cuh): grids of at
# most 3 blocks, so that every grid-stride loop runs more than once;
# MMD_CUDA_EMULATOR (cublas.cu): the products take the emulator's cuBLAS
# stand-in, while a test switches it on (Emulator.cublas);
# MMD_DCN_COLUMN_BUDGET and _IMAGES_BUDGET (deform_conv2d.cu's column
# buffers, in values): the tests' small calls take several passes, an
# image's pixels in chunks or a few whole images a pass.
DCN_COLUMN_BUDGET, DCN_IMAGES_BUDGET = 30000, 50000
CXXFLAGS = ["-std=c++17", "-O1", "-fPIC", "-fno-exceptions", "-w", "-DMMD_CUDA_MAX_GRID_Y=2",
            f"-DMMD_DCN_COLUMN_BUDGET={DCN_COLUMN_BUDGET}",
            f"-DMMD_DCN_IMAGES_BUDGET={DCN_IMAGES_BUDGET}",
            "-DMMD_CUDA_BAND_BYTES=600", "-DMMD_CUDA_NMS_SHARED_WORDS=8",
            "-DMMD_CUDA_CELL_WALK_MAX=64", "-DMMD_CUDA_TRANSPOSED_MIN_READS=0",
            "-DMMD_CUDA_TRANSPOSED_MIN_ROIS=0", "-DMMD_CUDA_AXIS_CAP=5",
            "-DMMD_CUDA_MAX_BLOCKS=3", "-DMMD_CUDA_CHUNK_GROUP_MAX=2",
            "-DMMD_CUDA_EMULATOR", *SANITIZE]
CFLAGS = ["-std=c11", "-O1", "-fPIC", "-w", *SANITIZE]

_LAUNCH_NAME = re.compile(r"([A-Za-z_]\w*(?:::\w+)*(?:<[^<>;{}()]*>)?)\s*$")
_COMMENTS = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+([\w\s]+?)\s*(\w+)\s*\[\s*\]\s*;")
# a static __shared__ declaration inside a function (indented), one or more
# declarators: `__shared__ T a[N], b;`
_STATIC_SHARED = re.compile(r"(?m)^([ \t]+(?:alignas\(\w+\)\s+)?)__shared__\s+([^;{}()]+);")


def unavailable_reason():
    """Why the emulator cannot be built here, or None."""
    if not CUDA_DIR.is_dir():
        return "the CUDA sources (src/cuda) are not beside these tests"
    if _compiler("CXX", "g++") is None or _compiler("CC", "gcc") is None:
        return "no C/C++ compiler (g++/gcc or $CXX/$CC) to build the CUDA emulator"
    return None


def _compiler(var, default):
    return os.environ.get(var) or shutil.which(default)


def _matching_paren(text, start):
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced parentheses after a launch")


def _split_declarators(text):
    """`T a[N + 1], b` -> ["T a[N + 1]", " b"]: commas outside square
    brackets (a type with a comma, Foo<a, b>, would be split: the build
    then fails, loudly)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "[" and 1 or ch == "]" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def _static_shared(match):
    """A static __shared__ declaration as a function-local static, each of
    its variables handed to mmd_emu::shared_region (filled with 0xff bytes
    at each block's start, as the dynamic shared memory is)."""
    names = [re.match(r"\s*(?:.*\s)?(\w+)\s*(?:\[|$)", d.split("[", 1)[0] + "[").group(1)
             for d in _split_declarators(match.group(2))]
    fills = " ".join(f"::mmd_emu::shared_region(&{n}, sizeof({n}));" for n in names)
    return f"{match.group(1)}static {match.group(2)}; {fills}"


def translate(source):
    """CUDA C++ -> the emulator's C++: `kernel<<<cfg>>>(args)` becomes a
    launch of a closure that calls kernel(args) in every thread, `extern
    __shared__ T name[]` the block's dynamic shared memory, and a static
    `__shared__` variable a function-local static that each block finds
    filled with 0xff bytes, as a GPU's shared memory holds garbage."""
    source = _EXTERN_SHARED.sub(
        lambda m: f"{m.group(1)} *{m.group(2)} = ({m.group(1)} *)mmd_emu::block->dynamic_shared;",
        source)
    source = _STATIC_SHARED.sub(_static_shared, source)
    left = re.search(r".*\b__shared__\b.*", source)
    if left:   # a form the patterns above do not know would go unfilled
        raise ValueError(f"the CUDA emulator cannot translate this __shared__ declaration "
                         f"(write it as `[alignas(N)] __shared__ T name[...];`): "
                         f"{left.group(0).strip()}")
    out, pos = [], 0
    while True:
        start = source.find("<<<", pos)
        if start < 0:
            out.append(source[pos:])
            return "".join(out)
        name = _LAUNCH_NAME.search(source[max(pos, start - 300):start])
        if name is None:
            raise ValueError(f"cannot find the kernel launched at offset {start}")
        name_start = start - len(name.group(0))
        end = source.index(">>>", start)
        config = source[start + 3:end]
        open_paren = end + 3
        while source[open_paren].isspace():
            open_paren += 1
        if source[open_paren] != "(":
            raise ValueError(f"a launch without arguments at offset {start}")
        close = _matching_paren(source, open_paren)
        args = source[open_paren + 1:close]
        out.append(source[pos:name_start])
        kernel = name.group(1)
        out.append(f"mmd_emu::Launch({config})({_kernel_id(source, kernel)}, "
                   f"[&]() {{ {kernel}({args}); }})")
        pos = close + 1


def _kernel_id(source, kernel):
    """The launch's kernel identity for the emulator's per-kernel
    attributes (cudaFuncSetAttribute's shared memory allowance): the
    kernel's address where the source names it other than at its launches
    (a kernel given an attribute is named there, and so is a pointer to a
    kernel), else nullptr, which no allowance names (a template whose
    arguments the launch deduces has no address to take)."""
    code = _COMMENTS.sub(" ", source)
    # named as a value: not launched (<<<) nor defined or declared (a `(`)
    as_value = re.search(r"(?<![\w:])" + re.escape(kernel) + r"(?!\w)(?!\s*[(<])", code)
    return f"mmd_emu::kernel_id({kernel})" if as_value else "nullptr"


def _signatures():
    """The installed package's signatures: the kernels' C types must be the
    ones its dispatcher calls."""
    import mmdispatch
    return Path(mmdispatch.__file__).resolve().parent / "signatures.txt"


def _inputs():
    """Every file the library is built from, for its cache key."""
    files = sorted(CUDA_DIR.glob("*.cu")) + sorted(
        p for p in (ROOT / "include").rglob("*") if p.is_file())
    files += [ROOT / "src" / "core" / name for name in CORE_SOURCES]
    files += [_signatures(), _signatures().with_name("_codegen.py")]
    files += sorted(p for p in HERE.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return files


def build():
    """Builds (or finds, keyed by its sources) the emulator library; its path."""
    digest = hashlib.sha256()
    for path in _inputs():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(CXXFLAGS + CFLAGS).encode())
    key = digest.hexdigest()[:16]
    out_dir = ROOT / "build" / "cuda_emu"
    library = out_dir / f"libmmd_cuda_emu-{key}.so"
    if library.exists():
        return library
    work = out_dir / f"{key}.{os.getpid()}"   # test workers may build at once
    work.mkdir(parents=True, exist_ok=True)
    from mmdispatch import _codegen as codegen
    ops = codegen.read_signatures(_signatures())
    (work / "mmdispatch_generated.h").write_text(codegen.generate_header(ops))
    names = codegen.find_registrations(CUDA_DIR, "cuda")
    (work / "registrations.cpp").write_text(
        "".join(f'extern "C" void mmd_register_cuda__{n}(void);\n' for n in names)
        + 'extern "C" void mmd_emu_register_all(void) {\n'
        + "".join(f"    mmd_register_cuda__{n}();\n" for n in names) + "}\n")
    jobs = [(work / "registrations.cpp", "c++"), (HERE / "runtime.cpp", "c++")]
    for cu in sorted(CUDA_DIR.glob("*.cu")):
        translated = work / (cu.stem + ".cpp")
        text = f'#line 1 "{cu}"\n' + translate(cu.read_text())
        translated.write_text(text)
        jobs.append((translated, "c++"))
    jobs += [(ROOT / "src" / "core" / name, "c") for name in CORE_SOURCES]
    # the CUDA headers launch kernels too: translated copies shadow them
    shadow = work / "include" / "mmdispatch" / "cuda"
    shadow.mkdir(parents=True, exist_ok=True)
    for header in sorted((ROOT / "include" / "mmdispatch" / "cuda").glob("*.cuh")):
        (shadow / header.name).write_text(f'#line 1 "{header}"\n' + translate(header.read_text()))
    includes = ["-I", str(HERE / "include"), "-I", str(work / "include"), "-I",
                str(ROOT / "include"), "-I", str(work)]
    cxx, cc = _compiler("CXX", "g++"), _compiler("CC", "gcc")

    def compile_one(job):
        source, language = job
        obj = work / (source.stem + (".core.o" if language == "c" else ".o"))
        command = ([cxx, *CXXFLAGS] if language == "c++" else [cc, *CFLAGS])
        done = subprocess.run([*command, *includes, "-c", str(source), "-o", str(obj)],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"CUDA emulator: compiling {source.name} failed:\n"
                               f"{done.stderr[-6000:]}")
        return obj

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, jobs))
    partial = work / library.name
    done = subprocess.run([cxx, "-shared", *SANITIZE, "-Wl,-Bsymbolic", "-Wl,--no-undefined",
                           "-o", str(partial), *map(str, objects), "-lpthread"],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"CUDA emulator: linking failed:\n{done.stderr[-6000:]}")
    partial.replace(library)
    shutil.rmtree(work, ignore_errors=True)
    return library


_loaded = None


def load():
    """The emulator library of this process (built on first use)."""
    global _loaded
    if _loaded is None:
        _loaded = Emulator(build())
        _loaded.allocate_error_word()
    return _loaded


class Emulator:
    """The loaded library: its kernels, counters and error message."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(str(path))
        lib = self.lib
        for name, restype, argtypes in [
                ("mmd_emu_kernel_count", ctypes.c_int, []),
                ("mmd_emu_kernel_op", ctypes.c_char_p, [ctypes.c_int]),
                ("mmd_emu_kernel_origin", ctypes.c_char_p, [ctypes.c_int]),
                ("mmd_emu_kernel_backend", ctypes.c_int, [ctypes.c_int]),
                ("mmd_emu_kernel_fn", ctypes.c_void_p, [ctypes.c_int]),
                ("mmd_emu_launches", ctypes.c_longlong, []),
                ("mmd_emu_capture", None, [ctypes.c_int]),
                ("mmd_emu_capture_violations", ctypes.c_longlong, []),
                ("mmd_emu_host_waits", ctypes.c_longlong, []),
                ("mmd_emu_live_allocations", ctypes.c_longlong, []),
                ("mmd_emu_pool_maps", ctypes.c_longlong, []),
                ("mmd_emu_pool_kept_bytes", ctypes.c_longlong, []),
                ("mmd_cuda_empty_cache", ctypes.c_int, [ctypes.c_int]),
                ("mmd_emu_use_cublas", None, [ctypes.c_int]),
                ("mmd_emu_limit_scratch", None, [ctypes.c_longlong]),
                ("mmd_emu_cublas_calls", ctypes.c_longlong, []),
                ("mmd_emu_cublas_tf32_calls", ctypes.c_longlong, []),
                ("mmd_last_error", ctypes.c_char_p, []),
                ("mmd_emu_clear_error", None, []),
                ("mmd_cuda_synchronize", ctypes.c_int, [ctypes.c_int])]:
            getattr(lib, name).restype = restype
            getattr(lib, name).argtypes = argtypes
        lib.mmd_emu_register_all()
        self._capsule_names = {}
        self.kernels = [
            (lib.mmd_emu_kernel_op(i).decode(), lib.mmd_emu_kernel_backend(i),
             lib.mmd_emu_kernel_fn(i), lib.mmd_emu_kernel_origin(i).decode())
            for i in range(lib.mmd_emu_kernel_count())]

    def last_error(self):
        """The message of the emulated kernel that failed last in this
        thread since clear_error(); "" where none did."""
        return self.lib.mmd_last_error().decode("utf-8", "replace")

    def clear_error(self):
        self.lib.mmd_emu_clear_error()

    def synchronize(self):
        """mmdispatch.synchronize("cuda") for the emulated kernels: the
        deferred error they left, as (status, message), or (0, "")."""
        status = self.lib.mmd_cuda_synchronize(-1)
        return status, self.last_error() if status else ""

    def empty_cache(self):
        """mmdispatch.empty_cache("cuda") for the emulated kernels: its
        status (0 on success)."""
        return self.lib.mmd_cuda_empty_cache(-1)

    @contextlib.contextmanager
    def cublas(self, batched=True):
        """The products of the kernels that use the process's cuBLAS
        (mmdispatch/cuda/cublas.cuh) go to the emulator's stand-in while the
        block runs (outside it the process has none); counters() counts its
        calls as cublas_calls (a strided batched call counts once). With
        batched=False the stand-in lacks the strided batched products, as a
        cuBLAS before 8 would."""
        self.lib.mmd_emu_use_cublas(1 if batched else 2)
        try:
            yield self
        finally:
            self.lib.mmd_emu_use_cublas(0)

    @contextlib.contextmanager
    def scratch_limit(self, size):
        """Scratch allocations (the kernels' stream-ordered buffers) of
        more than `size` bytes fail while the block runs, as on a device
        without the memory for them."""
        self.lib.mmd_emu_limit_scratch(size)
        try:
            yield self
        finally:
            self.lib.mmd_emu_limit_scratch(0)

    @contextlib.contextmanager
    def capturing(self):
        """Every stream captures a CUDA graph while the block runs (in
        CUDA's global mode): launches still run at once, and the calls a
        capture forbids (synchronisations, cudaMalloc, cudaFree, cudaMemset,
        cudaMemcpy, cudaHostAlloc, cudaFreeHost, cudaMemPoolCreate, copies
        to the host)
        fail and are counted (counters()["capture_violations"])."""
        self.lib.mmd_emu_capture(1)
        try:
            yield self
        finally:
            self.lib.mmd_emu_capture(0)

    def counters(self):
        """launches, host waits, live device allocations, scratch-pool
        allocations that found no freed block to reuse (pool_maps), the
        freed bytes the pools keep (pool_kept_bytes), the products the
        cuBLAS stand-in made (cublas_calls; cublas_tf32_calls those of float
        operands under TF32 math, rounded to TF32) and the calls a capture refused
        (capture_violations, see capturing())."""
        return {"launches": self.lib.mmd_emu_launches(),
                "host_waits": self.lib.mmd_emu_host_waits(),
                "live_allocations": self.lib.mmd_emu_live_allocations(),
                "pool_maps": self.lib.mmd_emu_pool_maps(),
                "pool_kept_bytes": self.lib.mmd_emu_pool_kept_bytes(),
                "cublas_calls": self.lib.mmd_emu_cublas_calls(),
                "cublas_tf32_calls": self.lib.mmd_emu_cublas_tf32_calls(),
                "capture_violations": self.lib.mmd_emu_capture_violations()}

    @contextlib.contextmanager
    def active(self):
        """The emulated kernels in mmdispatch's CUDA slots (over a real
        GPU's, if any) while the block runs, every cuda:0 pointer taken as
        it comes (CuPy is not asked about host memory)."""
        import mmdispatch
        from mmdispatch import _core, _cuda

        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype = ctypes.py_object
        new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        backends = {0: "default", 1: "reference", 2: "deterministic"}
        handles = []
        _core._set_cai_device_resolver(lambda pointer: 0)
        try:
            for op, backend, fn, _origin in self.kernels:
                name = self._capsule_names.setdefault(op, ctypes.create_string_buffer(
                    mmdispatch.kernel_capsule_name(op).encode()))   # the capsule keeps a pointer
                capsule = new_capsule(fn, ctypes.addressof(name), None)
                handles.append(mmdispatch.register_impl(op, "cuda", capsule,
                                                        backend=backends[backend], override=True))
            yield self
        finally:
            for handle in reversed(handles):
                handle.remove()
            _core._set_cai_device_resolver(_cuda.pointer_device)

    def allocate_error_word(self):
        """Makes the device allocate its deferred-error word (kept for the
        process, as on a GPU), so that the tests see each call's own
        allocations only."""
        import mmdispatch

        x = np.zeros((1, 1, 2, 2), np.float32)
        rois = np.array([[0, 0, 0, 1, 1]], np.float32)
        arrays = [x, rois, np.zeros((1, 1, 1, 1), np.float32), np.empty(0, np.float32),
                  np.empty(0, np.float32)]
        with self.active(), mmdispatch.strict(False):
            mmdispatch.roi_align_forward_impl(*map(DeviceView, arrays), 1, 1, 1.0, 1, 1, True)

    def backends(self, op_name):
        """The CUDA backends the op has kernels for."""
        names = {0: "default", 1: "reference", 2: "deterministic"}
        return sorted({names[b] for op, b, _, _ in self.kernels if op == op_name})


class DeviceView:
    """A numpy array presented as CUDA memory of cuda:0, through
    __cuda_array_interface__ (the emulated kernels read host memory)."""

    def __init__(self, array):
        self.array = array
        self.shape = self.array.shape
        self.dtype = self.array.dtype

    @property
    def __cuda_array_interface__(self):
        a = self.array
        strides = None if a.flags.c_contiguous else a.strides
        return {"shape": a.shape, "typestr": a.dtype.str, "strides": strides,
                "data": (a.ctypes.data, not a.flags.writeable), "version": 3}
