# Body shared by slurm/pretrain_base.sh and slurm/pretrain_large.sh (sourced by them, never submitted): checks that the
# allocation has one task per rank, starts the ranks with srun, passes the pre-emption signal on and requeues. The
# caller sets RECIPE and RUN_DIR; every size comes from the allocation (sbatch --nodes, --ntasks-per-node,
# --gpus-per-node), never from this file.
#
# Pre-emption: USR1 (`--signal=B:USR1@300`, to this shell) or TERM (what Slurm sends at the time limit or on pre-emption
# where no --signal is set, and what submitit-style clusters send alone) reaches every rank; the ranks checkpoint at the
# next step boundary and exit 75. The lead time (300 s) must cover the step in flight plus the save, whose duration
# every save logs ("checkpoint save took S s"); TERM alone leaves KillWait (30 s by default) for both: docs/cluster.md.
# In-allocation restarts come first: a step that ends with a code a restart from the newest checkpoint cures (1 a rank
# crashed, 124 a rank stalled, 128 + N a rank killed by signal N) is started again inside this allocation, at most
# MAX_RESTARTS times (the rule of bert-ds deepspeed --max-restarts, bert_ds/lifecycle/restart.py; each restart one line
# and one record in $RUN_DIR/restarts.jsonl). What is left then (75 pre-empted, 124 a rank still stalling) requeues the
# job with `scontrol requeue`, at most MAX_REQUEUES times (Slurm's SLURM_RESTART_COUNT counts them): each requeue brings
# a fresh --time, so without a cap a job could run for ever. Where scontrol does not exist (inside pyxis/enroot
# containers, pyxis#129) or the requeue fails, submit the job with slurm/submit_chain.sh instead: it queues follow-up
# jobs that start only when the previous one did not end well (`--dependency=afternotok`) and resume from the newest
# checkpoint. More settings (defaults in brackets): MAX_RESTARTS [3] (0: none), RESTART_BACKOFF [5] (seconds before the
# first restart, doubled for each further one, at most 60), MAX_REQUEUES [10], SCONTROL [scontrol] (the requeue command;
# a missing one is detected), REQUEUE [scontrol] (`none`: exit and leave the restart to follow-up jobs;
# slurm/submit_chain.sh sets it), TRITON_CACHE_DIR and TORCH_EXTENSIONS_DIR
# [${TMPDIR:-/tmp}/bert_ds-$SLURM_JOB_ID/{triton,torch_extensions}: node-local, per job; that directory is removed when
# the job ends for good, kept when it requeues itself].
set -uo pipefail

DATA128=${DATA128:-data/shards128}
DATA512=${DATA512:-data/shards512}
TOKENIZER=${TOKENIZER:-data/tokenizer}
PYTHON=${PYTHON:-python}
PHASE=${PHASE:-all}
EXTRA_ARGS=${EXTRA_ARGS:-}
SCONTROL=${SCONTROL:-scontrol}
REQUEUE=${REQUEUE:-scontrol}
MAX_REQUEUES=${MAX_REQUEUES:-10}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RESTART_BACKOFF=${RESTART_BACKOFF:-5}
# The exit codes a restart can cure (bert_ds/exit_codes.py; tests/test_exit_codes.py checks them against it):
EXIT_PREEMPTED=75  # ExitCode.PREEMPTED: checkpointed after USR1/TERM
EXIT_STALLED=124   # ExitCode.STALLED: a rank made no progress for --step-timeout seconds; the newest checkpoint stands
RETRYABLE_EXITS="$EXIT_PREEMPTED $EXIT_STALLED"
# The step codes restarted inside the allocation (bert_ds.lifecycle.restart.retryable): never 2, 3, 74 or 75.
EXIT_FAILED=1      # ExitCode.FAILED: a rank crashed (a loader worker died, a collective failed: a peer vanished)
restartable() {  # 128 + N: a rank killed by signal N (bert_ds/exit_codes.py)
  [ "$1" -eq "$EXIT_FAILED" ] || [ "$1" -eq "$EXIT_STALLED" ] || { [ "$1" -gt 128 ] && [ "$1" -le 192 ]; }
}

if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "bert_ds: submit this with sbatch (it reads its sizes from the Slurm allocation)" >&2
  exit 2
fi
if ! [[ "$MAX_REQUEUES" =~ ^[0-9]+$ ]]; then
  echo "bert_ds: MAX_REQUEUES=$MAX_REQUEUES is not a number of requeues" >&2
  exit 2
fi
if ! [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || ! [[ "$RESTART_BACKOFF" =~ ^[0-9]+$ ]]; then
  echo "bert_ds: MAX_RESTARTS=$MAX_RESTARTS / RESTART_BACKOFF=$RESTART_BACKOFF: give a number of restarts and" \
       "whole seconds" >&2
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
     "$gpus_per_node GPU(s) per node; recipe $RECIPE -> $RUN_DIR (job $SLURM_JOB_ID," \
     "restart ${SLURM_RESTART_COUNT:-0}); restarts the ranks on exit $EXIT_FAILED, $EXIT_STALLED or 128 + N at most" \
     "MAX_RESTARTS=$MAX_RESTARTS time(s) in this allocation; requeues itself on exit $EXIT_PREEMPTED or" \
     "$EXIT_STALLED at most MAX_REQUEUES=$MAX_REQUEUES time(s)"

# A follow-up job of slurm/submit_chain.sh resumes after a pre-emption (75), a stalled rank (124), a killed job (137,
# 143: e.g. Slurm's time limit without --signal) or a job that could not write its exit code, never after a failure
# that would only repeat: bad input (2) or non-finite loss (3) stop the chain with the same code.
if [ -n "${BERT_DS_AFTER_JOB:-}" ]; then
  prev_rc=$(cat "$RUN_DIR/slurm/exit-$BERT_DS_AFTER_JOB" 2>/dev/null || echo none)
  if [ "$prev_rc" = 2 ] || [ "$prev_rc" = 3 ]; then
    echo "bert_ds: job $BERT_DS_AFTER_JOB ended with exit $prev_rc, which a restart would repeat; follow-up job" \
         "$SLURM_JOB_ID does not resume" >&2
    mkdir -p "$RUN_DIR/slurm" && echo "$prev_rc" > "$RUN_DIR/slurm/exit-$SLURM_JOB_ID"
    exit "$prev_rc"
  fi
  echo "bert_ds: follow-up of job $BERT_DS_AFTER_JOB (exit $prev_rc): resuming from the newest checkpoint"
fi

# Compiler caches on node-local storage, per job: the defaults sit in the home directory, on a cluster usually NFS
# or Lustre, where ranks of several nodes compiling the same Triton kernel race (triton#2688, #11512; PR#11319).
# bert_ds.runtime.caches.node_local_caches applies the same rule to ranks started without this script. A requeued job
# keeps its id and so its cache; the directory is removed when the job ends for good (remove_job_tmp, below).
job_tmp=${TMPDIR:-/tmp}/bert_ds-$SLURM_JOB_ID
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$job_tmp/triton}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$job_tmp/torch_extensions}
echo "bert_ds: TRITON_CACHE_DIR=$TRITON_CACHE_DIR TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR"

# The batch script runs on the allocation's first node: without scontrol (containers) that node is this host.
if command -v "$SCONTROL" >/dev/null 2>&1; then
  MASTER_ADDR=${MASTER_ADDR:-$("$SCONTROL" show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
else
  MASTER_ADDR=${MASTER_ADDR:-$(hostname)}
fi
export MASTER_ADDR
# What a pre-emption that sends TERM alone leaves the ranks (docs/cluster.md): SIGKILL follows KillWait seconds later.
if command -v "$SCONTROL" >/dev/null 2>&1; then
  kill_wait=$("$SCONTROL" show config 2>/dev/null | awk '$1 == "KillWait" {print $3}')
  echo "bert_ds: a pre-empted rank checkpoints after its current step; where Slurm sends TERM without --signal, it" \
       "kills the ranks ${kill_wait:-KillWait} s later (KillWait): the step and the save (each save logs its" \
       "duration) must fit in that"
fi
# The same rule as bert_ds.lifecycle.hostfile.slurm_master_port: every task of the job agrees on it without talking.
# 20000-28999: below Linux's ephemeral range (32768-60999, where the kernel picks the ports of outgoing connections,
# NCCL's and gloo's included), above the registered services of the 1024-19999 range, short of 29400/29500 (torchrun's
# and DeepSpeed's default rendezvous ports, which other processes on a shared node may hold).
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 9000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

# USR1 or TERM to this shell: pass USR1 on to srun, which signals every rank; a rank treats USR1 and TERM alike.
# (When Slurm itself sends TERM it also reaches the ranks directly; a second signal changes nothing.) The job is being
# stopped: no restart after that.
srun_pid=
stopping=false
forward() { stopping=true; [ -n "$srun_pid" ] && kill -USR1 "$srun_pid" 2>/dev/null; }
trap 'echo "bert_ds: USR1 received: asking the ranks to checkpoint" >&2; forward' USR1
trap 'echo "bert_ds: TERM received: asking the ranks to checkpoint" >&2; forward' TERM

# Not --kill-on-bad-exit: a pre-empted rank exits 75, a "bad" exit to srun, which would then TERM the ranks still
# finishing their own exit (rank 0 closes the logs last) and turn the job's 75 into 143. --wait=60 instead: once the
# first rank has ended, the others get 60 s to end too (a pre-emption or a finished run: seconds), then srun ends
# them, so a crashed rank does not leave the rest waiting in a collective for the process-group timeout.
# --cpus-per-task given again: since Slurm 22.05 srun no longer reads SLURM_CPUS_PER_TASK from sbatch, and a step then
# gets one CPU per task (the rank's loader workers and OMP threads squeezed onto it where the cluster binds tasks).
srun_cpus=${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK}
run_step() {
  # shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags; srun_cpus one flag or none
  srun --kill-on-bad-exit=0 --wait=60 $srun_cpus "$PYTHON" -m bert_ds.runtime.pretrain --recipe "$RECIPE" \
      --data "$DATA128" "$DATA512" --tokenizer "$TOKENIZER" --output "$RUN_DIR" --phase "$PHASE" --resume auto \
      $EXTRA_ARGS &
  srun_pid=$!
  # `wait` returns early when a trapped signal arrives; wait again until srun itself has finished.
  while true; do
    wait "$srun_pid"; rc=$?
    kill -0 "$srun_pid" 2>/dev/null || break
  done
  srun_pid=
}

# Between two steps, on this (rank 0's) node: Slurm has ended every task of the failed step; bert_ds.lifecycle.restart
# waits for MASTER_PORT to be free, removes the step's DeepSpeed shared-memory buffers, logs the restart and says how
# long to wait still (the backoff). Should Python fail here, the backoff alone.
between_steps() {
  local wait_s
  local program='import sys; from bert_ds.lifecycle.restart import step_restart; step_restart(sys.argv[1:])'
  if ! wait_s=$("$PYTHON" -c "$program" \
      "$RUN_DIR" "$MASTER_PORT" "$attempt" "$MAX_RESTARTS" "$rc" "$started" "$RESTART_BACKOFF" "$SLURM_JOB_ID"); then
    wait_s=$(( RESTART_BACKOFF << (attempt - 1) )); [ "$wait_s" -gt 60 ] && wait_s=60
    echo "bert_ds: restart $attempt of $MAX_RESTARTS: the step exited $rc; resuming from the newest checkpoint in" \
         "$wait_s s" >&2
  fi
  sleep "$wait_s" &  # waited for with `wait`, so that a signal meanwhile is trapped at once
  wait $! || kill $! 2>/dev/null
}

attempt=1
attempts_said=
while true; do
  started=$(date +%s)
  run_step
  attempts_said+="attempt $attempt: exit $rc after $(( $(date +%s) - started )) s; "
  if $stopping || ! restartable "$rc" || [ "$attempt" -gt "$MAX_RESTARTS" ]; then break; fi
  between_steps
  if $stopping; then break; fi
  attempt=$((attempt + 1))
done
if [ "$attempt" -gt 1 ]; then
  echo "bert_ds: $attempt attempt(s) in this allocation (MAX_RESTARTS=$MAX_RESTARTS): ${attempts_said}exit $rc" >&2
fi
mkdir -p "$RUN_DIR/slurm" && echo "$rc" > "$RUN_DIR/slurm/exit-$SLURM_JOB_ID"

# The job's node-local directory goes when the job ends for good; a requeued job keeps its id and reuses it. On
# every node of the job (one task each), then here. A job killed outright (scancel, SIGKILL after KillWait, a node
# failure) never gets here: docs/cluster.md gives an Epilog line for that.
remove_job_tmp() {
  if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then
    srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=0 \
        rm -rf -- "$job_tmp" || true
  fi
  rm -rf -- "$job_tmp"
  echo "bert_ds: job $SLURM_JOB_ID ends for good: removed its node-local caches ($job_tmp)" >&2
}

requeued=false
if [[ " $RETRYABLE_EXITS " == *" $rc "* ]]; then
  if [ "$rc" -eq "$EXIT_PREEMPTED" ]; then
    what="pre-empted: checkpoint written"
  else
    what="stalled (exit $rc): the newest checkpoint stands"
  fi
  restarts=${SLURM_RESTART_COUNT:-0}
  if [ "$REQUEUE" != scontrol ]; then
    echo "$what; exit $rc for a follow-up job (REQUEUE=$REQUEUE)" >&2
  elif [ "$restarts" -ge "$MAX_REQUEUES" ]; then
    echo "bert_ds: requeue cap reached: job $SLURM_JOB_ID was requeued $restarts time(s), MAX_REQUEUES=$MAX_REQUEUES;" \
         "not requeued again, exit $rc. Resubmit it (--resume auto continues) or raise MAX_REQUEUES" >&2
  elif command -v "$SCONTROL" >/dev/null 2>&1 && "$SCONTROL" requeue "$SLURM_JOB_ID"; then
    requeued=true
    echo "$what; job $SLURM_JOB_ID requeued (requeue $((restarts + 1)) of at most MAX_REQUEUES=$MAX_REQUEUES)" >&2
  else
    echo "$what; requeue with '$SCONTROL' impossible here (missing or refused): a follow-up job of" \
         "slurm/submit_chain.sh resumes the run, or resubmit with --resume auto yourself" >&2
  fi
fi
$requeued || remove_job_tmp
exit "$rc"
