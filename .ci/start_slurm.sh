#!/usr/bin/env bash
# Starts a one-node Slurm cluster on this machine (as root) so the tests can `sbatch --wait` real jobs.
# Needs Debian's slurm-wlm and munge. Idempotent: does nothing if the controller already answers.
set -euo pipefail
if sinfo -h >/dev/null 2>&1 && [ "$(sinfo -h -o %T | head -n1)" = "idle" ]; then exit 0; fi
host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))
conf_dir=/etc/slurm
mkdir -p "$conf_dir" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /etc/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || su -s /bin/sh munge -c /usr/sbin/munged
cat > "$conf_dir/slurm.conf" <<CONF
ClusterName=bert_ds_ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again only after the job credential expires (slurm.conf(5), cred_expire, default
# 120 s): the requeue tests idled 2 minutes each on it. 30 s still covers a step launch on a loaded machine.
AuthInfo=cred_expire=30
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
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 1 30); do
  if [ "$(sinfo -h -o %T 2>/dev/null | head -n1)" = "idle" ]; then sinfo; exit 0; fi
  sleep 1
done
echo "slurm did not come up; see /var/log/slurm/*.log" >&2
sinfo >&2 || true
exit 1
