#!/usr/bin/env bash
# BERT-large pre-training (both phases) on a Slurm cluster: one task per GPU, started by srun, so Slurm's signals
# reach every rank and a pre-empted job checkpoints, exits 75 and requeues itself.
#
#   sbatch slurm/pretrain_large.sh
#   RUN_DIR=runs/large2 sbatch --nodes 16 slurm/pretrain_large.sh    # sbatch flags override the #SBATCH lines
#
# Settings come from the environment (defaults in brackets): RECIPE [ds_configs/bert_large.json], DATA128
# [data/shards128], DATA512 [data/shards512], TOKENIZER [data/tokenizer], RUN_DIR [runs/bert_large], PYTHON [python],
# PHASE [all], EXTRA_ARGS [] (e.g. "--eval-data data/eval512 --max-steps 100").
#SBATCH --job-name=bert_ds-large
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=10
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -uo pipefail

RECIPE=${RECIPE:-ds_configs/bert_large.json}
DATA128=${DATA128:-data/shards128}
DATA512=${DATA512:-data/shards512}
TOKENIZER=${TOKENIZER:-data/tokenizer}
RUN_DIR=${RUN_DIR:-runs/bert_large}
PYTHON=${PYTHON:-python}
PHASE=${PHASE:-all}
EXTRA_ARGS=${EXTRA_ARGS:-}

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

# `--signal=B:USR1@300` delivers USR1 to this batch shell 5 minutes before the time limit: pass it on to the
# ranks, which checkpoint at the next step boundary and exit with 75.
srun_pid=
forward() { [ -n "$srun_pid" ] && kill -USR1 "$srun_pid" 2>/dev/null; }
trap forward USR1 TERM

# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
srun --kill-on-bad-exit=1 "$PYTHON" -m bert_ds.pretrain --recipe "$RECIPE" --data "$DATA128" "$DATA512" \
    --tokenizer "$TOKENIZER" --output "$RUN_DIR" --phase "$PHASE" --resume auto $EXTRA_ARGS &
srun_pid=$!
# `wait` returns early when a trapped signal arrives; wait again until srun itself has finished.
while true; do
  wait "$srun_pid"; rc=$?
  kill -0 "$srun_pid" 2>/dev/null || break
done
if [ "$rc" -eq 75 ]; then
  echo "pre-empted: checkpoint written; requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
