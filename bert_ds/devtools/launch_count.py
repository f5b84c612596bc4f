"""How many kernels a piece of torch code would launch on a CUDA device, counted on the CPU.

A ``TorchDispatchMode`` sees every aten op that reaches a backend after autograd and composite decomposition. Views
and in-place metadata ops (from their schemas), allocations and profiler markers launch nothing; ``.item()``
(``_local_scalar_dense``) is a device-to-host read, counted apart as ``reads``; every other op is one launch, except
a ``_foreach_*`` op whose tensor lists CUDA would send down its per-tensor slow route, which counts once per tensor.
The slow-route rule transcribes ``check_fast_path_restrictions`` in torch's ``aten/src/ATen/native/ForeachUtils.h``:
every tensor strided, dense and non-overlapping on one device, one dtype per list, corresponding tensors of the lists
with equal sizes and strides (so a list of 0-dim scale tensors beside full tensors is slow). One op is the unit, as a
launch count on a GPU would be up to constants: a fast-route foreach op launches one kernel per 320 chunks of 65,536
elements, ``_foreach_norm`` adds a zero-fill and a clean-up kernel. The code counted must not branch on the device.

With ``record_triton``, :func:`bert_ds.kernels.jit.record_launches` records each Triton launch instead of running it
and makes the backend registry decide as on CUDA tensors. A BERT micro batch (:func:`micro_batch_launches`) counts
constant + per_layer * layers + per_sequence * batch, fitted on six small points on CPU tensors, each checked against
the formula, and extrapolated exactly to the model's layers and micro batch. Not on ``meta`` tensors: there the Triton
kernels' ``torch.library`` custom ops run their fake implementations, which launch (and so record) nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bert_ds.config import BertConfig

__all__ = ["LaunchCount", "aten_name_launches_kernel", "count_launches", "foreach_fast_route", "launches_kernel",
           "micro_batch_launch_count", "micro_batch_launches"]

_NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
                        "resize_", "resize_as_", "lift_fresh", "set_", "_reshape_alias", "sym_size", "sym_stride",
                        "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
                        "_record_function_enter_new", "_record_function_exit"})
"""Ops that only allocate, re-describe memory or mark a profiler range: no kernel on a CUDA device."""

_READ = "_local_scalar_dense"


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
    """Launches by aten op and by Triton kernel, device-to-host reads, and every non-view op once (the plain
    dispatch count)."""

    launches: Counter = dataclasses.field(default_factory=Counter)
    triton: Counter = dataclasses.field(default_factory=Counter)
    reads: int = 0
    ops: int = 0

    @property
    def total(self) -> int:
        """Kernel launches: aten and Triton (reads not included)."""
        return sum(self.launches.values()) + sum(self.triton.values())


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some order of the dimensions is contiguous (size-1 dimensions never matter)."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def foreach_fast_route(lists: list[list[torch.Tensor]]) -> bool:
    """Whether CUDA runs a ``_foreach_*`` op over these tensor lists as multi-tensor kernels (see module docstring)."""
    first = lists[0][0]
    for tensors in lists:
        if any(t.device != first.device or t.layout != torch.strided or not _dense(t)
               or t.dtype != tensors[0].dtype for t in tensors):
            return False
    for other in lists[1:]:
        for a, b in zip(lists[0], other, strict=True):
            if a.shape != b.shape or any(n != 1 and sa != sb for n, sa, sb in zip(a.shape, a.stride(), b.stride(),
                                                                                   strict=True)):
                return False
    return True


def _tensor_lists(args, kwargs) -> list[list[torch.Tensor]]:
    values = list(args) + list(kwargs.values())
    return [list(v) for v in values if isinstance(v, list | tuple) and v and isinstance(v[0], torch.Tensor)]


def _custom_ops() -> dict:
    """``torch.library.custom_op`` definitions by qualified name (torch 2.4+ keeps them in this private table)."""
    from torch._library import custom_ops

    return custom_ops.OPDEFS


class _Counter(TorchDispatchMode):
    def __init__(self, count: LaunchCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, name = func._schema.name.split("::")
        opdef = _custom_ops().get(func._schema.name) if namespace != "aten" else None
        if opdef is not None:
            # A torch.library custom op (bert_ds's Triton kernels) is no kernel itself: run its implementation with the
            # counter on, so the aten ops around its Triton launches count (the launches are recorded).
            with self:
                return opdef._init_fn(*args, **kwargs)
        if not (func.is_view or torch.Tag.inplace_view in func.tags):
            self.count.ops += 1
            if name == _READ:
                self.count.reads += 1
            elif name not in _NO_KERNEL:
                lists = _tensor_lists(args, kwargs) if name.startswith("_foreach_") else []
                slow = lists and not foreach_fast_route(lists)
                self.count.launches[name] += len(lists[0]) if slow else 1
        return func(*args, **kwargs)


@contextmanager
def count_launches(record_triton: bool = False) -> Iterator[LaunchCount]:
    """``with count_launches() as c: ...``; then ``c.total`` launches, ``c.launches`` by op, ``c.reads``. With
    ``record_triton`` the Triton launches are recorded, not run (their outputs stay unwritten), into ``c.triton``."""
    from bert_ds.kernels.jit import record_launches

    count = LaunchCount()
    with record_launches() if record_triton else nullcontext([]) as recorded, _Counter(count):
        yield count
    count.triton.update(launch.kernel.fn.__name__ if hasattr(launch.kernel, "fn") else str(launch.kernel)
                        for launch in recorded)


def _model(config: BertConfig, kernels: str, dtype: torch.dtype, device: torch.device):
    from bert_ds.model import BertForPreTraining

    torch.manual_seed(0)
    with device:
        return BertForPreTraining(config, kernels=kernels).to(dtype).train()


def _micro_batch(model, seq: int, batch: int) -> int:
    from bert_ds.devtools.bench_step import predictions_for, synthetic_batch

    device = next(model.parameters()).device
    data = synthetic_batch(model.config, batch, seq, predictions_for(seq), torch.device("cpu"))  # counts on the host
    data = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    model.zero_grad(set_to_none=True)
    with count_launches(record_triton=True) as count:
        model(**data).loss.backward()
    return count.total + count.reads  # a read is a device-to-host copy (and a sync) on a GPU


def micro_batch_launch_count(config: BertConfig, seq: int, batch: int, kernels: str = "auto",
                             dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> int:
    """Launches of one training micro batch of ``config`` at ``batch`` x ``seq``, counted directly on ``device``
    tensors (the batch's host counts make the forward read nothing back; see the module doc for why not ``meta``)."""
    return _micro_batch(_model(config, kernels, dtype, torch.device(device)), seq, batch)


def micro_batch_launches(config: BertConfig, seq: int, batch: int, kernels: str = "auto",
                         dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> dict:
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
