"""DataLoader worker processes of the loaders: errors raised in the main process, a dead worker named.

A :class:`~bert_ds.data.reader.ShardError` in a worker is returned as data and raised in the main process with its
one-line message. Each worker writes what it is reading (pid, shard, member) to a shared-memory slot, so a worker
that dies (a signal: SIGBUS on a shard truncated while mapped, the out-of-memory killer) is reported as one
:class:`LoaderWorkerError` naming the shard and member: at once when the main process waits for data, otherwise at
the next batch or the training loop's next step boundary (:func:`raise_if_worker_died`); the SIGCHLD handler only
records the death. Each pool has its own ``torch.Generator``, so iterating never draws from torch's global RNG.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import multiprocessing.sharedctypes
import os
import re
import signal
import threading
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from bert_ds.data.masking import counter_hash
from bert_ds.data.reader import ShardError
from bert_ds.errors import BertDsError, StepFailed

__all__ = ["LoaderWorkerError", "iterate", "raise_if_worker_died"]

_TAG_WORKERS = 0x574B5253  # the DataLoader's own generator (worker base seeds): counter_hash(_TAG_WORKERS, seed)


class LoaderWorkerError(StepFailed):
    """A DataLoader worker process died (killed by a signal, e.g. SIGBUS on a shard truncated while mapped, or the
    out-of-memory killer); the one-line message names the shard and member it was reading."""


class _Failure:
    """A :class:`ShardError` caught in a worker and returned as data, so the main process raises it with its own
    one-line message (torch re-raises a worker's exception wrapped in a multi-line traceback text)."""

    def __init__(self, message: str, kind: type = ShardError):
        self.message = message
        self.kind = kind


class _Guarded(Dataset):
    def __init__(self, inner: Dataset):
        self.inner = inner

    def __getitem__(self, m: int) -> np.ndarray | _Failure:
        try:
            return self.inner[m]
        except (ShardError, BertDsError) as exc:  # a URL's shard: missing, corrupt, disk full (shard_cache)
            return _Failure(str(exc), type(exc))


def _init_worker(slots, worker_id: int) -> None:
    """Point the worker's reader at its (pid, shard, index) slot in shared memory: what it was reading if it dies.

    The worker ignores SIGTERM, SIGINT and SIGUSR1: Slurm pre-emption, scancel, systemd and ``docker stop`` signal
    the whole process group, and a worker killed by it makes its rank fail ("a DataLoader worker died") before the
    rank's step-boundary checkpoint. Shutdown is the rank's: torch stops workers through their queues, and a worker
    whose rank is gone exits by itself (torch's worker loop watches its parent).
    """
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    view = np.frombuffer(slots, dtype=np.int64)[3 * worker_id:3 * worker_id + 3]
    view[:] = (os.getpid(), -1, -1)
    torch.utils.data.get_worker_info().dataset.inner.collate.reader.reading = view[1:]


def _from_workers(dataset: Dataset, indices: Iterator[int] | Sampler, num_workers: int,
                  prefetch_factor: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    slots = multiprocessing.sharedctypes.RawArray("q", 3 * num_workers)
    # Its own generator: creating the iterator draws the workers' base seed from it, never from torch's global RNG,
    # which a resumed run has just restored (a draw there would shift every later dropout mask). Batches do not
    # depend on worker seeds: masking is keyed by (seed, epoch, sample id).
    generator = torch.Generator().manual_seed(int(counter_hash(_TAG_WORKERS, seed)) >> 1)
    loader = DataLoader(_Guarded(dataset), batch_size=None, sampler=indices, num_workers=num_workers,
                        prefetch_factor=prefetch_factor, collate_fn=_identity, generator=generator,
                        worker_init_fn=functools.partial(_init_worker, slots))
    before = {child.pid for child in multiprocessing.active_children()}
    it = iter(loader)  # starts the workers
    _POOL_PIDS.update(child.pid for child in multiprocessing.active_children() if child.pid not in before)
    watch = (slots, dataset.collate.reader)
    _WATCHED[id(watch)] = watch
    _record_worker_deaths()
    _stop_workers_at_exit()
    try:
        while True:
            raise_if_worker_died()
            died = None
            try:
                flat = next(it)
            except StopIteration:
                return
            except RuntimeError as exc:
                if isinstance(exc, LoaderWorkerError) or "DataLoader worker" not in str(exc):
                    raise
                # torch noticed the death itself (its status poll while waiting for data); the handler may have
                # recorded the same death meanwhile: report it once
                died = _DIED[0] if _DIED else _death_message(str(exc), [watch])
                _DIED.clear()
            if died is not None:  # raised outside the except: no __context__ whose frames would hold the iterator
                raise LoaderWorkerError(died)
            if isinstance(flat, _Failure):
                raise flat.kind(flat.message)
            yield dataset.collate.unpack(flat)
    finally:
        _WATCHED.pop(id(watch), None)
        if not _WATCHED:  # records name workers of watched pools only: none is left to report on
            _DIED.clear()
        # Stop the pool now, not when the garbage collector gets to it: the traceback of an error raised above (a
        # ShardError a caller catches and keeps) holds this frame, and with it the iterator and its workers, which
        # ignore SIGTERM. The last reference gone, torch's iterator shuts its workers down (__del__).
        del it


_WATCHED: dict[int, tuple] = {}
"""(slots, reader) of every live worker pool in this process, for naming a dead worker's shard."""
_DIED: list[str] = []
"""Deaths of this process's loader workers recorded by the SIGCHLD handler (one-line messages), oldest first."""
_SIGCHLD_WRAPPED = False


def _death_message(torch_message: str, watched: list[tuple]) -> str:
    """One line: which worker died, what it was reading, and torch's first line."""
    first = torch_message.strip().splitlines()[0] if torch_message.strip() else "a worker exited"
    match = re.search(r"pid(?:\(s\))? ([\d, ]+)\)", first)
    dead = {int(x) for x in re.findall(r"\d+", match.group(1))} if match else set()
    reading = []
    for slots, reader in watched:
        table = np.frombuffer(slots, dtype=np.int64).reshape(-1, 3)
        for worker, (pid, shard, index) in enumerate(table.tolist()):
            if pid in dead or (not dead and pid):
                where = (f"{reader.shard_path(shard)[1]} member #{index}" if shard >= 0
                         else "nothing yet (it died before reading a shard)")
                reading.append(f"worker {worker} (pid {pid}) was reading {where}")
    what = "; ".join(reading) if reading else "the shard it was reading is unknown"
    return f"a DataLoader worker died: {what} [torch: {first}]"


def raise_if_worker_died() -> None:
    """Raise :class:`LoaderWorkerError` for a loader worker whose death the SIGCHLD handler recorded (and forget it).
    The training loop calls this at its step boundaries; a loader calls it before each batch."""
    if _DIED:
        message = _DIED[0]
        _DIED.clear()
        raise LoaderWorkerError(message)


def _record_worker_deaths() -> None:
    """Wrap torch's SIGCHLD handler (installed by the first worker pool) so that a worker dying while the main process
    computes is recorded, naming the shard, and raised by :func:`raise_if_worker_died` at the next step boundary.

    Recording instead of raising: CPython runs a Python signal handler in the main thread between any two bytecodes,
    whichever thread the kernel delivered the signal to (TensorBoard's writer, gloo's, OpenMP's), so no signal mask
    of the main thread keeps it out of a checkpoint save; an exception from the handler would abort the save half-way.
    The same pattern as ``bert_ds.lifecycle.preemption.Preemption``."""
    global _SIGCHLD_WRAPPED
    if _SIGCHLD_WRAPPED or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGCHLD)
    if not callable(previous):
        return

    def handler(signum, frame):
        try:
            previous(signum, frame)
        except RuntimeError as exc:
            if "DataLoader worker" not in str(exc) or not _WATCHED:
                raise  # another DataLoader of this process: torch's behaviour
            _DIED.append(_death_message(str(exc), list(_WATCHED.values())))

    signal.signal(signal.SIGCHLD, handler)
    _SIGCHLD_WRAPPED = True


_EXIT_HOOKED = False
_POOL_PIDS: set[int] = set()
"""Every worker of every pool this process started, recorded as it starts: a pool no longer watched may still have
live workers (its iterator kept alive by a reference cycle or a caller), and a worker that has not yet written its
pid to its slot (:func:`_init_worker`) may already ignore SIGTERM when this process exits."""


def _stop_workers_at_exit() -> None:
    """At interpreter exit, SIGKILL the workers of every pool still alive (a rank leaving on an error while a pool's
    iterator is suspended in a traceback; an iterator a caller still holds): they ignore SIGTERM
    (:func:`_init_worker`), so multiprocessing's own exit hook, which terminates daemonic children with SIGTERM and
    then joins them, would wait for them forever. Registered after multiprocessing's hook, so it runs first (atexit
    is last in, first out). Workers hold nothing to save."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        atexit.register(_kill_open_pools)
        _EXIT_HOOKED = True


def _kill_open_pools() -> None:
    live = [child for child in multiprocessing.active_children() if child.pid in _POOL_PIDS]  # our workers only
    if not live:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # these deaths are ours, not a failure to report
    for child in live:
        child.kill()
        child.join()


def _identity(batch):
    return batch


def iterate(dataset: Dataset, indices: Iterator[int] | Sampler, num_workers: int,
            prefetch_factor: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Batches ``dataset[i]`` for ``i`` in ``indices``, unpacked by ``dataset.collate``: in this process, or built by
    ``num_workers`` DataLoader workers (delivered in ``indices`` order either way)."""
    if num_workers == 0:
        return (dataset.collate.unpack(dataset[i]) for i in indices)
    return _from_workers(dataset, indices, num_workers, prefetch_factor, seed)
