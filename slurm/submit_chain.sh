#!/usr/bin/env bash
# Requeue without scontrol: submit a training script and follow-up jobs that each start only if the job before ended
# badly (`--dependency=afternotok`: a non-zero exit such as the pre-emption exit 75 or a stalled rank's 124, a
# time-out, a node failure) and resume from the newest checkpoint. For clusters where the job cannot requeue itself,
# e.g. inside pyxis/enroot containers, which have no `scontrol` (pyxis#129). Run it where sbatch works (a login node):
#
#   FOLLOWUPS=5 slurm/submit_chain.sh --nodes=8 --ntasks-per-node=8 --gpus-per-node=8 slurm/pretrain_large.sh
#
# The last argument is the script; every other argument goes to each sbatch. FOLLOWUPS [3] follow-ups are queued;
# once a job succeeds, Slurm removes the ones left (`--kill-on-invalid-dep=yes`). A follow-up whose predecessor failed
# in a way a restart would repeat (its exit code, written to $RUN_DIR/slurm/exit-<job id>, is 2: bad input, or 3:
# non-finite loss) exits with that code at once instead of training, and so do the ones after it. Prints the job ids,
# first to last.
set -euo pipefail

FOLLOWUPS=${FOLLOWUPS:-3}
if [ "$#" -lt 1 ]; then
  echo "usage: [FOLLOWUPS=N] $0 [sbatch options...] SCRIPT" >&2
  exit 2
fi
if ! [[ "$FOLLOWUPS" =~ ^[0-9]+$ ]]; then
  echo "bert_ds: FOLLOWUPS=$FOLLOWUPS is not a number of jobs" >&2
  exit 2
fi
# REQUEUE=none: a pre-empted (75) or stalled (124) job exits and leaves its restart to the next job of the chain.
job=$(REQUEUE=none sbatch --parsable "$@")
job=${job%%;*}  # --parsable prints "id" or "id;cluster"
echo "$job"
for _ in $(seq 1 "$FOLLOWUPS"); do
  next=$(REQUEUE=none BERT_DS_AFTER_JOB=$job sbatch --parsable --dependency="afternotok:$job" \
         --kill-on-invalid-dep=yes "$@")
  job=${next%%;*}
  echo "$job"
done
