"""Late binding of Triton kernels to the compiler or the interpreter.

``triton.jit`` decides at decoration time whether a kernel runs compiled or under the CPU
interpreter (it reads ``TRITON_INTERPRET`` through ``triton.knobs.runtime.interpret``). Kernels here
are plain functions wrapped in :class:`LateJIT`, which applies ``triton.jit`` on first launch with
the setting in force then, and can always hand out a compiler-mode ``JITFunction`` for AOT builds.

Triton's own library (``tl.sum``, ``tl.max``, ...) is decorated once, when ``triton`` is first
imported, so the interpreter works only if ``TRITON_INTERPRET=1`` was already set at that import;
:meth:`LateJIT._kernel` checks this and says so instead of failing deep inside a kernel.

Ahead-of-time builds (:mod:`.aot`) must compile the binary the runtime would: inside :func:`record_launches` a
launch is recorded instead of run, and :func:`specialize` passes its arguments through the JIT's own binder (the
code ``JITFunction.run`` uses), so integers divisible by 16 get ``tt.divisibility`` 16, integers equal to 1 become
constants and pointers are checked for 16-byte alignment exactly as at run time. That is triton-internal code
(``create_function_from_signature``, ``JITFunction._pack_args``); it lives here, beside the version check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

__all__ = ["SUPPORTED_TRITON", "LateJIT", "Launch", "Specialization", "compiler_mode_problem", "constant_for_dynamo",
           "interpreter_enabled", "late_jit", "record_launches", "recording", "specialize", "triton_version_problem"]

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


def constant_for_dynamo(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` (2 CPU seconds, paid by every
    command that imports the model): torch's decorator only sets this attribute (``torch/_dynamo/decorators.py``,
    torch 2.13; ``tests/kernels/test_custom_ops.py`` checks that it still does). Dynamo then reads ``fn``'s result
    once when it traces a graph and keeps it as a constant."""
    fn._dynamo_marked_constant = True
    return fn


@constant_for_dynamo  # read when a graph is traced (dynamo cannot trace triton's knobs)
def interpreter_enabled() -> bool:
    """True when Triton kernels would run under the CPU interpreter (``TRITON_INTERPRET=1``).

    False inside :func:`record_launches`: launch code then takes its compiled-mode path (e.g. bf16 ``tl.dot``
    operands), whose arguments are what an AOT build must see."""
    return not recording() and bool(triton.knobs.runtime.interpret)


def compiler_mode_problem() -> str | None:
    """Why ``triton.compile`` cannot lower kernels in this process, or None when it can.

    With ``TRITON_INTERPRET=1`` at triton's import, ``tl.sum`` and friends are interpreter functions and the
    compiler fails inside the first kernel that calls one (a triton cache hit can hide this for a while)."""
    if isinstance(tl.standard.sum, InterpretedFunction):
        return ("triton was imported with TRITON_INTERPRET=1, so its library (tl.sum, ...) is bound to the CPU "
                "interpreter and cannot be compiled; AOT builds need a process started with TRITON_INTERPRET unset "
                "or 0 (tools/kernel_report.py, or a subprocess)")
    return None


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the runtime issued it, recorded by :func:`record_launches` instead of run."""

    kernel: LateJIT
    grid: object  # as given to kernel[grid]: a tuple or a callable
    args: tuple
    kwargs: dict = field(default_factory=dict)


_RECORDING: ContextVar[list[Launch] | None] = ContextVar("bert_ds_kernel_recording", default=None)


@constant_for_dynamo
def recording() -> bool:
    """True inside :func:`record_launches`: launches are recorded as a CUDA device would issue them.

    Under ``torch.compile`` the answer is read once when the graph is traced and kept (dynamo cannot trace a
    ``ContextVar`` read): recording is a tool for eager runs (``bert_ds.devtools.recipe_launches``)."""
    return _RECORDING.get() is not None


@contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Record every :class:`LateJIT` launch made inside the block (appended to the yielded list) instead of running
    it. Launch code runs as in compiled mode (see :func:`interpreter_enabled`); outputs are left unwritten, so only
    the launches matter, not the tensors the wrappers return."""
    launches: list[Launch] = []
    token = _RECORDING.set(launches)
    try:
        yield launches
    finally:
        _RECORDING.reset(token)


@dataclass(frozen=True)
class Specialization:
    """What the JIT compiles for one launch on one target: ``ASTSource`` inputs plus compile options.

    ``signature`` maps every argument name to its type (``*bf16``, ``i32``, ``fp32``, ``constexpr``); ``constexprs``
    and ``attrs`` are keyed by argument path as ``ASTSource`` takes them (``(3,)``); ``options`` is the backend's
    parsed options as a dict (num_warps, num_stages, arch, ...)."""

    kernel: LateJIT
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    def source(self) -> ASTSource:
        return ASTSource(self.kernel.compiled(), self.signature, self.constexprs, self.attrs)

    def arg_name(self, path: tuple) -> str:
        return self.kernel.compiled().arg_names[path[0]] + "".join(f"[{i}]" for i in path[1:])

    @property
    def key(self) -> tuple:
        """Equal for two launches exactly when the JIT would reuse one binary for both."""
        return (self.kernel.__name__, tuple(self.signature.items()), repr(sorted(self.constexprs.items())),
                repr(sorted(self.attrs.items())), repr(sorted(self.options.items())))


def specialize(launch: Launch, target: GPUTarget) -> Specialization:
    """The JIT's specialisation of ``launch`` for ``target``, computed as ``JITFunction.run`` does (triton 3.9)."""
    fn = launch.kernel.compiled()
    backend = make_backend(target)
    kwargs = dict(launch.kwargs)
    # JITFunction.run adds these before binding; they are part of the options the binary is compiled with.
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return Specialization(launch.kernel, signature, constexprs, attrs, dict(options.__dict__))


class LateJIT:
    """A Triton kernel source function, jitted lazily for the current interpret/compile mode.

    ``jit_options`` go to ``triton.jit`` (e.g. ``do_not_specialize``); use :func:`late_jit` to pass them as a
    decorator."""

    def __init__(self, fn: Callable, **jit_options) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.jit_options = jit_options
        self._jitted: dict[bool, object] = {}
        self._compiled: JITFunction | None = None

    def _kernel(self):
        mode = interpreter_enabled()
        if mode and not isinstance(tl.standard.sum, InterpretedFunction):
            raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported; triton binds its own library "
                               "(tl.sum, tl.max, ...) at import, so set TRITON_INTERPRET=1 before the first "
                               "`import triton` (e.g. in the environment or at the top of the root conftest.py)")
        if mode not in self._jitted:
            self._jitted[mode] = triton.jit(self.fn, **self.jit_options)
        return self._jitted[mode]

    def __getitem__(self, grid):
        recording = _RECORDING.get()
        if recording is not None:
            return lambda *args, **kwargs: recording.append(Launch(self, grid, args, kwargs))
        return self._kernel()[grid]

    def compiled(self) -> JITFunction:
        """A compiler-mode ``JITFunction`` regardless of the interpreter setting (used for AOT)."""
        if self._compiled is None:
            self._compiled = JITFunction(self.fn, **self.jit_options)
        return self._compiled


def late_jit(**jit_options) -> Callable[[Callable], LateJIT]:
    """``@late_jit(do_not_specialize=["M"])``: :class:`LateJIT` with options for ``triton.jit``."""
    return lambda fn: LateJIT(fn, **jit_options)

