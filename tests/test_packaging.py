"""What the installed package ships besides code: type stubs that match
signatures.txt and the runtime, py.typed, and an extension that exports
nothing but its module init function."""
import ast
import ctypes
import importlib
import importlib.metadata
import re
import sys
from importlib.resources import files

import pytest

import mmdispatch
from mmdispatch import _core

PACKAGE = files("mmdispatch")


def signature_params():
    """{entry point: [parameter names]} read straight from signatures.txt."""
    ops = {}
    for raw in (PACKAGE / "signatures.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line and not raw[0].isspace():   # indented: an allocation line
            name, params = re.fullmatch(r"(\w+)\((.*)\)", line).groups()
            # a trimmed output names its length too: keep[:num_kept]
            ops[name] = [chunk.split()[1].partition("[")[0] for chunk in params.split(",")
                         if chunk.strip()]
    return ops


def stub(name):
    return ast.parse(PACKAGE.joinpath(*name.split("/")).read_text())


def stub_functions(tree):
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def stub_names(tree):
    """Top-level names a stub defines or re-exports (`import x as x`)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname for a in node.names if a.asname == a.name)
    return names


def test_py_typed_and_stubs_are_installed():
    for name in ("py.typed", "_core.pyi", "_benchkit.pyi", "__init__.pyi"):
        assert (PACKAGE / name).is_file(), name


def test_core_stub_has_exactly_the_entry_points_of_signatures_txt():
    ops = signature_params()
    functions = stub_functions(stub("_core.pyi"))
    # An entry point's stub carries its signature line as the docstring.
    entry_points = {name for name, node in functions.items()
                    if (ast.get_docstring(node) or "").startswith(f"{name}(")}
    assert entry_points == set(ops)
    for name, params in ops.items():
        assert [a.arg for a in functions[name].args.args] == params, name


def test_core_stub_marks_optional_arrays_and_allocated_outputs_and_only_them_as_none():
    optional = {}   # op -> its parameters that may be None
    for raw in (PACKAGE / "signatures.txt").read_text().splitlines():
        line = raw.split("#", 1)[0]
        if line.strip() and not line[0].isspace():
            op = optional.setdefault(line.split("(")[0], set())
            op.update(m.group(1) for m in re.finditer(r"Tensor\?\s+(\w+)", line))
        elif line.strip():   # an allocation line (`    output = empty(...)`)
            op.update(re.findall(r"^\s+(\w+)\s*=", line))
    functions = stub_functions(stub("_core.pyi"))
    for name in signature_params():
        for arg in functions[name].args.args:
            annotation = ast.unparse(arg.annotation)
            assert ("None" in annotation) == (arg.arg in optional[name]), (name, arg.arg,
                                                                           annotation)


def test_core_stub_covers_the_modules_public_api():
    defined_here = {name for name, obj in vars(_core).items()
                    if not name.startswith("_") and getattr(obj, "__module__", None) == _core.__name__}
    names = stub_names(stub("_core.pyi"))
    assert defined_here - names == set(), "missing from _core.pyi"
    public = {name for name in names if not name.startswith("_")}
    assert public - set(dir(_core)) == set(), "in _core.pyi but not in mmdispatch._core"


def test_package_stub_matches_the_package_exports():
    tree = stub("__init__.pyi")
    assert stub_names(tree) == set(mmdispatch.__all__)
    declared_all = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                        and node.targets[0].id == "__all__")
    assert sorted(ast.literal_eval(declared_all)) == sorted(mmdispatch.__all__)


@pytest.mark.parametrize("module", ["_benchkit"])
def test_handwritten_stub_matches_the_module(module):
    extension = importlib.import_module(f"mmdispatch.{module}")
    defined_here = {name for name, obj in vars(extension).items()
                    if not name.startswith("_") and callable(obj)
                    and getattr(obj, "__module__", None) == extension.__name__}
    assert set(stub_functions(stub(module.replace(".", "/") + ".pyi"))) == defined_here


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF symbol visibility")
@pytest.mark.parametrize("module, helpers", [
    ("_core", ["mmd_thread_backends", "mmd_roi_align_forward_impl_table", "mmd_error",
               "mmd_get_device_modules", "cudaMalloc", "cudaGetDeviceCount"]),
    ("_benchkit", []),
])
def test_extension_exports_only_its_module_init(module, helpers):
    """dlsym sees only the dynamic symbol table: the C helpers, kernel
    tables and the static CUDA runtime must not be in it."""
    library = ctypes.CDLL(importlib.import_module(f"mmdispatch.{module}").__file__)
    name = module.rpartition(".")[2]
    assert hasattr(library, f"PyInit_{name}")
    for symbol in [*helpers, f"__pyx_module_is_main_mmdispatch__{module.replace('.', '__')}"]:
        assert not hasattr(library, symbol), symbol


def test_version_matches_the_installed_distribution():
    assert mmdispatch.__version__ == importlib.metadata.version("mmdispatch")
    assert mmdispatch.build_info()["version"] == mmdispatch.__version__


def test_kernel_origins_name_sources_relative_to_the_tree():
    """Every built-in kernel's registry origin is `src/<device>/<file>:<fn>`,
    the CUDA ones too (nvcc's __FILE__ is the path it was given), so no
    build machine's directories are recorded in the extension."""
    import re
    data = open(mmdispatch._core.__file__, "rb").read()
    origins = re.findall(rb"[\x20-\x7e]*src/(?:cpu|cuda)/\w+\.(?:c|cpp|cu):\w+", data)
    assert origins
    # a directory before src/ would be a path; any other printable byte
    # before it is whatever the linker placed before the string
    rooted = [o for o in origins if b"/" in o[:o.index(b"src/")] or b"\\" in o]
    assert not rooted
    if mmdispatch.build_info()["cuda"]:
        assert any(origin.startswith(b"src/cuda/") for origin in origins)


def test_importing_the_source_tree_says_to_run_from_elsewhere(tmp_path):
    """From the repository root, `import mmdispatch` finds the source
    package, which has no compiled extension: the error says what to do
    instead of Python's misleading "circular import"."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    source = Path(__file__).resolve().parents[1] / "mmdispatch"
    if not (source.parent / "setup.py").exists():
        pytest.skip("no source tree beside tests/ (a copy of tests/ alone, as the wheel "
                    "build's test step runs it)")
    tree = tmp_path / "mmdispatch"
    tree.mkdir()
    shutil.copy(source / "__init__.py", tree / "__init__.py")
    shutil.copy(source.parent / "setup.py", tmp_path / "setup.py")
    # -S: no site-packages, so no installed (or editable) mmdispatch to fall back on
    out = subprocess.run([sys.executable, "-S", "-c", "import mmdispatch"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"mmdispatch was imported from its source tree ({tree})" in out.stderr
    assert "run Python from another directory" in out.stderr
