"""mmdispatch.ops (the package): it exports what its op modules list,
every dispatch entry point belongs to exactly one op module, and every op
module has a test file with the property tests."""
import importlib
import pkgutil
from pathlib import Path

import pytest

import mmdispatch
from mmdispatch import ops
from properties import OpProperties


def op_modules():
    return [importlib.import_module(f"mmdispatch.ops.{info.name}")
            for info in pkgutil.iter_modules(ops.__path__) if not info.name.startswith("_")]


def test_package_exports_every_function_its_op_modules_list():
    listed = sorted(name for module in op_modules() for name in module.__all__)
    assert ops.__all__ == listed
    for module in op_modules():
        for name in module.__all__:
            assert getattr(ops, name) is getattr(module, name)
            assert callable(getattr(ops, name))


def test_every_entry_point_belongs_to_exactly_one_op_module():
    owners = {}
    for module in op_modules():
        for entry_point in module.ENTRY_POINTS:
            owners.setdefault(entry_point, []).append(module.__name__)
    assert sorted(owners) == sorted(mmdispatch.op_signatures())
    assert all(len(modules) == 1 for modules in owners.values()), owners


def test_every_op_module_has_a_test_file_with_its_property_tests(request):
    """tests/ops/test_<op>.py exists and holds a TestProperties(OpProperties)
    for the module (checked for the test files this run collected)."""
    items = request.session.items
    collected = {Path(item.path).name for item in items}
    covered = {item.cls.module.__name__ for item in items
               if item.cls is not None and issubclass(item.cls, OpProperties)}
    checked = 0
    for module in op_modules():
        test_file = Path(__file__).with_name(f"test_{module.__name__.rsplit('.', 1)[1]}.py")
        assert test_file.exists(), f"{module.__name__} has no test file {test_file.name}"
        if test_file.name in collected:
            assert module.__name__ in covered, f"{test_file.name} has no TestProperties"
            checked += 1
    if not checked:
        pytest.skip("no op's test file was collected in this run")
