"""Launch a Triton kernel many times with the same constants, without Triton's per-call Python.

    k = Launcher(_my_kernel, dict(BLOCK=128, D=7168), num_warps=8)  # once, e.g. in __init__
    k(grid, x_ptr, y_ptr, n)                                         # the runtime arguments

`fn[grid](*args, **consts)` binds and specializes all of a kernel's arguments, constants
included, on every call: 36 us per launch on a lent H200's host for a 30-argument kernel, of
which the C launcher is 8 (BENCHMARKS.md, section 18). A Launcher takes its constants once and,
per call, specializes only the runtime arguments with Triton's own function (the same one
Triton's binder calls, so it picks the same compiled variant: a pointer's 16-byte alignment,
an int equal to 1 or a multiple of 16), then calls the compiled kernel's launcher directly.
A specialization seen for the first time goes through `fn[grid]` (which compiles or loads it)
and is remembered.

It falls back to `fn[grid]` on every call where the shortcut does not apply: under the CPU
interpreter, when a launch hook is installed (profilers), for kernels whose parameters carry
type annotations, and on a Triton whose internals are not the ones this was written against
(3.6 / 3.7); `Launcher.fast` says which path it takes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from epmoe.kernels._common import INTERPRET

_EMPTY = inspect.Parameter.empty


class Launcher:
    """One kernel, its constexpr arguments and launch options fixed; call with (grid, *args),
    the runtime (non-constexpr) arguments positionally in the kernel's order."""

    def __init__(self, fn, consts: dict, **options):
        self.fn, self.consts, self.options = fn, dict(consts), dict(options)
        params = _params(fn)
        names = [p.name for p in params]
        self.runtime = [p for p in params if not p.is_constexpr]
        const_names = {p.name for p in params if p.is_constexpr}
        missing = {p.name for p in params if p.is_constexpr and p.default is _EMPTY} \
            - self.consts.keys()
        extra = self.consts.keys() - const_names
        if missing or extra:
            raise ValueError(f"{_name(fn)}: constexpr arguments missing {sorted(missing)}, "
                             f"not constexpr {sorted(extra)}")
        # the launcher takes every parameter in order; the runtime ones filled per call
        self._slots = [names.index(p.name) for p in self.runtime]
        self._template = [self.consts.get(p.name, p.default) for p in params]
        self._kernels: dict = {}  # (device, specialization) -> compiled kernel
        self._rt = _runtime_or_none(fn, self.runtime) if not INTERPRET else None
        self.fast = self._rt is not None

    def __call__(self, grid, *args) -> None:
        if len(args) != len(self.runtime):
            raise TypeError(f"{_name(self.fn)} takes {len(self.runtime)} runtime arguments "
                            f"({[p.name for p in self.runtime]}), got {len(args)}")
        g = grid if isinstance(grid, tuple) else (grid,)
        rt = self._rt
        if rt is None or _hooked(rt.knobs.launch_enter_hook) \
                or _hooked(rt.knobs.launch_exit_hook):  # a profiler wants Triton's path
            self.fn[g](*args, **self.consts, **self.options)
            return
        drv = rt.driver.active
        device = drv.get_current_device()
        backend, spec = self.fn.device_caches[device][3], rt.specialize
        key = (device, *(spec(backend, a, p.is_const, not p.do_not_specialize,
                              not p.do_not_specialize_on_alignment)
                         for a, p in zip(args, self.runtime)))
        kernel = self._kernels.get(key)
        if kernel is None:  # first time: Triton binds, compiles or loads, launches
            self._kernels[key] = self.fn[g](*args, **self.consts, **self.options)
            return
        full = list(self._template)
        for i, a in zip(self._slots, args):
            full[i] = a
        kernel.run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1,
                   drv.get_current_stream(device), kernel.function, kernel.packed_metadata,
                   None, None, None, *full)


def _hooked(hook) -> bool:
    """A launch hook is installed: set (None or an empty chain of hooks is none; Triton 3.6
    and 3.7 keep a `HookChain` there by default)."""
    return hook is not None and getattr(hook, "calls", None) != []


@dataclass(frozen=True)
class _Triton:
    """What the shortcut calls in Triton, looked up once."""

    driver: object  # triton.runtime.driver
    knobs: object  # triton.knobs.runtime (the launch hooks)
    specialize: object  # triton._C.libtriton.native_specialize_impl


def _runtime_or_none(fn, runtime) -> _Triton | None:
    """Triton's pieces if this Triton has the internals the shortcut relies on (3.6 / 3.7)
    and the kernel qualifies, else None (every call through fn[grid])."""
    try:
        from triton import knobs  # noqa: PLC0415
        from triton._C.libtriton import native_specialize_impl  # noqa: PLC0415
        from triton.runtime import driver  # noqa: PLC0415

        knobs.runtime.launch_enter_hook  # noqa: B018
    except (ImportError, AttributeError):
        return None
    if not hasattr(fn, "device_caches") or getattr(fn, "pre_run_hooks", None):
        return None
    if not all(not getattr(p, "annotation_type", None) and hasattr(p, "do_not_specialize")
               and hasattr(p, "do_not_specialize_on_alignment") for p in runtime):
        return None
    return _Triton(driver, knobs.runtime, native_specialize_impl)


def _params(fn) -> list:
    """The kernel's parameters (Triton's KernelParam: name, is_constexpr, default, ...)."""
    if hasattr(fn, "params"):
        return fn.params
    inner = getattr(fn, "fn", None)  # the interpreter's function wraps the Python one
    if inner is None:
        raise TypeError(f"{fn!r} is not a @triton.jit function")
    from triton.runtime.jit import KernelParam  # noqa: PLC0415

    sig = inspect.signature(inner)
    return [KernelParam(i, p, False, False) for i, p in enumerate(sig.parameters.values())]


def _name(fn) -> str:
    return getattr(getattr(fn, "fn", fn), "__name__", repr(fn))


__all__ = ["Launcher"]
