"""The compiler caches a run writes, in one owner: Triton's kernel cache and torch's JIT-extension build directory
(where DeepSpeed compiles its CPU ``deepspeed_shm_comm`` op).

* where they are (:func:`extensions_root`; Triton's rule in :func:`cache_dir_warnings`), and node-local per Slurm job
  unless the user chose (:func:`node_local_caches`, :func:`use_node_local_caches`; ``slurm/pretrain_common.sh`` uses
  the same rule);
* a warning when one sits on a network file system (:func:`cache_dir_warnings`, pre-flight);
* torch's build locks: never waited on silently, a stale one refused naming the file
  (:func:`wait_for_extension_builds`), and the build ``make venv`` does ahead of time (:func:`prebuild_extensions`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import torch

from bert_ds.deepspeed_internals import shm_comm_builder

__all__ = ["EXTENSION_LOCK_STALE_S", "NETWORK_FILESYSTEMS", "NODE_LOCAL_CACHE_VARS", "cache_dir_warnings",
           "extension_build_locks", "extensions_root", "filesystem_of", "node_local_caches", "prebuild_extensions",
           "use_node_local_caches", "wait_for_extension_builds"]

log = logging.getLogger(__name__)

EXTENSION_LOCK_STALE_S = float(os.environ.get("BERT_DS_EXTENSION_LOCK_STALE_S", 1800))
"""A torch-extension build lock older than this is taken to be left by a killed build. DeepSpeed's CPU
``deepspeed_shm_comm`` builds in about a minute on 2 cores; CUDA ops in a few minutes."""


def extensions_root() -> Path:
    """Where torch builds JIT extensions (the rule of ``torch.utils.cpp_extension._get_build_directory``, torch 2.x:
    ``$TORCH_EXTENSIONS_DIR`` or the user cache's ``torch_extensions/py<ver>_<cpu|cu<ver>|rocm<ver>>``)."""
    import torch.utils.cpp_extension as cpp

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if torch.version.hip is not None:
        accel = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accel = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accel = "cpu"
    return Path(cpp.get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{accel}"


def extension_build_locks() -> list[tuple[Path, float]]:
    """The build locks present in the torch extensions directory, with their age in seconds."""
    root = extensions_root()
    now = time.time()
    locks = []
    for lock in sorted(root.glob("*/lock")) if root.is_dir() else []:
        try:
            locks.append((lock, now - lock.stat().st_mtime))
        except FileNotFoundError:  # the build finished between glob and stat
            continue
    return locks


def wait_for_extension_builds(stale_after_s: float = EXTENSION_LOCK_STALE_S, poll_s: float = 10.0) -> None:
    """Never wait silently on an extension build lock: torch's ``FileBaton`` waits forever on a lock a killed build
    left behind. A lock older than ``stale_after_s`` is an error naming the file to remove; a younger one (a build in
    progress, e.g. another rank's) is waited for, with a log line every minute, until it goes or turns stale."""
    last_note = 0.0
    while True:
        locks = extension_build_locks()
        if not locks:
            return
        lock, age = max(locks, key=lambda item: item[1])
        if age >= stale_after_s:
            raise ValueError(f"{lock} is {age:.0f} s old: a torch/DeepSpeed extension build that was killed left this "
                             f"lock, and every start would wait on it forever. Remove it (rm {lock}) and start again "
                             f"(limit: BERT_DS_EXTENSION_LOCK_STALE_S={stale_after_s:.0f})")
        if time.monotonic() - last_note >= 60:
            log.warning("waiting for the extension build holding %s (%.0f s old; treated as stale after %.0f s)",
                        lock, age, stale_after_s)
            last_note = time.monotonic()
        time.sleep(poll_s)


def prebuild_extensions() -> list[str]:
    """Build ahead of time the JIT extensions a bert_ds run loads (``make venv`` calls this), so no training job
    compiles them on first start. On a CPU machine that is DeepSpeed's ``deepspeed_shm_comm`` (gloo's shared-memory
    fast path); on GPUs DeepSpeed builds nothing bert_ds needs (FusedAdam is built at its first use). Returns the
    names built."""
    built = []
    builder = shm_comm_builder()
    if builder is not None:
        wait_for_extension_builds()
        builder.load()
        built.append(builder.NAME)
    return built


NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "glusterfs", "fuse.glusterfs", "ceph",
    "fuse.ceph-fuse", "cephfs", "panfs", "wekafs", "fuse.sshfs", "9p", "afs", "orangefs", "pvfs2", "fuse.juicefs",
    "fuse.gcsfuse", "fuse.s3fs", "fuse.lustre", "quobyte", "fuse.quobyte", "virtiofs",
})
"""File-system types (the third field of /proc/mounts) shared between nodes: a compiler cache there is written by
ranks of several nodes at once."""


def _unescape_mount(field: str) -> str:
    """/proc/mounts writes a space in a mount point as ``\\040`` (and tab, newline, backslash likewise in octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_of(path: str | Path, mounts_text: str) -> tuple[str, str]:
    """(mount point, file-system type) holding ``path``, from the text of /proc/mounts: the longest mount point that
    is a prefix of the path's real location (the path need not exist yet; its nearest existing parent decides)."""
    target = Path(os.path.realpath(path))
    best = ("/", "unknown")
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point, fstype = _unescape_mount(fields[1]), fields[2]
        if (target == Path(point) or Path(point) in target.parents) and len(point) >= len(best[0]):
            best = (point, fstype)
    return best


def _default_cache_dirs(env: Mapping[str, str]) -> dict[str, str]:
    """Where Triton (3.x: ``$TRITON_CACHE_DIR``, else ``$TRITON_HOME/.triton/cache``, home by default) and torch's
    JIT extensions write, as they would resolve it under ``env``."""
    triton = env.get("TRITON_CACHE_DIR") or os.path.join(env.get("TRITON_HOME") or os.path.expanduser("~"),
                                                        ".triton", "cache")
    torch_ext = env.get("TORCH_EXTENSIONS_DIR") or str(extensions_root())
    return {"TRITON_CACHE_DIR": triton, "TORCH_EXTENSIONS_DIR": torch_ext}


def cache_dir_warnings(env: Mapping[str, str] | None = None, mounts_text: str | None = None) -> list[str]:
    """One warning per compiler cache that sits on a network file system (``NETWORK_FILESYSTEMS``): ranks on several
    nodes then compile into one cache at once, which raced in Triton's cache (triton#2688, #11512: corrupt kernels,
    once all-NaN output) and leaves torch's extension build locks behind. ``mounts_text``: /proc/mounts' text."""
    env = os.environ if env is None else env
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:  # not Linux: nothing to check against
            return []
    warnings = []
    for var, path in _default_cache_dirs(env).items():
        point, fstype = filesystem_of(path, mounts_text)
        if fstype in NETWORK_FILESYSTEMS:
            source = "" if env.get(var) else " (the default)"
            warnings.append(f"{var}={path}{source} is on a network file system ({fstype} mounted at {point}): ranks "
                            f"of several nodes compiling into one cache race (triton#2688); export {var} as a "
                            f"node-local directory, e.g. ${{TMPDIR:-/tmp}}/bert_ds-$SLURM_JOB_ID/"
                            f"{'triton' if var == 'TRITON_CACHE_DIR' else 'torch_extensions'}")
    return warnings


NODE_LOCAL_CACHE_VARS = {"TRITON_CACHE_DIR": "triton", "TORCH_EXTENSIONS_DIR": "torch_extensions"}
"""Compiler caches a job's ranks write at start-up, and their folder name under the job's node-local directory."""


def node_local_caches(env: Mapping[str, str]) -> dict[str, str]:
    """Inside a Slurm job, the cache variables to set: each of ``NODE_LOCAL_CACHE_VARS`` the user left unset goes to
    ``${TMPDIR:-/tmp}/bert_ds-$SLURM_JOB_ID/<name>`` (``slurm/pretrain_common.sh`` uses the same rule). The defaults
    sit in the home directory, which on a cluster is usually NFS or Lustre, where ranks of several nodes compiling the
    same Triton kernel race on one cache entry (triton#2688, #11512; fixed for some cases by PR#11319) and torch's
    extension build lock can be left behind. Node-local per job: ranks of one node share a local file system, whose
    renames are atomic. Outside Slurm nothing is set (pre-flight warns when a cache sits on a network file system)."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return {}
    root = f"{env.get('TMPDIR') or '/tmp'}/bert_ds-{job}"
    return {var: f"{root}/{name}" for var, name in NODE_LOCAL_CACHE_VARS.items() if not env.get(var)}


def use_node_local_caches(env: MutableMapping[str, str]) -> dict[str, str]:
    """Point the Triton and torch-extension caches at node-local storage inside a Slurm job, unless the user set them
    (:func:`node_local_caches`); returns what was set. Called before anything compiles."""
    chosen = node_local_caches(env)
    env.update(chosen)
    for var, path in chosen.items():
        log.info("%s=%s (node-local for this Slurm job; export %s to choose another)", var, path, var)
    return chosen
