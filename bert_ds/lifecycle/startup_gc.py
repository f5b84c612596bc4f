"""A rank starts without Python's cyclic garbage collector and turns it back on at its first training step.

Start-up allocates hundreds of thousands of long-lived objects (torch, DeepSpeed, and the ``torch._dynamo`` and
``torch._inductor`` modules that torch.optim and DeepSpeed's ZeRO import on first use; ~460,000 frozen in a 1-rank
``tiny`` run) and little garbage; the collector, running on allocation counts, traverses the growing heap again and
again while they load. Measured on a 2-rank ``tiny`` CPU run of both phases (2 cores, quiet, median of 6): 13.6 CPU
seconds for the two ranks with the collector on, 12.4 paused; turning it back on without the collection and the
freeze saved nothing (12.9 vs 12.8): the deferred collections then traverse the same heap.
``bert_ds/runtime/pretrain.py`` started as a rank (a script or ``python -m``: every launcher's command) calls
:func:`pause` before its first heavy import; :func:`resume` runs at the first step of the run
(:func:`bert_ds.runtime.trainer.run_phase`): one full collection frees whatever start-up left in cycles, the
survivors are frozen (never traversed again; a rank ends without the interpreter's teardown,
:mod:`bert_ds.lifecycle.rank_exit`), and the collector runs as usual from there. A process that never paused (a test
calling ``main`` in-process, ``bert-ds`` commands) is left as it is. Imports nothing but :mod:`gc`."""

from __future__ import annotations

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
    """Collect start-up's garbage, freeze what survives, turn the collector back on; returns how many objects were
    frozen. A no-op (0) unless paused."""
    global _paused
    if not _paused:
        return 0
    _paused = False
    gc.collect()
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()
