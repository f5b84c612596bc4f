"""A rank starts without Python's cyclic garbage collector and turns it back on at its first training step.

Start-up allocates hundreds of thousands of long-lived objects (torch, DeepSpeed, and the ``torch._dynamo`` and
``torch._inductor`` modules that torch.optim and DeepSpeed's ZeRO import on first use) and little garbage; the
collector, running on allocation counts, traverses the growing heap again and again while they load. On a 2-rank
``tiny`` CPU run of both phases (2 cores, median of 6) the two ranks took 13.6 CPU seconds with the collector on, 12.4
paused; turning it back on without the collection and the freeze below saved nothing (12.9 vs 12.8).

``bert_ds/runtime/pretrain.py`` started as a rank (a script or ``python -m``: every launcher's command) calls
:func:`pause` before its first heavy import; :func:`resume` runs before the first step
(:func:`bert_ds.runtime.trainer.run_phase`): one full collection frees what start-up left in cycles, the survivors
are frozen (never traversed again while the rank trains) and the collector runs as usual. An ``atexit`` handler
unfreezes them: a rank whose exception escapes ``main`` ends through the interpreter's teardown (the others skip it,
:mod:`bert_ds.lifecycle.rank_exit`), which must collect the heap as before. Left frozen, Triton's nanobind bindings
print leak warnings, and the failing rank ends seconds sooner: a rank failing on a dead peer's collective (exit 1) can
then end within the same one-second poll of DeepSpeed's ``launch.py`` as the peer that failed first, and the launcher
passes on whichever of the two codes it meets first in its set of processes. A process that never paused (a test
calling ``main`` in-process, ``bert-ds`` commands) is left as it is. Imports nothing but :mod:`gc` and :mod:`atexit`."""

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
