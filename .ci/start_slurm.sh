#!/usr/bin/env bash
# Starts a one-node Slurm cluster on this machine (as root) so the tests can `sbatch --wait` real jobs.
# Needs Debian's slurm-wlm and munge. Idempotent: a controller that already answers is left running, reconfigured
# only when this script's slurm.conf differs from the one it reads.
set -euo pipefail
host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))
conf_dir=/etc/slurm
conf=$(mktemp)
trap 'rm -f "$conf"' EXIT
mkdir -p "$conf_dir" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /etc/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || su -s /bin/sh munge -c /usr/sbin/munged
cat > "$conf" <<CONF
ClusterName=bert_ds_ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again only after the job credential expires (slurm.conf(5), cred_expire, default
# 120 s): the requeue tests idled 2 minutes each on it. 30 s still covers a step launch on a loaded machine.
AuthInfo=cred_expire=30
# \`sbatch --wait\` polls the job 2 s after submission, then waits 4 times longer each poll while the wait is under
# both 32 s and MinJobAge / 2 in whole seconds (Slurm's src/sbatch/sbatch.c, _job_wait): with the default MinJobAge
# (300 s) it polls at 2, 10, 42, 74 s, so a job of 11 s is seen done at 42 s. At 5 the wait stays 2 s (5 / 2 = 2), and
# a finished job's record is still kept at least 5 s (slurmctld purges old jobs once a minute), long enough for the
# tests' 1-s scontrol polls.
MinJobAge=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
MpiDefault=none
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
if sinfo -h >/dev/null 2>&1 && [ "$(sinfo -h -o %T | head -n1)" = "idle" ]; then
  cmp -s "$conf" "$conf_dir/slurm.conf" && exit 0
  cp "$conf" "$conf_dir/slurm.conf"
  scontrol reconfigure
  exit 0
fi
cp "$conf" "$conf_dir/slurm.conf"
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 1 30); do
  if [ "$(sinfo -h -o %T 2>/dev/null | head -n1)" = "idle" ]; then sinfo; exit 0; fi
  sleep 1
done
echo "slurm did not come up; see /var/log/slurm/*.log" >&2
sinfo >&2 || true
exit 1
