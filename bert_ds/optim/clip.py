"""Global-norm gradient clipping for the stage-0 fp32 engine, with the norm ZeRO 1/2 computes.

Why not DeepSpeed's own stage-0 clip: ``engine.clip_fp32_gradients`` (``deepspeed/runtime/utils.py``
``clip_grad_norm_``, DeepSpeed 0.19) takes each tensor's norm in fp32 (``grad.float().norm()``), while ZeRO 1/2
(``stage_1_and_2.py`` ``get_grad_norm_direct``) accumulate in fp64. On CPU the fp32 norm of a large tensor is off by
~3e-5 relative (tiny_cpu, 4,000 x 128 word embeddings: 1.844573 vs 1.844634), so the two stages clip by different
factors and LAMB runs drift apart by 1e-5 instead of the ~1e-6 data-parallel floor. The engine therefore turns
DeepSpeed's clip off at stage 0 fp32 and installs :class:`GlobalNormClip` as a step pre-hook on the client optimizer:
fp64 norm, DeepSpeed's formula ``grad *= min(1, max_norm / (norm + 1e-6))``, and the norm kept for logging
(``engine.get_global_grad_norm()`` is None at stage 0).

At stage 0 the engine has already averaged the gradients over data-parallel ranks before ``step()``, so every rank
computes the same norm without communication.
"""

from __future__ import annotations

import torch

from bert_ds.errors import BadInput

__all__ = ["CLIP_EPS", "GlobalNormClip", "clip_coefficient", "global_grad_norm"]

CLIP_EPS = 1e-6
"""Added to the norm before dividing, as DeepSpeed (``clip_grad_norm_``, ``unscale_and_clip_grads``) and torch do."""


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``grads`` viewed as one vector, accumulated in fp64 (0-dim fp64 tensor)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    squares = [g.detach().double().square().sum() for g in grads]
    return torch.stack([s.to(squares[0].device) for s in squares]).sum().sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))`` in fp64; 1 when ``max_norm`` is 0 (clipping off)."""
    if max_norm == 0.0:
        return torch.ones_like(norm)
    return (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)


class GlobalNormClip:
    """Optimizer step pre-hook: measure the global gradient norm and, if ``max_norm`` > 0, clip to it.

    ``GlobalNormClip(1.0).attach(optimizer)``; afterwards ``last_norm`` is the pre-clip norm of the latest step.
    """

    def __init__(self, max_norm: float) -> None:
        if not max_norm >= 0.0:
            raise BadInput(f"GlobalNormClip: max_norm must be >= 0 (0 = measure only), got {max_norm!r}")
        self.max_norm = float(max_norm)
        self.last_norm: float | None = None
        self._handle = None

    def attach(self, optimizer: torch.optim.Optimizer) -> GlobalNormClip:
        if self._handle is not None:
            raise RuntimeError("GlobalNormClip.attach: already attached to an optimizer")
        self._handle = optimizer.register_step_pre_hook(self)
        return self

    @torch.no_grad()
    def __call__(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = global_grad_norm(grads)
        self.last_norm = float(norm)
        if self.max_norm > 0.0 and grads:
            coef = clip_coefficient(norm, self.max_norm)
            if coef < 1.0:
                torch._foreach_mul_(grads, float(coef))
