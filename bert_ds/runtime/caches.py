"""The compiler caches a run writes, in one owner: Triton's kernel cache and torch's JIT-extension build directory
(where DeepSpeed compiles its CPU ``deepspeed_shm_comm`` op).

* where they are (:func:`extensions_root`: one build directory per environment, :func:`build_identity`, built with
  the interpreter's own ninja, :func:`build_tools_path`; Triton's rule in :func:`cache_dir_warnings`), node-local per
  Slurm job unless the user chose (:func:`node_local_caches`, :func:`use_node_local_caches`;
  ``slurm/pretrain_common.sh`` uses the same rule);
* a warning when one sits on a network file system (:func:`cache_dir_warnings`, pre-flight);
* builds under a lock that dies with its holder (:func:`holding_build_lock`): torch's own lock left by a killed
  build is removed by the next start, which rebuilds; ``make venv`` builds ahead of time what every start loads
  (:func:`load_extensions`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path

import torch

from bert_ds.deepspeed_internals import shm_comm_builder

__all__ = ["BRIEF_LOCK_S", "HOLDER_LOCK_NAME", "NETWORK_FILESYSTEMS", "NODE_LOCAL_CACHE_VARS", "build_identity",
           "build_tools_path", "cache_dir_warnings", "extension_build_locks", "extensions_root", "filesystem_of",
           "holding_build_lock", "load_extensions", "node_local_caches", "node_local_root", "pin_build_environment",
           "use_node_local_caches", "WAIT_NOTE_AFTER_S"]

log = logging.getLogger(__name__)

HOLDER_LOCK_NAME = ".bert_ds-build.flock"
"""In the extension build directory: the lock every bert_ds process holds while it builds or loads an extension
(:func:`holding_build_lock`). An OS file lock (``flock``): the kernel drops it when its holder dies, unlike torch's own
``<extension>/lock`` file (``FileBaton``), which a killed build leaves behind for every later start to wait on."""

WAIT_NOTE_AFTER_S = 3.0
"""A start waiting this long for another process's extension build says so (a load of the built extension takes well
under a second; a build takes minutes)."""
BRIEF_LOCK_S = 10.0
"""torch takes its lock for every load, also of an up-to-date extension (``_jit_compile``), for well under a second; a
lock younger than this may be such a load by a program that does not take :data:`HOLDER_LOCK_NAME` (DeepSpeed started
by another tool): it is waited on until it goes or grows older, and only then removed."""


def _torch_default_root() -> Path:
    """torch's own choice (``torch.utils.cpp_extension._get_build_directory``, torch 2.x) without
    ``$TORCH_EXTENSIONS_DIR``: the user cache's ``torch_extensions/py<ver>_<cpu|cu<ver>|rocm<ver>>``."""
    import torch.utils.cpp_extension as cpp

    if torch.version.hip is not None:
        accel = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accel = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accel = "cpu"
    return Path(cpp.get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{accel}"


def build_tools_path(path: str | None = None) -> str:
    """``PATH`` with this interpreter's own bin directory first (a venv's ``ninja`` then builds, activated or not):
    torch runs ``ninja`` from ``PATH``, and a venv's ninja 1.13 and a system's 1.11 read each other's build log as
    invalid and rebuild everything."""
    path = os.environ.get("PATH", "") if path is None else path
    own = str(Path(sys.executable).parent)
    return os.pathsep.join([own, *(p for p in path.split(os.pathsep) if p and p != own)])


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, PATH=build_tools_path()))
    except (OSError, subprocess.SubprocessError):
        return "absent"
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else "absent"


@functools.lru_cache(maxsize=1)
def build_identity() -> tuple[tuple[str, str], ...]:
    """What a compiled extension depends on besides its sources and flags (which torch itself hashes): the
    interpreter (prefix and version), torch, DeepSpeed, ninja and the C++ compiler, as :func:`build_tools_path`
    finds them."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        deepspeed = version("deepspeed")
    except PackageNotFoundError:
        deepspeed = "absent"
    return (("python", f"{sys.version.split()[0]} {os.path.realpath(sys.prefix)}"), ("torch", torch.__version__),
            ("deepspeed", deepspeed), ("ninja", _first_line(["ninja", "--version"])),
            ("c++", _first_line([os.environ.get("CXX") or "c++", "--version"])))


def extensions_root() -> Path:
    """Where bert_ds builds JIT extensions: ``$TORCH_EXTENSIONS_DIR`` when the user set it, else one directory per
    environment (:func:`build_identity`) beside torch's default, ``py<ver>_<accel>-<digest>``: two venvs (two
    checkouts, a test clone) or an upgraded torch or DeepSpeed never rebuild over each other's build."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    digest = hashlib.sha256(repr(build_identity()).encode()).hexdigest()[:12]
    default = _torch_default_root()
    return default.with_name(f"{default.name}-{digest}")


def pin_build_environment() -> Path:
    """Make every build of this process use :func:`extensions_root` (exported as ``TORCH_EXTENSIONS_DIR``, which
    torch and DeepSpeed read) and this interpreter's tools (:func:`build_tools_path`); returns the directory."""
    root = extensions_root()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
    os.environ["PATH"] = build_tools_path()
    return root


def extension_build_locks() -> list[Path]:
    """torch's build locks (``<extension>/lock``) present in the extension build directory."""
    root = extensions_root()
    return sorted(root.glob("*/lock")) if root.is_dir() else []


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "an unnamed process"
    except OSError:
        return "an unnamed process"


def _remove_orphaned_locks(holder: Path, poll_s: float) -> None:
    """With the holder lock held: torch's locks still present after :data:`BRIEF_LOCK_S` were left by a builder that
    died; remove each, saying so."""
    for lock in extension_build_locks():
        while True:
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                break  # a brief load by another program ended
            if age >= BRIEF_LOCK_S:
                log.warning("removing %s: left by an extension build that was killed (no bert_ds process holds %s)",
                            lock, holder)
                lock.unlink(missing_ok=True)
                break
            time.sleep(poll_s)


@contextlib.contextmanager
def holding_build_lock(poll_s: float = 0.05) -> Iterator[None]:
    """Hold :data:`HOLDER_LOCK_NAME` (waiting for a live holder, with a log line naming it once the wait passes
    :data:`WAIT_NOTE_AFTER_S` and every minute after: the other ranks of a node wait here on every start while the
    first loads the built extension, a fraction of a second not worth a line), then remove
    torch's build locks left in the directory: every bert_ds process builds or loads extensions only while holding
    this lock, so a torch lock present now was left by a builder that died. A killed build thus costs the next start
    its rebuild time and no more. (A build by a program other than bert_ds in the same directory is not covered: give
    bert_ds its own ``TORCH_EXTENSIONS_DIR``.)"""
    root = extensions_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / HOLDER_LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = last_note = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if (last_note == start and now - start >= WAIT_NOTE_AFTER_S) or now - last_note >= 60:
                    log.warning("waiting for the extension build of %s (holding %s)", _holder(path), path)
                    last_note = now
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        _remove_orphaned_locks(path, poll_s)
        yield
    finally:
        os.close(fd)  # releases the flock


def load_extensions() -> list[str]:
    """Build (first time) or load the JIT extensions a bert_ds run uses, holding :func:`holding_build_lock`. On a CPU
    machine that is DeepSpeed's ``deepspeed_shm_comm`` (gloo's shared-memory fast path); DeepSpeed then reuses the
    loaded module (its op builders keep loaded ops), so its own start-up takes no build lock. On GPUs DeepSpeed builds
    nothing bert_ds needs at start (FusedAdam is built at its first use). Returns the names loaded."""
    builder = shm_comm_builder()
    if builder is None:
        return []
    pin_build_environment()
    with holding_build_lock():
        builder.load()
    return [builder.NAME]


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
    root = node_local_root(env)
    if root is None:
        return {}
    return {var: f"{root}/{name}" for var, name in NODE_LOCAL_CACHE_VARS.items() if not env.get(var)}


def node_local_root(env: Mapping[str, str]) -> str | None:
    """The Slurm job's node-local directory, ``${TMPDIR:-/tmp}/bert_ds-$SLURM_JOB_ID`` (None outside a job)."""
    job = env.get("SLURM_JOB_ID")
    return f"{env.get('TMPDIR') or '/tmp'}/bert_ds-{job}" if job else None


def use_node_local_caches(env: MutableMapping[str, str]) -> dict[str, str]:
    """Point the Triton and torch-extension caches at node-local storage inside a Slurm job, unless the user set them
    (:func:`node_local_caches`); returns what was set. Called before anything compiles."""
    chosen = node_local_caches(env)
    env.update(chosen)
    for var, path in chosen.items():
        log.info("%s=%s (node-local for this Slurm job; export %s to choose another)", var, path, var)
    return chosen
