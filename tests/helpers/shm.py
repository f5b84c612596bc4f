"""Which /dev/shm files live processes map (``/proc/PID/maps``): a DeepSpeed all-reduce buffer that a rank maps
belongs to a run still going and must not be unlinked by a clean-up."""

from __future__ import annotations

from pathlib import Path

__all__ = ["mapped_shm_paths"]


def mapped_shm_paths(proc: Path = Path("/proc")) -> set[str]:
    """Every ``/dev/shm/...`` path some process on this machine maps (processes whose maps cannot be read, gone or
    another user's, are skipped)."""
    paths: set[str] = set()
    for maps in proc.glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            at = line.find("/dev/shm/")
            if at >= 0:
                paths.add(line[at:].removesuffix(" (deleted)"))
    return paths
