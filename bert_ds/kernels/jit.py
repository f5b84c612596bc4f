"""Late binding of Triton kernels to the compiler or the interpreter.

``triton.jit`` decides at decoration time whether a kernel runs compiled or under the CPU
interpreter (it reads ``TRITON_INTERPRET`` through ``triton.knobs.runtime.interpret``). Kernels here
are plain functions wrapped in :class:`LateJIT`, which applies ``triton.jit`` on first launch with
the setting in force then, and can always hand out a compiler-mode ``JITFunction`` for AOT builds.

Triton's own library (``tl.sum``, ``tl.max``, ...) is decorated once, when ``triton`` is first
imported, so the interpreter works only if ``TRITON_INTERPRET=1`` was already set at that import;
:meth:`LateJIT._kernel` checks this and says so instead of failing deep inside a kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = ["SUPPORTED_TRITON", "LateJIT", "interpreter_enabled", "triton_version_problem"]

SUPPORTED_TRITON = ((3, 9), (3, 10))
"""Triton versions the kernels are tested with: >= 3.9, < 3.10. The interpreter work-arounds in the kernels (bf16
``tl.dot``, block masks in ``tl.load``) and the AOT report's ``ASTSource``/``GPUTarget`` calls are written against
3.9."""


def triton_version_problem(version: str | None = None) -> str | None:
    """Why the installed (or given) Triton cannot be used by bert_ds's kernels, or None when it is supported."""
    version = triton.__version__ if version is None else version
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return f"cannot parse triton version {version!r}; bert_ds supports triton >= 3.9, < 3.10"
    low, high = SUPPORTED_TRITON
    if not low <= major_minor < high:
        return (f"triton {version} is installed but bert_ds's kernels support triton >= {low[0]}.{low[1]}, "
                f"< {high[0]}.{high[1]} (pip install 'triton>={low[0]}.{low[1]},<{high[0]}.{high[1]}')")
    return None


def interpreter_enabled() -> bool:
    """True when Triton kernels would run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


class LateJIT:
    """A Triton kernel source function, jitted lazily for the current interpret/compile mode."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self._jitted: dict[bool, object] = {}

    def _kernel(self):
        mode = interpreter_enabled()
        if mode and not isinstance(tl.standard.sum, InterpretedFunction):
            raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported; triton binds its own library "
                               "(tl.sum, tl.max, ...) at import, so set TRITON_INTERPRET=1 before the first "
                               "`import triton` (e.g. in the environment or at the top of the root conftest.py)")
        if mode not in self._jitted:
            self._jitted[mode] = triton.jit(self.fn)
        return self._jitted[mode]

    def __getitem__(self, grid):
        return self._kernel()[grid]

    def compiled(self) -> JITFunction:
        """A compiler-mode ``JITFunction`` regardless of the interpreter setting (used for AOT)."""
        return JITFunction(self.fn)

