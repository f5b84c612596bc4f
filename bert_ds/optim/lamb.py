"""LAMB (You et al., 2019) that stays exact when DeepSpeed ZeRO stage 1/2 shards the optimizer.

Per tensor ``w`` with (already clipped) gradient ``g``::

    m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2;  m^ = m/(1-b1^t), v^ = v/(1-b2^t)  (if bias_correction)
    u = m^ / (sqrt(v^) + eps) + wd*w;  r = ||w|| / ||u||  (r = 1 if either norm is 0; clamped if asked)
    w = w - lr * r * u

``trust_ratio`` picks which tensors get ``r`` (per param group, so per weight-decay class): ``"all"`` (NVLAMB; apex
``FusedLAMB(use_nvlamb=True)``, timm ``Lamb(always_adapt=True)``) or ``"decay_only"``, where groups with weight
decay 0 (biases, LayerNorm) take ``r = 1`` (``use_nvlamb=False``, the default of apex's ``FusedLAMB`` and of
NVIDIA's ``FusedLAMBAMP`` that NVIDIA's BERT recipe steps, ``lamb_amp_opt/fused_lamb/fused_lamb.py``; timm's
default). Under ``"all"`` a tensor whose true gradient is 0, such as an attention key bias (softmax cancels it), has
an update ``u`` of pure rounding noise that ``r`` scales up to a step of ``lr * ||w||`` every step.

Under ZeRO 1/2 the param groups hold one flat fp32 partition per rank and tensors are cut at rank boundaries, so a
naive LAMB computes one trust ratio per rank slice (DeepSpeed issues #88, #490, #1217). After ``bind_zero`` the
optimizer knows which segment of its flat partition belongs to which original tensor; each rank sums its segments'
``w^2`` and ``u^2`` and one all-reduce of that ``(2, n_tensors)`` vector per step gives every tensor its true norms
(the fix of apex's DistributedFusedLAMB).

ZeRO calls ``step()`` once per param group (``_optimizer_step(i)`` narrows ``param_groups`` to group ``i``) and copies
each group's fp32 partition to its bit16 partition right after; the all-gather of the bit16 partitions only happens
after the last group. To need a single all-reduce per step the bound optimizer therefore updates the moments in every
group call, and computes the norms and applies the weight updates of all groups in the last call, re-copying the
earlier groups' fp32 partitions to their bit16 partitions before ZeRO all-gathers them.

Every step is a fixed number of multi-tensor ops, however many tensors: ``torch._foreach_*`` over each param group's
tensors at stage 0 (tensors with equal step counts together) and over the runs of each flat partition under ZeRO,
the ``w`` and ``u`` norms of every tensor in one ``_foreach_norm`` (float64 accumulation, on the CPU too). The trust
ratios are per-tensor scalars, which torch's foreach kernels only take as a host list: the norms come to the host in
one copy (one synchronisation per step), the ratios are computed there in float64 (numpy) and applied by one
``_foreach_mul_``. At stage 0 the update directions of all tensors exist at once (two more model-sized fp32
buffers at the peak, as torch's foreach AdamW holds one); under ZeRO they did already.

Gradient clipping is not done here. It happens by the global norm before ``step()``: under ZeRO 1/2 in DeepSpeed's
``unscale_and_clip_grads`` (fp64 norm), at stage 0 fp32 in :class:`bert_ds.optim.clip.GlobalNormClip`, a step pre-hook
with the same fp64 norm and formula that ``bert_ds.runtime.engine`` installs instead of DeepSpeed's fp32-norm clip
(see that module for why). Plain-torch users call ``torch.nn.utils.clip_grad_norm_`` before ``step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.optim import Optimizer

from bert_ds.errors import BadInput

if TYPE_CHECKING:
    from bert_ds.deepspeed_internals import ZeroPartitionMap

__all__ = ["TRUST_RATIO_RULES", "UnsupportedZeroSetup", "ZeroAwareLamb", "ZeroLayout", "layout_from_map",
           "segment_sq_norms", "zero_layout"]

TRUST_RATIO_RULES = ("all", "decay_only")
"""Which tensors get LAMB's trust ratio: every tensor, or only those of param groups with weight decay."""


class UnsupportedZeroSetup(BadInput):
    """A DeepSpeed setup under which ZeroAwareLamb cannot be exact (ZeRO-3, offload, ...): refused, never run."""


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
    :func:`bert_ds.deepspeed_internals.zero_partition_map`; :func:`layout_from_map` turns it into runs. The map
    describes the plain layout only: :meth:`ZeroAwareLamb.bind_zero` refuses the setups it does not fit (offload,
    autocast, ZenFlow, MoE) first.
    """
    from bert_ds.deepspeed_internals import zero_partition_map

    return layout_from_map(zero_partition_map(zero_optimizer))


def layout_from_map(zmap: ZeroPartitionMap) -> ZeroLayout:
    """Cut each flat partition of a partition map into contiguous runs: tensor segments, and padding between or
    after them."""
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
        groups.append(_GroupLayout(flat=zg.flat, lengths=lengths, run_tensor=run_tensor,
                                   run_index=torch.tensor([t if t >= 0 else n_tensors for t in run_tensor],
                                                          dtype=torch.long, device=zg.flat.device),
                                   bit16_partition=zg.bit16_partition))
    return ZeroLayout(groups=groups, n_tensors=n_tensors, names=[str(s) for s in zmap.shapes], split_tensors=split,
                      process_group=zmap.process_group, world_size=zmap.world_size)


def segment_sq_norms(flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Squared L2 norm of each contiguous run of ``flat``, in float64: one ``_foreach_norm`` over the runs' views.

    ``dtype=torch.float64``: the CPU casts each element to float64 before summing (an fp32 norm loses accuracy with
    length there: measured 2.5e-3 relative on the squared norm of 23.4M elements, 3.9e-3 at BERT-large's
    31.3M-element word embeddings); recent torch's CUDA kernel sums in the output's type too, older ones in fp32
    over a tree of partial sums, as the per-tensor norms before did.
    """
    return torch.stack(torch._foreach_norm(list(torch.split(flat, lengths)), dtype=torch.float64)).square()


def _to_host(t: torch.Tensor) -> np.ndarray:
    """``t`` copied to a host array by one ``copy_``: on a GPU the step's one synchronisation; on the CPU the same op,
    so that the CPU runs (and counts) what a GPU runs."""
    host = torch.empty(t.shape, dtype=t.dtype)
    host.copy_(t)
    return host.numpy()


def _host_norms(tensors: list[torch.Tensor]) -> np.ndarray:
    """Float64 L2 norm of each tensor, on the host: one ``_foreach_norm``, one stack and one copy per device."""
    out = np.empty(len(tensors))
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for index in by_device.values():
        out[index] = _to_host(torch.stack(torch._foreach_norm([tensors[i] for i in index], dtype=torch.float64)))
    return out


class ZeroAwareLamb(Optimizer):
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
            raise BadInput(f"ZeroAwareLamb: lr must be >= 0, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise BadInput(f"ZeroAwareLamb: betas must be two values in [0, 1), got {betas!r}")
        if not eps > 0.0:
            raise BadInput(f"ZeroAwareLamb: eps must be > 0, got {eps!r}")
        if not weight_decay >= 0.0:
            raise BadInput(f"ZeroAwareLamb: weight_decay must be >= 0, got {weight_decay!r}")
        if min_trust is not None and max_trust is not None and min_trust > max_trust:
            raise BadInput(f"ZeroAwareLamb: min_trust={min_trust!r} > max_trust={max_trust!r}")
        if trust_ratio not in TRUST_RATIO_RULES:
            raise BadInput(f"ZeroAwareLamb: trust_ratio must be one of {TRUST_RATIO_RULES}, got {trust_ratio!r}")
        for name, value in (("min_trust", min_trust), ("max_trust", max_trust)):
            if value is not None and not value >= 0.0:
                raise BadInput(f"ZeroAwareLamb: {name} must be >= 0 or None, got {value!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        min_trust=min_trust, max_trust=max_trust, trust_ratio=trust_ratio)
        self._registered: set[int] = set()
        self._layout: ZeroLayout | None = None
        self._pending: dict[int, tuple[torch.Tensor, dict]] = {}
        self._run_index: torch.Tensor | None = None
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
            raise UnsupportedZeroSetup("ZeroAwareLamb does not support ZeRO stage 3: its sub-group partitions would "
                                      "give per-slice trust ratios. Use ZeRO stage 1 or 2, or AdamW under stage 3.")
        if setup.cpu_offload:
            raise UnsupportedZeroSetup("ZeroAwareLamb under ZeRO offload_optimizer is not supported (untested); "
                                       "drop zero_optimization.offload_optimizer")
        if setup.torch_autocast or setup.zenflow:
            raise UnsupportedZeroSetup("ZeroAwareLamb does not support torch_autocast or ZenFlow under ZeRO")
        if setup.mixed_dp_groups:
            raise UnsupportedZeroSetup(f"ZeroAwareLamb: param group(s) {list(setup.mixed_dp_groups)} use a different "
                                       "data-parallel group (MoE expert groups are not supported)")
        if getattr(zero_optimizer, "optimizer", None) is not self:
            raise ValueError("ZeroAwareLamb.bind_zero: the given ZeRO optimizer does not wrap this optimizer")
        return self.bind_layout(zero_layout(zero_optimizer))

    def bind_layout(self, layout: ZeroLayout) -> ZeroLayout:
        """Step the flat partitions of ``layout`` (one per param group, in order) with per-tensor trust ratios.
        :meth:`bind_zero` reads the layout from DeepSpeed; a one-rank layout built by hand serves tests."""
        if len(layout.groups) != len(self.param_groups):
            raise RuntimeError(f"ZeroAwareLamb.bind_zero: {len(layout.groups)} ZeRO groups for "
                               f"{len(self.param_groups)} param groups")
        for i, (g, lay) in enumerate(zip(self.param_groups, layout.groups, strict=True)):
            if len(g["params"]) != 1 or g["params"][0] is not lay.flat:
                raise RuntimeError(f"ZeroAwareLamb.bind_zero: param group {i} does not hold ZeRO's flat partition")
        self._layout = layout
        self._pending = {}
        self._run_index = torch.cat([lay.run_index for lay in layout.groups])
        return layout

    # ------------------------------------------------------------------ math
    @staticmethod
    def _moments_and_updates(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                             group: dict) -> list[torch.Tensor]:
        """Advance the Adam moments of ``params`` (equal step counts) and return their LAMB update directions ``u``
        (before the trust ratio), one multi-tensor op per line of the math.

        ``step`` is a Python int, in each state and mirrored in ``group["step"]`` as DeepSpeed's FusedAdam does: ZeRO's
        elastic checkpoints save ``param_groups[0]["step"]`` and would pad a 0-dim tensor step into a vector, and
        universal checkpoints accept an int step.
        """
        beta1, beta2 = group["betas"]
        step = states[0]["step"]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        if group["bias_correction"]:
            bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
        else:
            bc1 = bc2 = 1.0
        denom = torch._foreach_div(exp_avg_sqs, bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(exp_avgs, bc1)
        torch._foreach_div_(updates, denom)
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        return updates

    @staticmethod
    def _begin_step(params: list[torch.Tensor], states: list[dict], group: dict) -> None:
        """Create missing moments and advance each tensor's step count."""
        for p, state in zip(params, states, strict=True):
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = int(state["step"]) + 1
        group["step"] = states[-1]["step"]

    @staticmethod
    def _trust_ratios(w_norm: np.ndarray, u_norm: np.ndarray, group: dict) -> np.ndarray:
        """Float64 trust ratios ``||w|| / ||u||`` of one param group's tensors, 1 where a norm is 0 (not clamped)."""
        if group["trust_ratio"] == "decay_only" and group["weight_decay"] == 0.0:
            return np.ones_like(w_norm)
        with np.errstate(over="ignore", invalid="ignore"):  # w / tiny overflows where u = 0: replaced by 1 below
            ratio = w_norm / np.maximum(u_norm, np.finfo(np.float64).tiny)
        if group["min_trust"] is not None or group["max_trust"] is not None:
            ratio = np.clip(ratio, group["min_trust"], group["max_trust"])
        return np.where((w_norm > 0) & (u_norm > 0), ratio, 1.0)

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
        # (group, params, updates) per param group and step count: the tensors stepped together
        pieces: list[tuple[dict, list[torch.Tensor], list[torch.Tensor]]] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if id(p) not in self._registered:
                    # DeepSpeed's fp16/bf16 wrapper without ZeRO (FP16_UnfusedOptimizer) swaps in fp32 copies and
                    # steps once inside deepspeed.initialize, before bind_optimizer could refuse it: say so here.
                    raise RuntimeError("ZeroAwareLamb: its params were replaced (a DeepSpeed ZeRO flat partition?) but "
                                       "the optimizer is not bound; call bert_ds.optim.bind_optimizer(engine) after "
                                       "deepspeed.initialize, or trust ratios would be per slice, not per tensor. "
                                       "Raised inside deepspeed.initialize, this is DeepSpeed's fp16/bf16 wrapper "
                                       "without ZeRO, which ZeroAwareLamb does not support: use ZeRO stage 1 or 2")
                if p.grad.is_sparse:
                    raise RuntimeError("ZeroAwareLamb does not support sparse gradients")
            if not params:
                continue
            states = [self.state[p] for p in params]
            self._begin_step(params, states, group)
            by_step: dict[int, list[int]] = {}  # bias correction is per step count: tensors that missed steps differ
            for i, state in enumerate(states):
                by_step.setdefault(state["step"], []).append(i)
            for index in by_step.values():
                ps = [params[i] for i in index]
                pieces.append((group, ps, self._moments_and_updates(ps, [p.grad for p in ps],
                                                                    [states[i] for i in index], group)))
        if not pieces:
            return
        params = [p for _, ps, _ in pieces for p in ps]
        norms = _host_norms(params + [u for _, _, us in pieces for u in us])
        w_norms, u_norms = norms[:len(params)], norms[len(params):]
        start = 0
        for group, ps, us in pieces:
            end = start + len(ps)
            ratios = self._trust_ratios(w_norms[start:end], u_norms[start:end], group)
            start = end
            torch._foreach_mul_(us, ratios.tolist())  # a host scalar list: torch's multi-tensor kernels take it
            torch._foreach_add_(ps, us, alpha=-group["lr"])

    def _zero_step(self) -> None:
        layout = self._layout
        flat_index = {id(lay.flat): k for k, lay in enumerate(layout.groups)}
        stepped_now = set()
        for group in self.param_groups:
            k = flat_index.get(id(group["params"][0])) if len(group["params"]) == 1 else None
            if k is None:
                raise RuntimeError("ZeroAwareLamb: a param group no longer holds the flat partition bound by bind_zero")
            if k in self._pending:
                raise RuntimeError(f"ZeroAwareLamb: ZeRO group {k} stepped twice before the step completed")
            p = layout.groups[k].flat
            if p.grad is None:
                raise RuntimeError(f"ZeroAwareLamb: ZeRO group {k} has no gradient partition")
            state = self.state[p]
            self._begin_step([p], [state], group)
            # ZeRO narrows param_groups to the group it steps, so keep the group dict for the deferred update.
            self._pending[k] = (self._moments_and_updates([p], [p.grad], [state], group)[0], group)
            stepped_now.add(k)
        if len(self._pending) < len(layout.groups):
            return  # ZeRO steps the remaining groups next; their updates and ours are applied together
        try:
            pending = [(layout.groups[k], *self._pending[k]) for k in range(len(layout.groups))]
            # Sums of squares of w and u per contiguous run of every group, in one op; padding runs land in the spare
            # last slot (never read).
            u_runs = [list(torch.split(u, lay.lengths)) for lay, u, _ in pending]
            runs = [v for lay, _, _ in pending for v in torch.split(lay.flat, lay.lengths)]
            runs += [v for group_runs in u_runs for v in group_runs]
            squares = torch.stack(torch._foreach_norm(runs, dtype=torch.float64)).square_()
            partials = torch.zeros(2, layout.n_tensors + 1, dtype=torch.float64, device=squares.device)
            partials.index_add_(1, self._run_index, squares.view(2, -1))
            if layout.world_size > 1:
                import deepspeed.comm as dist

                dist.all_reduce(partials, group=layout.process_group)
            # Everything the host needs after the copy is built before it (views, run indices): the device waits
            # for the host only for the trust-ratio arithmetic on ~n_tensors numbers.
            run_tensors = [np.array(lay.run_tensor) for lay, _, _ in pending]  # padding (-1): spare slot, ratio 0
            norms = np.sqrt(_to_host(partials))
            for k, (lay, u, group) in enumerate(pending):
                ratios = self._trust_ratios(norms[0], norms[1], group)
                run_ratios = np.where(run_tensors[k] >= 0, ratios[run_tensors[k]], 0.0)
                torch._foreach_mul_(u_runs[k], run_ratios.tolist())
                lay.flat.add_(u, alpha=-group["lr"])
                if lay.bit16_partition is not None and k not in stepped_now:
                    # ZeRO copied this group's fp32 partition to bit16 after an earlier call, before our deferred
                    # update: refresh it before the all-gather. The groups of this call ZeRO copies after it returns.
                    lay.bit16_partition.data.copy_(lay.flat.data)
        finally:
            self._pending = {}
