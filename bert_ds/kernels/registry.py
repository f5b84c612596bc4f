"""Backend selection for the fused ops: which implementation serves a request on a device.

``auto`` on CUDA tensors follows :data:`AUTO_TRITON_ON_CUDA`: Triton only where it was measured faster than its twin
(varlen attention in bf16/fp16), the torch twin everywhere else; off CUDA it is the twin, with one warning per
process. An explicit backend that cannot run is an error, never a silent swap: ``triton`` attention on fp32 CUDA
tensors is refused (IEEE fp32 products run without tensor cores and the builds spill registers).
Inside :func:`~.jit.record_launches` (ahead-of-time builds) tensors count as CUDA tensors, so what is recorded is
what a GPU would launch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from bert_ds.errors import BadInput

from .jit import interpreter_enabled, recording, triton_version_problem
from .layer_norm import apex_available

__all__ = ["AUTO_TRITON_ON_CUDA", "BACKENDS", "FP32_ATTENTION_REFUSED", "OPS", "fallback_warnings_held",
           "resolve_backend", "warn_fallback_once"]

BACKENDS = ("auto", "triton", "torch", "apex")
OPS = ("layer_norm", "bias_gelu", "attention", "varlen_attention")

AUTO_TRITON_ON_CUDA: dict[str, tuple[torch.dtype, ...]] = {
    "layer_norm": (),  # H100, bf16, fwd+bwd: 0.40x the twin (F.layer_norm); BENCHMARKS.md 2026-11-27
    "bias_gelu": (),  # 0.43x the twin (F.gelu)
    "attention": (),  # padded: 0.44x SDPA at seq 128, 0.90x at seq 512
    "varlen_attention": (torch.bfloat16, torch.float16),  # 1.85x / 1.68x the twin at seq 128 / 512
}
"""The dtypes for which ``auto`` picks Triton on CUDA tensors, per op; any other (op, dtype) gets the torch twin.
From ``bert-ds-gpu-check``'s kernel speeds (forward + backward against the twin in the same run). fp32 attention is
never Triton: see :data:`FP32_ATTENTION_REFUSED`."""

FP32_ATTENTION_REFUSED = ("the Triton attention kernels multiply fp32 inputs with IEEE fp32 products: no tensor "
                          "cores, and the builds spill registers (bert-ds-kernel-report --controls)")

_warned: set[str] = set()


def warn_fallback_once(key: str, message: str) -> None:
    """Emit ``message`` as a RuntimeWarning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@contextmanager
def fallback_warnings_held() -> Iterator[None]:
    """Inside the block fallback warnings are neither shown nor remembered: a trace of the model that is not the run
    (the memory estimate, :mod:`bert_ds.runtime.memory`) leaves the run's own first fallback to warn."""
    before = set(_warned)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            yield
    finally:
        _warned.intersection_update(before)


def resolve_backend(op: str, requested: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The concrete backend ("triton", "torch" or "apex") that runs ``op`` for ``requested`` on ``device``, for
    tensors of ``dtype`` (None: judged on the device alone).

    Raises ``ValueError`` for an unknown op/backend or apex on an op other than layer_norm, and
    ``RuntimeError`` when an explicitly requested backend cannot run here.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if requested not in BACKENDS:
        raise BadInput(f"backend must be one of {BACKENDS}, got {requested!r}")
    device = torch.device(device)
    on_cuda = device.type == "cuda" or recording()
    if requested == "torch":
        return "torch"
    if requested == "apex":
        return _resolve_apex(op, on_cuda, device)
    if requested == "triton":
        return _resolve_triton(op, on_cuda, device, dtype)
    return _resolve_auto(op, on_cuda, device, dtype)


def _resolve_apex(op: str, on_cuda: bool, device: torch.device) -> str:
    if op != "layer_norm":
        raise BadInput(f"backend 'apex' is only available for layer_norm, not {op}")
    if not apex_available():
        raise RuntimeError("backend 'apex' requested for layer_norm but NVIDIA apex (apex.normalization with "
                           "its fused_layer_norm_cuda extension) is not importable; install apex from "
                           "github.com/NVIDIA/apex or use backend='auto'")
    if not on_cuda:
        raise RuntimeError(f"backend 'apex' needs CUDA tensors, got device {device}")
    return "apex"


def _fp32_attention(op: str, dtype: torch.dtype | None) -> bool:
    return op in ("attention", "varlen_attention") and dtype == torch.float32


def _resolve_triton(op: str, on_cuda: bool, device: torch.device, dtype: torch.dtype | None) -> str:
    problem = triton_version_problem()
    if problem is not None:
        raise RuntimeError(f"backend 'triton' requested for {op}: {problem}")
    if on_cuda and _fp32_attention(op, dtype):
        raise RuntimeError(f"backend 'triton' requested for {op} on fp32 CUDA tensors: {FP32_ATTENTION_REFUSED}; "
                           "use bf16/fp16 (deepspeed.precision) or kernels 'auto'/'torch' (SDPA)")
    if on_cuda or interpreter_enabled():
        return "triton"
    raise RuntimeError(f"backend 'triton' requested for {op} on a {device.type} tensor; Triton kernels need "
                       "CUDA tensors, or TRITON_INTERPRET=1 set to run them in the CPU interpreter")


def _resolve_auto(op: str, on_cuda: bool, device: torch.device, dtype: torch.dtype | None) -> str:
    if on_cuda:
        if _fp32_attention(op, dtype):
            warn_fallback_once(f"{op}-fp32", f"bert_ds.kernels: backend 'auto' runs {op} on fp32 tensors with the "
                                             f"torch twin (SDPA): {FP32_ATTENTION_REFUSED} (warned once per process)")
            return "torch"
        if dtype not in AUTO_TRITON_ON_CUDA[op]:
            return "torch"  # measured slower than the twin (AUTO_TRITON_ON_CUDA): a choice, not a fallback
        problem = triton_version_problem()
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
