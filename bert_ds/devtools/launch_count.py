"""How many kernels a BERT training micro batch launches on a CUDA device, counted on the CPU.

Two counters run together: a ``TorchDispatchMode`` sees every aten op that reaches a backend after autograd and
composite decomposition, and counts those that launch a kernel (:func:`launches_kernel`: not a view or alias, not an
allocation); :func:`bert_ds.kernels.jit.record_launches` records each Triton launch instead of running it, and makes
the backend registry decide as on CUDA tensors, so the aten ops counted are those around the kernels a GPU runs.
The count is the model's own forward and backward (no DeepSpeed gradient hooks, gradients start unset).

The count is constant + per_layer * layers + per_sequence * batch: every encoder layer issues the same ops, and any op
run once per sequence (the last layer's attention did, until it became one masked SDPA call) adds B times its count. :func:`micro_batch_launches` counts six small points, checks each against the formula and
extrapolates exactly to 24 layers and the recipe's micro batch. The points run on ``meta`` tensors (seconds; a test
checks that a count on real CPU tensors is the same).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bert_ds.config import BertConfig
from bert_ds.devtools.bench_step import predictions_for, synthetic_batch
from bert_ds.kernels.jit import record_launches

__all__ = ["LaunchCount", "aten_name_launches_kernel", "count_launches", "launches_kernel", "micro_batch_launch_count",
           "micro_batch_launches"]

# Ops that only allocate or re-describe memory: no kernel on a CUDA device (views are found from their schemas).
_NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
                        "resize_", "resize_as_", "lift_fresh", "set_", "_reshape_alias", "sym_size", "sym_stride",
                        "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"})


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """True when ``func`` launches a kernel on a CUDA device: not a view (output aliases an input), not an in-place
    view, not an allocation. A device-to-host read (``_local_scalar_dense``) counts: it is a copy and a sync."""
    if func.is_view or torch.Tag.inplace_view in func.tags:
        return False
    return func._schema.name.split("::")[-1] not in _NO_KERNEL


@functools.cache
def aten_name_launches_kernel(name: str) -> bool:
    """:func:`launches_kernel` for a profiler event name such as ``aten::view`` (judged on its first overload);
    names that are not aten ops (user annotations, ``c10d::``) count as launching."""
    if not name.startswith("aten::"):
        return True
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    if packet is None:
        return True
    overloads = packet.overloads()
    return launches_kernel(getattr(packet, "default" if "default" in overloads else overloads[0]))


@dataclass
class LaunchCount:
    """Kernel launches of one block of code: aten ops by name and Triton kernels by name."""

    aten: Counter = dataclasses.field(default_factory=Counter)
    triton: Counter = dataclasses.field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values())


class _AtenCounter(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches_kernel(func):
            self.counts[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_launches(fn) -> LaunchCount:
    """Run ``fn()`` with both counters on; Triton launches are recorded, not run (their outputs stay unwritten)."""
    count = LaunchCount()
    with record_launches() as launches, _AtenCounter(count.aten):
        fn()
    count.triton.update(launch.kernel.fn.__name__ if hasattr(launch.kernel, "fn") else str(launch.kernel)
                        for launch in launches)
    return count


def _model(config: BertConfig, kernels: str, dtype: torch.dtype, device: torch.device):
    from bert_ds.model import BertForPreTraining

    torch.manual_seed(0)
    with device:
        return BertForPreTraining(config, kernels=kernels).to(dtype).train()


def _micro_batch(model, seq: int, batch: int) -> int:
    device = next(model.parameters()).device
    data = synthetic_batch(model.config, batch, seq, predictions_for(seq), torch.device("cpu"))  # counts on the host
    data = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    model.zero_grad(set_to_none=True)
    return count_launches(lambda: model(**data).loss.backward()).total


def micro_batch_launch_count(config: BertConfig, seq: int, batch: int, kernels: str = "auto",
                             dtype: torch.dtype = torch.bfloat16, device: str = "meta") -> int:
    """Launches of one training micro batch of ``config`` at ``batch`` x ``seq``, counted directly: on ``meta``
    tensors (no arithmetic, the same ops dispatched; the batch's host counts make the forward read nothing back) or
    on real CPU tensors."""
    return _micro_batch(_model(config, kernels, dtype, torch.device(device)), seq, batch)


def micro_batch_launches(config: BertConfig, seq: int, batch: int, kernels: str = "auto",
                         dtype: torch.dtype = torch.bfloat16, device: str = "meta") -> dict:
    """Launches of one training micro batch (forward + backward) of ``config`` at ``batch`` x ``seq`` on the CUDA
    path, from small counts: count(L, B) = constant + per_layer * L + per_sequence * B, measured at L in (2, 3, 4)
    and B in (2, 3, 4), checked on every point (equal increments, no L x B term at (3, 3)) and extrapolated exactly
    to ``config.num_hidden_layers`` and ``batch`` (on ``device``: see :func:`micro_batch_launch_count`). Raises
    ``RuntimeError`` when a point leaves the formula."""
    points: dict[tuple[int, int], int] = {}
    for layers, batches in ((2, (2, 3, 4)), (3, (2, 3)), (4, (2,))):
        model = _model(dataclasses.replace(config, num_hidden_layers=layers), kernels, dtype, torch.device(device))
        for b in batches:
            points[(layers, b)] = _micro_batch(model, seq, b)
        del model
    base = points[(2, 2)]
    per_layer, per_sequence = points[(3, 2)] - base, points[(2, 3)] - base
    constant = base - 2 * per_layer - 2 * per_sequence
    off = {f"L{n}xB{b}": c for (n, b), c in points.items() if c != constant + per_layer * n + per_sequence * b}
    if off:
        raise RuntimeError(f"launch count is not constant + per_layer * L + per_sequence * B: {off} off the "
                           f"formula fitted to {points}")
    return {"seq": seq, "batch": batch, "layers": config.num_hidden_layers, "per_layer": per_layer,
            "per_sequence": per_sequence, "constant": constant,
            "total": constant + per_layer * config.num_hidden_layers + per_sequence * batch,
            "counted": {f"L{n}xB{b}": c for (n, b), c in points.items()}}
