"""Compiler caches on a cluster: inside a Slurm job the Triton and torch-extension caches go to node-local storage per
job unless the user chose them, and pre-flight warns when a cache sits on a network file system (a fake
/proc/mounts table stands in for a cluster's)."""

from __future__ import annotations

import logging

import pytest

from bert_ds.runtime.caches import cache_dir_warnings, filesystem_of, node_local_caches, use_node_local_caches

MOUNTS = """\
/dev/nvme0n1p2 / ext4 rw,relatime 0 0
tmpfs /tmp tmpfs rw,nosuid,nodev 0 0
nfs01:/export/home /home nfs4 rw,relatime,vers=4.2 0 0
10.0.0.5@o2ib:/scratch /lus/scratch lustre rw,flock 0 0
fs1 /gpfs/proj gpfs rw,relatime 0 0
mgmt:/beegfs /mnt/beegfs beegfs rw 0 0
//nas/share /mnt/my\\040share cifs rw 0 0
/dev/nvme1n1 /home/local ext4 rw 0 0
"""


@pytest.mark.parametrize("path, expected", [
    ("/home/alice/.triton/cache", ("/home", "nfs4")),
    ("/home/local/cache", ("/home/local", "ext4")),  # a local disk mounted below an NFS home
    ("/homework/x", ("/", "ext4")),  # a prefix of the name is not a parent directory
    ("/lus/scratch/u/ext", ("/lus/scratch", "lustre")),
    ("/gpfs/proj", ("/gpfs/proj", "gpfs")),
    ("/mnt/beegfs/a/b", ("/mnt/beegfs", "beegfs")),
    ("/mnt/my share/triton", ("/mnt/my share", "cifs")),  # /proc/mounts escapes the space as \040
    ("/tmp/bert_ds-17/triton", ("/tmp", "tmpfs")),
])
def test_filesystem_of_takes_the_longest_mount_point(path, expected):
    assert filesystem_of(path, MOUNTS) == expected


def test_default_caches_on_nfs_home_are_warned_about():
    env = {"HOME": "/home/alice", "TRITON_HOME": "/home/alice", "TORCH_EXTENSIONS_DIR": "/lus/scratch/alice/ext"}
    warnings = cache_dir_warnings(env, MOUNTS)
    assert len(warnings) == 2
    assert warnings[0].startswith("TRITON_CACHE_DIR=/home/alice/.triton/cache (the default) is on a network file "
                                  "system (nfs4 mounted at /home)")
    assert "triton#2688" in warnings[0] and "${TMPDIR:-/tmp}/bert_ds-$SLURM_JOB_ID/triton" in warnings[0]
    assert warnings[1].startswith("TORCH_EXTENSIONS_DIR=/lus/scratch/alice/ext is on a network file system (lustre")


def test_node_local_caches_are_not_warned_about():
    env = {"TRITON_CACHE_DIR": "/tmp/bert_ds-17/triton", "TORCH_EXTENSIONS_DIR": "/home/local/ext"}
    assert cache_dir_warnings(env, MOUNTS) == []


def test_slurm_job_gets_node_local_caches_unless_the_user_set_them():
    assert node_local_caches({}) == {}  # outside Slurm nothing changes (pre-flight warns instead)
    job = {"SLURM_JOB_ID": "4242", "TMPDIR": "/local/scratch"}
    assert node_local_caches(job) == {"TRITON_CACHE_DIR": "/local/scratch/bert_ds-4242/triton",
                                      "TORCH_EXTENSIONS_DIR": "/local/scratch/bert_ds-4242/torch_extensions"}
    assert node_local_caches({"SLURM_JOB_ID": "7"}) == {"TRITON_CACHE_DIR": "/tmp/bert_ds-7/triton",
                                                        "TORCH_EXTENSIONS_DIR": "/tmp/bert_ds-7/torch_extensions"}
    chosen = {"SLURM_JOB_ID": "7", "TRITON_CACHE_DIR": "/home/alice/tc"}
    assert node_local_caches(chosen) == {"TORCH_EXTENSIONS_DIR": "/tmp/bert_ds-7/torch_extensions"}


def test_use_node_local_caches_sets_the_environment(caplog):
    env = {"SLURM_JOB_ID": "99", "TMPDIR": "/scratch/local", "TORCH_EXTENSIONS_DIR": "/opt/ext"}
    with caplog.at_level(logging.INFO, logger="bert_ds.runtime.caches"):
        assert use_node_local_caches(env) == {"TRITON_CACHE_DIR": "/scratch/local/bert_ds-99/triton"}
    assert env["TRITON_CACHE_DIR"] == "/scratch/local/bert_ds-99/triton" and env["TORCH_EXTENSIONS_DIR"] == "/opt/ext"
    assert "TRITON_CACHE_DIR=/scratch/local/bert_ds-99/triton (node-local" in caplog.text
