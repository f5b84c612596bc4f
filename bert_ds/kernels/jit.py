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

__all__ = ["LateJIT", "interpreter_enabled"]


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

