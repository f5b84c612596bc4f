"""Helpers for the kernel tests."""

from __future__ import annotations

import torch


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def grads_of(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output of ``fn(*inputs)`` and the gradients of ``<out, grad_out>`` w.r.t. fresh copies of ``inputs``."""
    leaves = [leaf(t) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]
