"""Builds mmdispatch._core: the Cython dispatcher, the C kernels (src/cpu)
and, when nvcc is available, the CUDA kernels (src/cuda) in one extension.

Environment:
  MMDISPATCH_WITH_CUDA       unset: build CUDA kernels if nvcc is found;
                             1: require nvcc; 0: CPU only.
  MMDISPATCH_CUDA_ARCH_LIST  e.g. "7.5;8.0;9.0+PTX" (SASS for each, PTX for
                             the ones marked +PTX). No GPU is needed.
  CUDA_HOME / CUDA_PATH      where to look for nvcc first.
  MMDISPATCH_NVCC_DEFINES    macros for the CUDA kernels, e.g.
                             "MMD_CUDA_VECTOR_ATOMICS=0": a variant built
                             to time one code path against another (the
                             build info records them).
"""
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import Cython
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
GEN_DIR = ROOT / "build" / "generated"
CYTHON_DIR = ROOT / "build" / "cython"
CUDA_OBJ_DIR = ROOT / "build" / "cuda"
# SASS for every arch nvcc 13 supports that we test on, PTX for the newest so
# later GPUs can JIT it (a PTX needs a driver at least as new as the toolkit).
DEFAULT_CUDA_ARCHS = "7.5;8.0;8.6;8.9;9.0;10.0;12.0+PTX"
# The one device module per kernel directory, with its DLPack device code.
DEVICE_DIRS = {"cpu": 1, "cuda": 2}


def load_codegen():
    spec = spec_from_file_location("_mmdispatch_codegen", ROOT / "mmdispatch" / "_codegen.py")
    module = module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


def find_nvcc():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidate = Path(os.environ[var]) / "bin" / "nvcc"
            if candidate.exists():
                return candidate
    found = shutil.which("nvcc")
    if found:
        return Path(found).resolve()
    default = Path("/usr/local/cuda/bin/nvcc")
    return default if default.exists() else None


def cuda_config():
    """(nvcc path or None, why CUDA is not built or None)."""
    mode = os.environ.get("MMDISPATCH_WITH_CUDA", "").strip().lower()
    if mode in ("0", "false", "no", "off"):
        return None, "it was built with MMDISPATCH_WITH_CUDA=0"
    nvcc = find_nvcc()
    if nvcc is None:
        if mode in ("1", "true", "yes", "on"):
            raise SystemExit("MMDISPATCH_WITH_CUDA=1 but nvcc was not found; put it on PATH "
                             "or set CUDA_HOME")
        return None, "nvcc was not found when it was built"
    return nvcc, None


def cudart_static(nvcc):
    """Path of libcudart_static.a of nvcc's toolkit (nvcc may be a wrapper
    script, so ask it where its toolkit is)."""
    roots = []
    try:
        out = subprocess.run([str(nvcc), "--dryrun", "-c", "probe.cu"], capture_output=True,
                             text=True).stderr
        roots += [Path(m) for m in re.findall(r"^#\$ TOP=(.*)$", out, re.M)]
    except OSError:
        pass
    roots += [nvcc.resolve().parent.parent, Path("/usr/local/cuda")]
    for root in roots:
        for pattern in ("lib64/libcudart_static.a", "lib/libcudart_static.a",
                        "targets/*/lib/libcudart_static.a"):
            found = sorted(root.glob(pattern))
            if found:
                return found[0].resolve()
    raise SystemExit(f"libcudart_static.a not found next to {nvcc}; set CUDA_HOME")


def gencode_flags(spec):
    flags, archs = [], []
    for item in filter(None, re.split(r"[;,\s]+", spec)):
        m = re.fullmatch(r"(\d+)\.(\d+)(\+PTX)?", item)
        if not m:
            raise SystemExit(f"MMDISPATCH_CUDA_ARCH_LIST: bad entry {item!r} (want e.g. 8.6 or "
                             "9.0+PTX)")
        cc = m.group(1) + m.group(2)
        flags.append(f"-gencode=arch=compute_{cc},code=sm_{cc}")
        archs.append(f"sm_{cc}")
        if m.group(3):
            flags.append(f"-gencode=arch=compute_{cc},code=compute_{cc}")
            archs.append(f"compute_{cc}")
    if not flags:
        raise SystemExit("MMDISPATCH_CUDA_ARCH_LIST is empty")
    return flags, archs


def tool_version(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    lines = [line for line in out.splitlines() if line.strip()]
    return lines[-1].strip() if "nvcc" in str(cmd[0]) else lines[0].strip()


NVCC, NO_CUDA_REASON = cuda_config()
CUDA_ARCH_SPEC = os.environ.get("MMDISPATCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
NVCC_DEFINES = os.environ.get("MMDISPATCH_NVCC_DEFINES", "").split()
for _define in NVCC_DEFINES:
    if not re.fullmatch(r"[A-Za-z_]\w*(=[\w.+-]*)?", _define):
        raise SystemExit(f"MMDISPATCH_NVCC_DEFINES: {_define!r} is not NAME or NAME=VALUE")
CUDA_SOURCES = sorted((ROOT / "src" / "cuda").glob("*.cu")) if NVCC else []


def device_modules(codegen):
    modules = []
    for name, code in DEVICE_DIRS.items():
        registrations = codegen.find_registrations(ROOT / "src" / name, name)
        reason = None
        if name == "cuda" and NVCC is None:
            reason = (f"this mmdispatch build has no CUDA kernels ({NO_CUDA_REASON}). "
                      "No GPU is needed to build them, only nvcc: reinstall from source with "
                      "MMDISPATCH_WITH_CUDA=1 and nvcc on PATH, e.g. MMDISPATCH_WITH_CUDA=1 "
                      "pip install --force-reinstall --no-binary mmdispatch mmdispatch")
        modules.append(codegen.DeviceModule(name, code, registrations, reason))
    return modules


class BuildExt(build_ext):
    """Generates the op tables, entry points and stubs from signatures.txt,
    cythonizes, adds nvcc-compiled objects and the static CUDA runtime, and
    records the build configuration in mmdispatch/_build_info.py. Generated
    sources and objects go to build/ only; the files a package needs
    (_build_info.py, the .pyi stubs) go to build_lib, and into the source
    tree only for in-place (editable) builds, as the extensions do."""

    def run(self):
        codegen = load_codegen()
        codegen.generate(ROOT / "mmdispatch" / "signatures.txt", GEN_DIR,
                         device_modules(codegen))
        cythonized = cythonize(
            self.extensions, build_dir=rel(CYTHON_DIR),
            include_path=[str(GEN_DIR), str(ROOT / "mmdispatch")],
            compiler_directives={"language_level": 3, "embedsignature": True})
        # the .pyx sources become the generated .c; the Extension objects
        # stay (finalize_options has annotated them)
        sources = {ext.name: ext.sources for ext in cythonized}
        for ext in self.extensions:
            ext.sources = sources[ext.name]
        super().run()   # setuptools copies in-place builds' extensions into the tree here
        self._write_build_info()
        for package_dir in self._package_dirs():
            codegen.generate_stubs(ROOT / "mmdispatch" / "signatures.txt", package_dir,
                                   ROOT / "mmdispatch" / "ops")

    def _package_dirs(self):
        """Where the built package's own files go: build_lib (wheels), and
        the source tree when building in place."""
        dirs = [Path(self.build_lib) / "mmdispatch"]
        if self.inplace:
            dirs.append(ROOT / "mmdispatch")
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        return dirs

    def build_extensions(self):
        self._compile_cpp_as_cpp17()
        for ext in self.extensions:
            self._export_only_module_init(ext)
            if ext.name != "mmdispatch._core":
                continue
            # the CPU kernels' worker pool (src/core/parallel.c)
            ext.extra_compile_args.append("-pthread")
            ext.extra_link_args.append("-pthread")
            # dlopen/dlsym (src/cpu/gemm.cpp finds the process's BLAS); in libc since glibc 2.34
            ext.extra_link_args.append("-ldl")
            if NVCC:
                ext.extra_objects.extend(self._compile_cuda())
                ext.extra_link_args += [str(cudart_static(NVCC)), "-lrt", "-lpthread", "-ldl",
                                        "-lstdc++"]
        super().build_extensions()

    def _compile_cpp_as_cpp17(self):
        """The CPU kernels (src/cpu/*.cpp) are C++17 templates behind a C
        ABI: no exceptions or RTTI, as in the CUDA files. The C sources
        (the Cython module, src/core) keep the C defaults."""
        compile_one = self.compiler._compile

        def compile_with_std(obj, src, ext, cc_args, extra_postargs, pp_opts):
            if ext == ".cpp":
                # -Wno-psabi: GCC warns that 32-byte vectors (src/cpu/vec_math.h)
                # pass differently without AVX; they pass only between inline
                # functions of one file, never through a call of another's
                extra_postargs = [*extra_postargs, "-std=c++17", "-fno-exceptions",
                                  "-fno-rtti", "-Wno-psabi"]
            compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts)

        self.compiler._compile = compile_with_std

    def _export_only_module_init(self, ext):
        """Keeps the mmd_* helpers, the kernel tables and the static CUDA
        runtime out of the extension's dynamic symbol table: only PyInit_*
        is exported, so nothing in the process can bind to (or interpose on)
        them. -fvisibility=hidden covers the C and Cython objects (and lets
        the compiler address the kernel tables directly instead of through
        the GOT); the linker version script also hides what static archives
        such as libcudart_static.a bring in."""
        ext.extra_compile_args.append("-fvisibility=hidden")
        if sys.platform.startswith("linux"):
            script = Path(self.build_temp) / f"{ext.name}.exports.map"
            script.parent.mkdir(parents=True, exist_ok=True)
            module = ext.name.rpartition(".")[2]
            script.write_text(f"{{ global: PyInit_{module}; local: *; }};\n")
            ext.extra_link_args.append(f"-Wl,--version-script={script}")

    def _compile_cuda(self):
        """Compiles the stale .cu files, one nvcc per file in parallel (each
        nvcc compiles its architectures on the CPUs left over)."""
        flags, _ = gencode_flags(CUDA_ARCH_SPEC)
        CUDA_OBJ_DIR.mkdir(parents=True, exist_ok=True)
        # -fmad=false: no fused multiply-adds, so kernels that share their
        # math with the CPU (IoU in nms) round the same way and agree exactly.
        options = ["-O3", "-std=c++17", "-fmad=false", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                   "-I", str(ROOT / "include"), "-I", str(GEN_DIR), *flags,
                   *(f"-D{define}" for define in NVCC_DEFINES)]
        headers = list((ROOT / "include").rglob("*")) + list(GEN_DIR.glob("*.h"))
        newest_header = max(p.stat().st_mtime for p in headers if p.is_file())
        stamp = CUDA_OBJ_DIR / "flags.txt"
        stamp_text = " ".join([str(NVCC), *options, "relative-sources"])
        options_changed = not stamp.exists() or stamp.read_text() != stamp_text
        objects = [CUDA_OBJ_DIR / (src.stem + ".o") for src in CUDA_SOURCES]
        stale = [(src, obj) for src, obj in zip(CUDA_SOURCES, objects)
                 if options_changed or not obj.exists()
                 or obj.stat().st_mtime <= max(src.stat().st_mtime, newest_header)]
        cpus = os.cpu_count() or 1
        jobs = max(1, min(len(stale), cpus))
        threads = max(1, cpus // jobs)

        def compile_one(item):
            src, obj = item
            # The source path relative to the tree, as gcc gets its sources:
            # it is the kernels' registry origin (__FILE__), which must not
            # record the build machine's directories.
            cmd = [str(NVCC), "-c", rel(src), "-o", str(obj), *options, f"--threads={threads}"]
            sys.stdout.write(f"mmdispatch: nvcc {src.name}\n")
            return src.name, subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)

        with ThreadPoolExecutor(jobs) as pool:
            for name, done in pool.map(compile_one, stale):
                sys.stdout.write(done.stdout)
                sys.stderr.write(done.stderr)
                if done.returncode:
                    raise SystemExit(f"nvcc failed on {name} (exit {done.returncode})")
        stamp.write_text(stamp_text)
        return [str(obj) for obj in objects]

    def _write_build_info(self):
        archs = gencode_flags(CUDA_ARCH_SPEC)[1] if NVCC else []
        info = {
            "version": VERSION,
            "cuda": NVCC is not None,
            "cuda_archs": archs,
            "cuda_defines": NVCC_DEFINES if NVCC else [],
            "cuda_runtime": "static" if NVCC else None,
            "nvcc": tool_version([str(NVCC), "--version"]) if NVCC else None,
            "no_cuda_reason": NO_CUDA_REASON,
            "c_compiler": tool_version([self.compiler.compiler[0], "--version"]),
            "numpy_build": numpy.__version__,
            "cython": Cython.__version__,
            "python_build": sys.version.split()[0],
        }
        text = f'"""Written by setup.py at build time."""\nBUILD_INFO = {info!r}\n'
        for package_dir in self._package_dirs():
            (package_dir / "_build_info.py").write_text(text)


VERSION = re.search(r'__version__ = "([^"]+)"',
                    (ROOT / "mmdispatch" / "_version.py").read_text()).group(1)

rel = lambda p: str(Path(p).relative_to(ROOT))  # noqa: E731
core = Extension(
    "mmdispatch._core",
    sources=["mmdispatch/_core.pyx",
             *map(rel, sorted((ROOT / "src" / "core").glob("*.c"))),
             *map(rel, sorted((ROOT / "src" / "cpu").glob("*.c"))),
             *map(rel, sorted((ROOT / "src" / "cpu").glob("*.cpp"))),
             rel(GEN_DIR / "mmdispatch_generated.c")],
    include_dirs=[str(ROOT / "include"), str(ROOT / "mmdispatch"), str(GEN_DIR),
                  numpy.get_include()],
    # headers (the shared ones and src/cpu's own): editing one rebuilds the sources
    depends=[rel(p) for p in sorted((ROOT / "include").rglob("*")) if p.is_file()]
    + [rel(p) for p in sorted((ROOT / "src" / "cpu").glob("*.h"))]
    + ["mmdispatch/_pyarray.h"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=["-O3"],
)



def cython_module(name, source):
    """A one-file Cython extension that cimports the core's declarations
    (_core.pxd, _pyarray.h) but links none of its C."""
    return Extension(
        name,
        sources=[source],
        include_dirs=[str(ROOT / "include"), str(ROOT / "mmdispatch"), str(GEN_DIR),
                      numpy.get_include()],
        depends=["mmdispatch/_pyarray.h", "mmdispatch/_core.pxd"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"],
    )


# The dispatch-overhead benchmark's no-op kernel and raw baseline.
benchkit = cython_module("mmdispatch._benchkit", "mmdispatch/_benchkit.pyx")

setup(
    version=VERSION,
    ext_modules=[core, benchkit],   # cythonized by BuildExt.run, after code generation
    cmdclass={"build_ext": BuildExt},
)
