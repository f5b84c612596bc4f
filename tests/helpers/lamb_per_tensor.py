"""The per-tensor ZeroAwareLamb as it was before the multi-tensor rewrite (bert_ds/optim/lamb.py at commit 0c6033f),
frozen as the reference the multi-tensor version must equal: one tensor at a time at stage 0 (about 22 ops per
tensor), float64 norms per run of a ZeRO flat partition, one all-reduce of the partial norms per step.

Only the class name changed (``PerTensorLamb``): see
``bert_ds/optim/lamb.py`` for the math and the ZeRO call sequence. Bind under ZeRO 1/2 with
``opt.bind_zero(engine.optimizer)`` (``bert_ds.optim.bind_optimizer`` only knows ZeroAwareLamb). Not a test
module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from bert_ds.errors import BadInput

__all__ = ["PerTensorLamb"]

TRUST_RATIO_RULES = ("all", "decay_only")
"""Which tensors get LAMB's trust ratio: every tensor, or only those of param groups with weight decay."""


class UnsupportedZeroSetup(BadInput):
    """A DeepSpeed setup under which PerTensorLamb cannot be exact (ZeRO-3, offload, ...): refused, never run."""


@dataclass
class _GroupLayout:
    flat: torch.Tensor
    """This rank's flat fp32 partition of the group (the only param ZeRO leaves in the group)."""
    lengths: list[int]
    """Lengths of the contiguous runs covering the flat partition in order: tensor segments and padding gaps."""
    run_tensor: list[int]
    """For each run, the global tensor index it belongs to, or -1 for padding."""
    run_index: torch.Tensor
    """``run_tensor`` as an index into the ``(2, n_tensors + 1)`` norm buffer; padding maps to the spare last slot."""
    run_is_tensor: torch.Tensor
    """False for padding runs, which are never updated."""
    bit16_partition: torch.Tensor | None
    """ZeRO's bit16 view of this rank's partition, re-filled after a deferred update."""


@dataclass
class ZeroLayout:
    """Where each original tensor lives in this rank's flat ZeRO partitions."""

    groups: list[_GroupLayout]
    n_tensors: int
    names: list[str]
    """Shape strings of the original tensors, by global index (for error messages and tests)."""
    split_tensors: list[int]
    """Global indices of tensors that are cut by this rank's partition boundaries (present only in part)."""
    process_group: object
    world_size: int


def zero_layout(zero_optimizer) -> ZeroLayout:
    """Map every original tensor of a ``DeepSpeedZeroOptimizer`` (stage 1/2) to its runs in this rank's partition.

    DeepSpeed's partition map (tensor offsets in each flat group, this rank's slice of it) is read by
    :func:`bert_ds.deepspeed_internals.zero_partition_map`; this turns it into contiguous runs of the flat
    partition: tensor segments, and padding between or after them. The map describes the plain layout only:
    :meth:`PerTensorLamb.bind_zero` refuses the setups it does not fit (offload, autocast, ZenFlow, MoE) first.
    """
    from bert_ds.deepspeed_internals import zero_partition_map

    zmap = zero_partition_map(zero_optimizer)
    n_tensors = len(zmap.shapes)
    groups, split = [], []
    for zg in zmap.groups:
        start, end = zg.start, zg.start + zg.flat.numel()
        lengths, run_tensor, cursor = [], [], start
        for index, off, n in zg.tensors:
            lo, hi = max(off, start), min(off + n, end)
            if lo >= hi:
                continue
            if lo > cursor:  # alignment padding between tensors
                lengths.append(lo - cursor)
                run_tensor.append(-1)
            lengths.append(hi - lo)
            run_tensor.append(index)
            if hi - lo != n:
                split.append(index)
            cursor = hi
        if cursor < end:  # padding at the end of the flat group
            lengths.append(end - cursor)
            run_tensor.append(-1)
        device = zg.flat.device
        groups.append(_GroupLayout(flat=zg.flat, lengths=lengths, run_tensor=run_tensor,
                                   run_index=torch.tensor([t if t >= 0 else n_tensors for t in run_tensor],
                                                          dtype=torch.long, device=device),
                                   run_is_tensor=torch.tensor([t >= 0 for t in run_tensor], device=device),
                                   bit16_partition=zg.bit16_partition))
    return ZeroLayout(groups=groups, n_tensors=n_tensors, names=[str(s) for s in zmap.shapes], split_tensors=split,
                      process_group=zmap.process_group, world_size=zmap.world_size)


def segment_sq_norms(flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Squared L2 norm of each contiguous run of ``flat``, in float64.

    On CUDA, ``_foreach_norm`` over views: multi-tensor kernels with tree reductions, no temporaries. On the CPU,
    torch's fp32 norm kernels lose accuracy with length (measured: 2.5e-3 relative on the squared norm of 23.4M
    elements, 3.9e-3 at BERT-large's 31.3M-element word embeddings, against 1e-7 for a float64 sum), so each run is
    reduced in float64 there.
    """
    views = torch.split(flat, lengths)
    if flat.device.type == "cpu":
        return torch.stack([torch.linalg.vector_norm(v, dtype=torch.float64) for v in views]).square()
    return torch.stack(torch._foreach_norm(list(views))).double().square()


def _norm(t: torch.Tensor) -> torch.Tensor:
    """L2 norm of one tensor, float64 (see :func:`segment_sq_norms` for why not fp32 on the CPU)."""
    if t.device.type == "cpu":
        return torch.linalg.vector_norm(t, dtype=torch.float64)
    return t.norm().double()


class PerTensorLamb(Optimizer):
    """LAMB with per-tensor trust ratios, exact on one device and under ZeRO stage 1/2 (after ``bind_zero``).

    ``min_trust``/``max_trust`` clamp a computed trust ratio like DeepSpeed's LAMB ``min_coeff``/``max_coeff``
    (bing_bert: 0.01 and 0.3); the fallback ``r = 1`` (a zero norm) is not clamped, as in DeepSpeed.

    Under ZeRO, call ``bind_zero(engine.optimizer)`` once after ``deepspeed.initialize``; an unbound optimizer whose
    params were replaced by flat partitions refuses to step rather than compute per-slice trust ratios.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, bias_correction: bool = True,
                 min_trust: float | None = None, max_trust: float | None = None, trust_ratio: str = "all") -> None:
        if not lr >= 0.0:
            raise ValueError(f"PerTensorLamb: lr must be >= 0, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"PerTensorLamb: betas must be two values in [0, 1), got {betas!r}")
        if not eps > 0.0:
            raise ValueError(f"PerTensorLamb: eps must be > 0, got {eps!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"PerTensorLamb: weight_decay must be >= 0, got {weight_decay!r}")
        if min_trust is not None and max_trust is not None and min_trust > max_trust:
            raise ValueError(f"PerTensorLamb: min_trust={min_trust!r} > max_trust={max_trust!r}")
        if trust_ratio not in TRUST_RATIO_RULES:
            raise ValueError(f"PerTensorLamb: trust_ratio must be one of {TRUST_RATIO_RULES}, got {trust_ratio!r}")
        for name, value in (("min_trust", min_trust), ("max_trust", max_trust)):
            if value is not None and not value >= 0.0:
                raise ValueError(f"PerTensorLamb: {name} must be >= 0 or None, got {value!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        min_trust=min_trust, max_trust=max_trust, trust_ratio=trust_ratio)
        self._registered: set[int] = set()
        self._layout: ZeroLayout | None = None
        self._pending: dict[int, tuple[torch.Tensor, dict]] = {}
        self._partials: torch.Tensor | None = None
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._registered.update(id(p) for p in self.param_groups[-1]["params"])

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # state dicts written before ``trust_ratio`` existed lack it
            group.setdefault("trust_ratio", self.defaults["trust_ratio"])

    # ------------------------------------------------------------------ binding
    @property
    def zero_layout(self) -> ZeroLayout | None:
        """The bound ZeRO layout, or None when stepping per tensor."""
        return self._layout

    def bind_zero(self, zero_optimizer) -> ZeroLayout:
        """Bind to DeepSpeed's ZeRO stage 1/2 optimizer (``engine.optimizer``) wrapping this optimizer.

        Raises for ZeRO stage 3 and for wrappers whose layout this class does not know, so LAMB is never silently
        per-slice.
        """
        from bert_ds.deepspeed_internals import zero_setup

        setup = zero_setup(zero_optimizer)
        if setup.stage3:
            raise UnsupportedZeroSetup("PerTensorLamb does not support ZeRO stage 3: its sub-group partitions would "
                                      "give per-slice trust ratios. Use ZeRO stage 1 or 2, or AdamW under stage 3.")
        if setup.cpu_offload:
            raise UnsupportedZeroSetup("PerTensorLamb under ZeRO offload_optimizer is not supported (untested); "
                                       "drop zero_optimization.offload_optimizer")
        if setup.torch_autocast or setup.zenflow:
            raise UnsupportedZeroSetup("PerTensorLamb does not support torch_autocast or ZenFlow under ZeRO")
        if setup.mixed_dp_groups:
            raise UnsupportedZeroSetup(f"PerTensorLamb: param group(s) {list(setup.mixed_dp_groups)} use a different "
                                       "data-parallel group (MoE expert groups are not supported)")
        if getattr(zero_optimizer, "optimizer", None) is not self:
            raise ValueError("PerTensorLamb.bind_zero: the given ZeRO optimizer does not wrap this optimizer")
        layout = zero_layout(zero_optimizer)
        if len(layout.groups) != len(self.param_groups):
            raise RuntimeError(f"PerTensorLamb.bind_zero: {len(layout.groups)} ZeRO groups for "
                               f"{len(self.param_groups)} param groups")
        for i, (g, lay) in enumerate(zip(self.param_groups, layout.groups, strict=True)):
            if len(g["params"]) != 1 or g["params"][0] is not lay.flat:
                raise RuntimeError(f"PerTensorLamb.bind_zero: param group {i} does not hold ZeRO's flat partition")
        self._layout = layout
        self._pending = {}
        return layout

    # ------------------------------------------------------------------ math
    @staticmethod
    def _moments_and_update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        """Advance Adam moments in ``state`` and return the LAMB update direction ``u`` (before the trust ratio).

        ``step`` is a Python int, in the state and mirrored in ``group["step"]`` as DeepSpeed's FusedAdam does: ZeRO's
        elastic checkpoints save ``param_groups[0]["step"]`` and would pad a 0-dim tensor step into a vector, and
        universal checkpoints accept an int step.
        """
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        state["step"] = step = int(state["step"]) + 1
        group["step"] = step
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if group["bias_correction"]:
            bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
        else:
            bc1 = bc2 = 1.0
        denom = (exp_avg_sq / bc2).sqrt_().add_(group["eps"])
        update = (exp_avg / bc1).div_(denom)
        if group["weight_decay"] != 0.0:
            update.add_(p, alpha=group["weight_decay"])
        return update

    @staticmethod
    def _trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, group: dict) -> torch.Tensor:
        if group["trust_ratio"] == "decay_only" and group["weight_decay"] == 0.0:
            return torch.ones_like(w_norm)
        ratio = w_norm / u_norm.clamp_min(torch.finfo(u_norm.dtype).tiny)
        if group["min_trust"] is not None or group["max_trust"] is not None:
            ratio = ratio.clamp(group["min_trust"], group["max_trust"])
        return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._layout is not None:
            self._zero_step()
        else:
            self._tensor_step()
        return loss

    def _tensor_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if id(p) not in self._registered:
                    # DeepSpeed's fp16/bf16 wrapper without ZeRO (FP16_UnfusedOptimizer) swaps in fp32 copies and
                    # steps once inside deepspeed.initialize, before bind_optimizer could refuse it: say so here.
                    raise RuntimeError("PerTensorLamb: its params were replaced (a DeepSpeed ZeRO flat partition?) but "
                                       "the optimizer is not bound; call bert_ds.optim.bind_optimizer(engine) after "
                                       "deepspeed.initialize, or trust ratios would be per slice, not per tensor. "
                                       "Raised inside deepspeed.initialize, this is DeepSpeed's fp16/bf16 wrapper "
                                       "without ZeRO, which PerTensorLamb does not support: use ZeRO stage 1 or 2")
                if p.grad.is_sparse:
                    raise RuntimeError("PerTensorLamb does not support sparse gradients")
                u = self._moments_and_update(p, p.grad, self.state[p], group)
                r = self._trust_ratio(_norm(p), _norm(u), group)
                p.add_(u.mul_(r.to(u.dtype)), alpha=-group["lr"])

    def _zero_step(self) -> None:
        import deepspeed.comm as dist

        layout = self._layout
        if self._partials is None:
            self._partials = torch.zeros(2, layout.n_tensors + 1, dtype=torch.float64,
                                         device=layout.groups[0].flat.device)
        flat_index = {id(lay.flat): k for k, lay in enumerate(layout.groups)}
        for group in self.param_groups:
            k = flat_index.get(id(group["params"][0])) if len(group["params"]) == 1 else None
            if k is None:
                raise RuntimeError("PerTensorLamb: a param group no longer holds the flat partition bound by bind_zero")
            if k in self._pending:
                raise RuntimeError(f"PerTensorLamb: ZeRO group {k} stepped twice before the step completed")
            lay = layout.groups[k]
            p = lay.flat
            if p.grad is None:
                raise RuntimeError(f"PerTensorLamb: ZeRO group {k} has no gradient partition")
            u = self._moments_and_update(p, p.grad, self.state[p], group)
            # Sum of squares per contiguous run; padding runs land in the spare last slot and are never read.
            self._partials[0].index_add_(0, lay.run_index, segment_sq_norms(p, lay.lengths))
            self._partials[1].index_add_(0, lay.run_index, segment_sq_norms(u, lay.lengths))
            # ZeRO narrows param_groups to the group it steps, so keep the group dict for the deferred update.
            self._pending[k] = (u, group)
        if len(self._pending) < len(layout.groups):
            return  # ZeRO steps the remaining groups next; their updates and ours are applied together
        if layout.world_size > 1:
            dist.all_reduce(self._partials, group=layout.process_group)
        norms = self._partials.sqrt()
        try:
            for k, (u, group) in self._pending.items():
                lay = layout.groups[k]
                ratio = self._trust_ratio(norms[0, lay.run_index], norms[1, lay.run_index], group)
                ratio = torch.where(lay.run_is_tensor, ratio, 0.0).to(u.dtype)
                torch._foreach_mul_(list(torch.split(u, lay.lengths)), list(ratio.unbind()))
                lay.flat.add_(u, alpha=-group["lr"])
                if lay.bit16_partition is not None:
                    # ZeRO already copied this group's fp32 partition before our deferred update; refresh it before
                    # its all-gather (idempotent for the group ZeRO copies after this call).
                    lay.bit16_partition.data.copy_(lay.flat.data)
        finally:
            self._pending = {}
            self._partials.zero_()
