"""The names mmdispatch exports besides its dispatch entry points, listed
once: mmdispatch/__init__.py exports them, and _codegen.py writes the
package's type stub (__init__.pyi) from them."""

# re-exported from the Cython core (mmdispatch._core)
FROM_CORE = (
    "DeferredKernelError", "DeviceMismatchError", "KernelHandle", "KernelNotFoundError",
    "backends", "device_name", "devices", "get_backend", "is_strict", "kernel_capsule_name",
    "op_signatures", "register_impl", "registry_table", "strict", "synchronize", "use_backend",
)
# defined by the package itself
OWN = ("build_info", "ops", "__version__")
