# Body shared by slurm/pretrain_base.sh and slurm/pretrain_large.sh (sourced by them, never submitted): checks that
# the allocation has one task per rank, starts the ranks with srun, passes the pre-emption signal on and requeues.
# The caller sets RECIPE and RUN_DIR; every size comes from the allocation (sbatch --nodes, --ntasks-per-node,
# --gpus-per-node), never from this file.
set -uo pipefail

DATA128=${DATA128:-data/shards128}
DATA512=${DATA512:-data/shards512}
TOKENIZER=${TOKENIZER:-data/tokenizer}
PYTHON=${PYTHON:-python}
PHASE=${PHASE:-all}
EXTRA_ARGS=${EXTRA_ARGS:-}

if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "bert_ds: submit this with sbatch (it reads its sizes from the Slurm allocation)" >&2
  exit 2
fi
# SLURM_TASKS_PER_NODE reads "8(x4)" or "8,8,7": the first node's count is the one checked against its GPUs.
tasks_per_node=${SLURM_TASKS_PER_NODE%%[(,]*}
gpus_per_node=${SLURM_GPUS_ON_NODE:-0}
if [ "$gpus_per_node" -gt 0 ] && [ "$tasks_per_node" -ne "$gpus_per_node" ]; then
  echo "bert_ds: the job has $gpus_per_node GPU(s) but $tasks_per_node task(s) on its first node; srun starts" \
       "one rank per task, so ask for one task per GPU: sbatch --ntasks-per-node=$gpus_per_node ..." >&2
  exit 2
fi
echo "bert_ds: $SLURM_JOB_NUM_NODES node(s) x $tasks_per_node task(s) = $SLURM_NTASKS rank(s)," \
     "$gpus_per_node GPU(s) per node; recipe $RECIPE -> $RUN_DIR"

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
# The same rule as bert_ds.runtime.launch.slurm_master_port: every task of the job agrees on it without talking.
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

# `--signal=B:USR1@300` delivers USR1 to this batch shell 5 minutes before the time limit: pass it on to the
# ranks, which checkpoint at the next step boundary and exit with 75.
srun_pid=
forward() { [ -n "$srun_pid" ] && kill -USR1 "$srun_pid" 2>/dev/null; }
trap forward USR1 TERM

# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
srun --kill-on-bad-exit=1 "$PYTHON" -m bert_ds.runtime.pretrain --recipe "$RECIPE" --data "$DATA128" "$DATA512" \
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
