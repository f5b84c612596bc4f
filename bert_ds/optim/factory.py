"""Optimizer construction for the engine: parameter groups, optimizer by name, binding after ``deepspeed.initialize``.

Call sequence (see ``bert_ds/optim/__init__.py``)::

    opt = build_optimizer("lamb", model, lr, weight_decay, betas, eps, zero_stage)
    engine, opt_wrapped, _, sched = deepspeed.initialize(model=model, optimizer=opt, config=ds_config, ...)
    bind_optimizer(engine)  # before the first engine.step()
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from bert_ds.deepspeed_internals import ZERO_OPTIMIZER_CLASS
from bert_ds.errors import BadInput
from bert_ds.optim.lamb import UnsupportedZeroSetup, ZeroAwareLamb

__all__ = ["OPTIMIZER_NAMES", "bind_optimizer", "build_optimizer", "no_decay", "param_groups"]

OPTIMIZER_NAMES = ("lamb", "adamw", "apex_lamb")


def no_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Biases, LayerNorm weights and any other 1-D parameter get no weight decay (NVIDIA and Google BERT recipes)."""
    return name.endswith("bias") or "LayerNorm.weight" in name or param.ndim <= 1


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: ``weight_decay`` for matrices, 0 for biases / LayerNorm / 1-D params. Frozen params are left out.

    Empty groups are dropped (DeepSpeed's ZeRO refuses a group without trainable parameters).
    """
    if not weight_decay >= 0.0:
        raise BadInput(f"param_groups: weight_decay must be >= 0, got {weight_decay!r}")
    decay, plain = [], []
    for name, p in model.named_parameters():  # tied parameters are yielded once
        if p.requires_grad:
            (plain if no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(name: str, model: torch.nn.Module, lr: float, weight_decay: float = 0.01,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, zero_stage: int = 0,
                    **lamb_kw) -> torch.optim.Optimizer:
    """Build the client optimizer handed to ``deepspeed.initialize(optimizer=...)``.

    - ``lamb``: ``ZeroAwareLamb`` (exact per-tensor LAMB for ZeRO 0/1/2; refuses stage 3 here already).
      ``lamb_kw``: ``bias_correction``, ``min_trust``, ``max_trust``, ``trust_ratio`` (``"all"`` / ``"decay_only"``).
    - ``adamw``: DeepSpeed's FusedAdam (adam_w_mode) when CUDA is available, otherwise ``torch.optim.AdamW``.
    - ``apex_lamb``: NVIDIA apex ``FusedLAMB``, only without ZeRO (it would compute per-slice trust ratios) and only
      if ``apex.optimizers`` imports (apex is built from NVIDIA's source; the PyPI package named ``apex`` is
      unrelated and never used).
    """
    if name not in OPTIMIZER_NAMES:
        raise BadInput(f"build_optimizer: name must be one of {OPTIMIZER_NAMES}, got {name!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise BadInput(f"build_optimizer: zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if lamb_kw and name != "lamb":
        raise BadInput(f"build_optimizer: {sorted(lamb_kw)} only apply to 'lamb', not {name!r}")
    groups = param_groups(model, weight_decay)
    betas = tuple(betas)
    if name == "lamb":
        if zero_stage == 3:
            raise UnsupportedZeroSetup("build_optimizer: 'lamb' does not support ZeRO stage 3 (per-tensor trust ratios "
                                      "across stage-3 sub-group partitions are not implemented); use stage 1 or 2")
        return ZeroAwareLamb(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **lamb_kw)
    if name == "adamw":
        if torch.cuda.is_available():
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    # apex_lamb
    if zero_stage != 0:
        raise BadInput(f"build_optimizer: 'apex_lamb' computes one trust ratio per ZeRO slice; it is only allowed "
                       f"with zero_stage=0, got {zero_stage}. Use 'lamb' (ZeroAwareLamb) under ZeRO.")
    if importlib.util.find_spec("apex") is None:
        raise ImportError("build_optimizer: 'apex_lamb' needs NVIDIA apex (github.com/NVIDIA/apex, built with "
                          "--cpp_ext --cuda_ext); it is not installed")
    try:
        apex_optimizers = importlib.import_module("apex.optimizers")
        fused_lamb = apex_optimizers.FusedLAMB
    except (ImportError, AttributeError) as e:
        raise ImportError(f"build_optimizer: 'apex_lamb' needs NVIDIA apex with apex.optimizers.FusedLAMB ({e}); "
                          "an unrelated PyPI package named 'apex' may be installed instead") from e
    return fused_lamb(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def bind_optimizer(engine) -> None:
    """Finish optimizer setup after ``deepspeed.initialize``; call once, before the first ``engine.step()``.

    For ``ZeroAwareLamb`` under ZeRO 1/2 this binds the partition layout (exact per-tensor trust ratios); under
    stage 0 there is nothing to bind. Raises for ZeRO stage 3 and for DeepSpeed wrappers with an unknown flat
    layout: BF16_Optimizer, which DeepSpeed picks for bf16 ZeRO-1 with ``data_types.grad_accum_dtype`` fp32 unless the
    engine is built inside ``bert_ds.deepspeed_internals.zero1_keeps_zero_optimizer`` (as
    ``bert_ds.runtime.engine.initialize_deepspeed`` does). fp16/bf16 without ZeRO never gets
    here: DeepSpeed's FP16_UnfusedOptimizer steps the client optimizer inside ``deepspeed.initialize``, where
    ZeroAwareLamb's unbound-step guard raises (``bert_ds.runtime.engine`` refuses that setup earlier). No-op for other
    optimizers.
    """
    wrapped = engine.optimizer
    base = getattr(wrapped, "optimizer", wrapped)
    if not isinstance(base, ZeroAwareLamb):
        return
    stage = engine.zero_optimization_stage()
    if stage == 3:
        raise UnsupportedZeroSetup("ZeroAwareLamb does not support ZeRO stage 3; use stage 1 or 2")
    if wrapped is base:
        return  # stage 0 fp32: the engine steps the client optimizer on the original tensors
    if stage in (1, 2) and type(wrapped).__name__ == ZERO_OPTIMIZER_CLASS:
        base.bind_zero(wrapped)
        return
    raise UnsupportedZeroSetup(f"ZeroAwareLamb: DeepSpeed wraps it in {type(wrapped).__name__} (ZeRO stage {stage}), "
                              "whose flat layout is not supported; use ZeRO stage 1 or 2 with DeepSpeedZeroOptimizer "
                              "(bf16 ZeRO-1 with data_types.grad_accum_dtype fp32: build the engine with "
                              "bert_ds.runtime.engine.initialize_deepspeed)")
