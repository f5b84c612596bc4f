"""Count the kernel launches a piece of torch code would make on a GPU, on the CPU, with a ``TorchDispatchMode``.

Every aten op that reaches the dispatcher inside :func:`count_launches` is classified: views and metadata ops
(``split``, ``unbind``, ``detach``; ``OpOverload.is_view``) and allocations (``empty*``) launch nothing; ``.item()``
(``_local_scalar_dense``) is a read-back, counted apart as ``reads``; every other op counts as one launch, except a
``_foreach_*`` op whose tensor lists CUDA would send down its per-tensor slow route, which counts one launch per
tensor. The slow-route rule transcribes ``check_fast_path_restrictions`` in torch's ``aten/src/ATen/native/
ForeachUtils.h``: every tensor strided, dense and non-overlapping on one device, one dtype per list, corresponding
tensors of the lists with equal sizes and strides (so a list of 0-dim scale tensors beside full tensors is slow).

One op is the unit, as a launch count on a GPU would be up to constants shared by every optimizer here: a fast-route
foreach op launches one kernel per 320 chunks of 65,536 elements, ``_foreach_norm`` adds a zero-fill and a clean-up
kernel. The code counted must not branch on the device for the count to be the CUDA path's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LaunchCount", "count_launches", "foreach_fast_route"]

_NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                        "_local_scalar_dense", "_record_function_enter_new", "_record_function_exit"})
"""Ops that allocate, read back or mark a profiler range without launching a kernel (``_local_scalar_dense`` is
counted as a read)."""


@dataclass
class LaunchCount:
    """Launches by op name, read-backs (``.item()``), and every non-view op once (the plain dispatch count)."""

    launches: Counter = field(default_factory=Counter)
    reads: int = 0
    ops: int = 0

    @property
    def total(self) -> int:
        return sum(self.launches.values())


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


class _Counter(TorchDispatchMode):
    def __init__(self, count: LaunchCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not func.is_view:
            self.count.ops += 1
            if name == "_local_scalar_dense":
                self.count.reads += 1
            elif name not in _NO_KERNEL:
                lists = _tensor_lists(args, kwargs) if name.startswith("_foreach_") else []
                slow = lists and not foreach_fast_route(lists)
                self.count.launches[name] += len(lists[0]) if slow else 1
        return func(*args, **kwargs)


@contextmanager
def count_launches() -> Iterator[LaunchCount]:
    """``with count_launches() as c: ...``; then ``c.total`` launches, ``c.launches`` by op, ``c.reads``."""
    count = LaunchCount()
    with _Counter(count):
        yield count
