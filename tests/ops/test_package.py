"""mmdispatch.ops (the package): it exports what its op modules list, and
every dispatch entry point belongs to exactly one op module."""
import importlib
import pkgutil

import mmdispatch
from mmdispatch import ops


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
