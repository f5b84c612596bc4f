"""A rank starts without Python's cyclic garbage collector and turns it back on at its first training step.

Start-up allocates hundreds of thousands of long-lived objects (torch, DeepSpeed, and the ``torch._dynamo`` and
``torch._inductor`` modules that torch.optim and DeepSpeed's ZeRO import on first use; ~460,000 frozen in a 1-rank
``tiny`` run) and little garbage; the collector, running on allocation counts, traverses the growing heap again and
again while they load. Measured on a 2-rank ``tiny`` CPU run of both phases (2 cores, quiet, median of 6): 13.6 CPU
seconds for the two ranks with the collector on, 12.4 paused; turning it back on without the collection and the freeze
saved nothing (12.9 vs 12.8): the deferred collections then traverse the same heap. ``bert_ds/runtime/pretrain.py``
started as a rank (a script or ``python -m``: every launcher's command) calls :func:`pause` before its first heavy
import; :func:`resume` runs at the first step of the run (:func:`bert_ds.runtime.trainer.run_phase`): one full
collection frees whatever start-up left in cycles, the survivors are frozen (never traversed again while the rank
trains), and the collector runs as usual from there. At exit they are unfrozen again (an ``atexit`` handler): a rank
ends without the interpreter's teardown (:mod:`bert_ds.lifecycle.rank_exit`), but one whose exception escapes ``main``
still goes through it, and that teardown must not leave the frozen heap uncollected: Triton's nanobind bindings then
print leak warnings, and its seconds of collection are what keep a rank failing on a dead peer's collective (exit 1)
from ending within the same second as the peer that failed first. DeepSpeed's ``launch.py`` polls its ranks once a
second in set order and exits with the code of whichever failed rank it meets first, so two failures in one poll make
the job's code a coin toss (measured: the fault row ``token-id-over-vocab`` exited 1 instead of 2 with the heap left
frozen). A process that never paused (a test calling ``main`` in-process, ``bert-ds`` commands) is left as it is.
Imports nothing but :mod:`gc` and :mod:`atexit`."""

from __future__ import annotations

import atexit
import gc

__all__ = ["pause", "paused", "resume"]

_paused = False


def pause() -> None:
    """Turn the collector off for start-up, when it is on."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def paused() -> bool:
    """Whether :func:`pause` turned the collector off and :func:`resume` has not yet turned it back on."""
    return _paused


def resume() -> int:
    """Collect start-up's garbage, freeze what survives until exit, turn the collector back on; returns how many
    objects were frozen. A no-op (0) unless paused."""
    global _paused
    if not _paused:
        return 0
    _paused = False
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    gc.enable()
    return gc.get_freeze_count()
