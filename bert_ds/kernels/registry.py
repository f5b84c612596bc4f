"""Backend selection for the fused ops: which implementation serves a request on a device.

``auto`` means Triton on CUDA tensors and the torch twin elsewhere, with one warning per op per
process when it falls back. An explicit backend that cannot run is an error, never a silent swap.
"""

from __future__ import annotations

import warnings

import torch

from .jit import interpreter_enabled, triton_version_problem
from .layer_norm import apex_available

__all__ = ["BACKENDS", "OPS", "resolve_backend", "warn_fallback_once"]

BACKENDS = ("auto", "triton", "torch", "apex")
OPS = ("layer_norm", "bias_gelu", "attention", "varlen_attention")

_warned: set[str] = set()


def warn_fallback_once(key: str, message: str) -> None:
    """Emit ``message`` as a RuntimeWarning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def resolve_backend(op: str, requested: str, device: torch.device) -> str:
    """The concrete backend ("triton", "torch" or "apex") that runs ``op`` for ``requested`` on ``device``.

    Raises ``ValueError`` for an unknown op/backend or apex on an op other than layer_norm, and
    ``RuntimeError`` when an explicitly requested backend cannot run here.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    device = torch.device(device)
    if requested == "torch":
        return "torch"
    if requested == "apex":
        if op != "layer_norm":
            raise ValueError(f"backend 'apex' is only available for layer_norm, not {op}")
        if not apex_available():
            raise RuntimeError("backend 'apex' requested for layer_norm but NVIDIA apex (apex.normalization with "
                               "its fused_layer_norm_cuda extension) is not importable; install apex from "
                               "github.com/NVIDIA/apex or use backend='auto'")
        if device.type != "cuda":
            raise RuntimeError(f"backend 'apex' needs CUDA tensors, got device {device}")
        return "apex"
    problem = triton_version_problem()
    if requested == "triton":
        if problem is not None:
            raise RuntimeError(f"backend 'triton' requested for {op}: {problem}")
        if device.type == "cuda" or interpreter_enabled():
            return "triton"
        raise RuntimeError(f"backend 'triton' requested for {op} on a {device.type} tensor; Triton kernels need "
                           "CUDA tensors, or TRITON_INTERPRET=1 set to run them in the CPU interpreter")
    if device.type == "cuda":
        if problem is None:
            return "triton"
        warn_fallback_once(op, f"bert_ds.kernels: backend 'auto' falls back to the torch implementation of {op}: "
                               f"{problem} (warned once per process)")
        return "torch"
    # One warning per device type, not per op: a CPU run uses all three ops and should say it once.
    warn_fallback_once(device.type, f"bert_ds.kernels: no Triton on {device.type} tensors (first seen for {op}); "
                                    "backend 'auto' falls back to the torch implementations of every fused op "
                                    "(warned once per process)")
    return "torch"
