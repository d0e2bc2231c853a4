"""Ready fallbacks for mmdispatch.register_fallback.

``copy_to_cpu`` serves every op on a device that has no kernels (ROCm,
oneAPI, Metal arrays as their libraries export them through DLPack): it
copies the call's arrays to the host, runs the CPU kernel, and writes the
outputs back into the device arrays, or returns new device arrays where the
call left its outputs to the entry point. Nothing falls back unless the
user opts in::

    mmdispatch.register_fallback("rocm", mmdispatch.fallbacks.copy_to_cpu)
"""
import sys

import numpy as np

__all__ = ["copy_to_cpu"]


def copy_to_cpu(op, call):
    """Runs ``call`` (a BoxedCall) on the CPU kernel with host copies of its
    arrays; outputs are copied back to the device. Needs arrays whose
    ``__dlpack__`` exports a host copy (DLPack 1.0's ``dl_device``/``copy``,
    or torch's ``.cpu()``), and, to write back, a library that can put a
    host array on the device: torch, or an Array API namespace whose
    ``from_dlpack``/``asarray`` take ``device=``."""
    if call.device == "cpu":   # it would call itself: the CPU slot is the empty one
        raise TypeError(f"{op}: copy_to_cpu serves devices other than the CPU; the CPU slot "
                        "of this op and backend is empty")
    host = {name: None if array is None else _to_host(op, name, array)
            for name, array in call.arrays.items()}
    result = call.redispatch(host)
    for name in call.outputs:
        target = call.arrays[name]
        if target is not None:
            _write_back(op, name, target, host[name])
    if not call.allocating:
        return result
    like = next(array for array in call.arrays.values() if array is not None)
    results = result if isinstance(result, tuple) else (result,)
    on_device = []
    for name, value in zip(call.returns, results):
        given = call.arrays[name]
        if given is None:
            on_device.append(_to_device(op, name, like, value))
        elif name in call.lengths:   # keep[:num_kept]: the given array, trimmed
            on_device.append(given[:value.shape[0]])
        else:
            on_device.append(given)
    return tuple(on_device) if isinstance(result, tuple) else on_device[0]


copy_to_cpu.cost = (  # type: ignore[attr-defined]  # what FallbackWarning names
    "every call copies its arrays to host memory, runs the CPU kernel and copies the outputs "
    "back to the device (synchronously): expect it to be much slower than a kernel of the device")


def _torch_tensor(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _to_host(op, name, array):
    """A numpy copy of `array`'s data."""
    try:
        if _torch_tensor(array):
            return array.detach().cpu().numpy().copy()
        return np.from_dlpack(array, device="cpu", copy=True)
    except Exception as exc:
        raise TypeError(
            f"{op}: the copy_to_cpu fallback cannot copy {name} ({type(array).__name__}) to "
            f"the host: its __dlpack__ does not export a host copy (DLPack 1.0 dl_device and "
            f"copy; numpy >= 2.1): {type(exc).__name__}: {exc}") from exc


def _namespace(op, name, array):
    get = getattr(array, "__array_namespace__", None)
    if get is None:
        raise TypeError(
            f"{op}: the copy_to_cpu fallback cannot put {name} on the device of a "
            f"{type(array).__name__}: it needs torch or an Array API namespace "
            "(__array_namespace__)")
    return get()


def _from_host(op, name, like, host):
    """`host` (numpy) as an array of like's library on like's device."""
    if _torch_tensor(like):
        return sys.modules["torch"].from_numpy(host).to(like.device)
    xp = _namespace(op, name, like)
    try:
        return xp.from_dlpack(host, device=like.device)
    except (TypeError, NotImplementedError, BufferError):
        return xp.asarray(host, device=like.device)


def _write_back(op, name, target, host):
    if _torch_tensor(target):
        target.copy_(sys.modules["torch"].from_numpy(host))
        return
    target[...] = _from_host(op, name, target, host)


def _to_device(op, name, like, host):
    return _from_host(op, name, like, np.ascontiguousarray(host))
