"""The names mmdispatch exports besides its dispatch entry points, listed
once: mmdispatch/__init__.py exports them, and _codegen.py writes the
package's type stub (__init__.pyi) from them."""

# re-exported from the Cython core (mmdispatch._core)
FROM_CORE = (
    "BoxedCall", "CallRecord", "DeferredKernelError", "DeviceMismatchError", "FallbackHandle",
    "FallbackWarning", "HookHandle", "KernelHandle", "KernelNotFoundError", "add_hook",
    "backends", "device_name", "devices", "empty_cache", "get_backend",
    "get_float32_matmul_precision", "hooks", "is_strict", "kernel_capsule_name", "op_signatures",
    "register_fallback", "register_impl", "registered_fallbacks", "registry_table",
    "set_float32_matmul_precision", "strict", "synchronize", "trace", "use_backend",
)
# defined by the package itself
OWN = ("build_info", "fallbacks", "ops", "profile", "__version__")
