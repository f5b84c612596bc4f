"""DeepSpeed hostfiles from a Slurm allocation or a host list (``tools/make_hostfile.py``), and the Slurm facts the
launch paths share (the allocation's host names, the job's default rendezvous port).

A DeepSpeed hostfile has one ``<host> slots=<N>`` line per node (``deepspeed/launcher/runner.py``, 0.19:
``_parse_hostfile``); ``deepspeed --hostfile H`` reaches every host but the first through pdsh + passwordless ssh, while
``deepspeed --hostfile H --no_ssh --node_rank I`` is started on each node by the user (or ``srun``) and only counts
ranks from it: host names are then labels, never resolved, and ``--master_addr`` names node 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, option
from bert_ds.errors import BadInput

__all__ = ["format_hostfile", "hosts_from_list", "hosts_from_slurm", "main", "parse_tasks_per_node", "slurm_hostnames",
           "slurm_master_port", "write_hostfile"]

Host = tuple[str, int]
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def slurm_hostnames(nodelist: str) -> list[str]:
    """The host names of a Slurm node list (``node[01-03],gpu7``), expanded by ``scontrol show hostnames``: Slurm's
    own rule, so bracket ranges, zero padding and site-specific names all come out as Slurm means them."""
    try:
        proc = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise BadInput(f"expanding the Slurm node list {nodelist!r} needs `scontrol` on PATH (run inside the job, "
                       f"or pass --hosts)") from exc
    hosts = proc.stdout.split()
    if proc.returncode != 0 or not hosts:
        raise BadInput(f"`scontrol show hostnames {nodelist}` exited {proc.returncode} with no host names: "
                       f"{proc.stderr.strip()}")
    return hosts


def slurm_master_port(env: Mapping[str, str]) -> int:
    """A rendezvous port every task of one job agrees on and concurrent jobs on a node rarely share: 20000 +
    ``SLURM_JOB_ID`` mod 9000 (``slurm/pretrain_common.sh`` uses the same rule). 20000-28999 stays below Linux's
    ephemeral range (32768-60999, where outgoing connections, NCCL's and gloo's included, get their ports) and short of
    29400/29500, torchrun's and DeepSpeed's default rendezvous ports."""
    return 20000 + int(env.get("SLURM_JOB_ID", "0")) % 9000


def parse_tasks_per_node(value: str) -> list[int]:
    """Slurm's compressed per-node task counts, e.g. ``SLURM_TASKS_PER_NODE=2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if match is None:
            raise BadInput(f"SLURM_TASKS_PER_NODE={value!r}: {item!r} is not N or N(xR)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _slurm_slots(env: Mapping[str, str], nodes: int) -> list[int]:
    """Slots per node: GPUs on the node first (the deepspeed launcher starts one rank per GPU, however many Slurm tasks
    run it), else the job's tasks per node (CPU jobs: one rank per task)."""
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if gpus.isdigit() and int(gpus) > 0:
        return [int(gpus)] * nodes
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    if per_node.isdigit() and int(per_node) > 0:
        return [int(per_node)] * nodes
    if env.get("SLURM_TASKS_PER_NODE"):
        counts = parse_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        if len(counts) != nodes:
            raise BadInput(f"SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']!r} gives {len(counts)} node(s), "
                           f"SLURM_JOB_NODELIST {nodes}")
        return counts
    raise BadInput("no slot count in the Slurm environment (SLURM_GPUS_ON_NODE, SLURM_NTASKS_PER_NODE, "
                   "SLURM_TASKS_PER_NODE): pass --slots N")


def hosts_from_slurm(env: Mapping[str, str] | None = None, slots: int | None = None,
                     expand: Callable[[str], list[str]] = slurm_hostnames) -> list[Host]:
    """(host, slots) for every node of the current Slurm job; ``slots`` overrides what the allocation says."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise BadInput("SLURM_JOB_NODELIST is not set: run inside a Slurm job (sbatch/salloc), or pass --hosts")
    names = expand(nodelist)
    counts = [slots] * len(names) if slots is not None else _slurm_slots(env, len(names))
    return _checked(list(zip(names, counts, strict=True)), where="SLURM_JOB_NODELIST")


def hosts_from_list(spec: str, slots: int | None = None) -> list[Host]:
    """(host, slots) from ``"a:8,b:8"`` or ``"a b"`` (commas or blanks); a host without ``:N`` gets ``slots``."""
    hosts = []
    for item in spec.replace(",", " ").split():
        name, sep, count = item.partition(":")
        if sep and not count.isdigit():
            raise BadInput(f"--hosts: {item!r} is not HOST or HOST:SLOTS")
        if not sep and slots is None:
            raise BadInput(f"--hosts: {item!r} has no :SLOTS and no --slots was given")
        hosts.append((name, int(count) if sep else slots))
    return _checked(hosts, where="--hosts")


def _checked(hosts: list[Host], where: str) -> list[Host]:
    if not hosts:
        raise BadInput(f"{where}: no hosts")
    seen = set()
    for name, count in hosts:
        if not _HOST_NAME.match(name):
            raise BadInput(f"{where}: {name!r} is not a host name")
        if name in seen:  # DeepSpeed refuses a hostfile naming a host twice
            raise BadInput(f"{where}: host {name!r} appears twice")
        if count < 1:
            raise BadInput(f"{where}: host {name!r} has {count} slots; it needs at least 1")
        seen.add(name)
    return hosts


def format_hostfile(hosts: Sequence[Host]) -> str:
    """DeepSpeed's hostfile text: ``<host> slots=<N>`` per line, in node-rank order."""
    return "".join(f"{name} slots={count}\n" for name, count in _checked(list(hosts), where="hosts"))


def write_hostfile(path: str | Path, hosts: Sequence[Host]) -> Path:
    path = Path(path)
    path.write_text(format_hostfile(hosts))
    return path


@dataclasses.dataclass(frozen=True)
class HostfileArgs:
    """``bert-ds-make-hostfile``: where the hosts come from and where the hostfile goes."""

    slurm: bool = False
    """the nodes of the current Slurm job (SLURM_JOB_NODELIST, expanded by scontrol); slots from SLURM_GPUS_ON_NODE,
    else SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE"""
    hosts: str | None = option(None, metavar="LIST")
    """hosts in node-rank order: 'a:8,b:8' or 'a b' with --slots"""
    slots: int | None = None
    """ranks per host (overrides the allocation)"""
    output: str = option("-", flags=("--output", "-o"), help="hostfile to write ('-', the default: standard output)")

    def __post_init__(self) -> None:
        if self.slurm == (self.hosts is not None):
            raise BadInput("give exactly one of --slurm and --hosts")


def cli_parser() -> argparse.ArgumentParser:
    return build_parser(HostfileArgs, "bert-ds-make-hostfile", __doc__.split("\n\n")[0])


main = alias("make-hostfile")


def _run(args: HostfileArgs) -> int:
    hosts = hosts_from_slurm(slots=args.slots) if args.slurm else hosts_from_list(args.hosts, args.slots)
    if args.output == "-":
        sys.stdout.write(format_hostfile(hosts))
    else:
        write_hostfile(args.output, hosts)
    ranks = sum(count for _, count in hosts)
    print(f"{len(hosts)} node(s), {ranks} rank(s); node 0 (--master_addr): {hosts[0][0]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
