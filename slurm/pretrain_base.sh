#!/usr/bin/env bash
# BERT-base pre-training (both phases) on a Slurm cluster: one task per GPU, started by srun, so Slurm's signals
# reach every rank and a pre-empted job checkpoints, exits 75 and requeues itself. The sizes are the allocation's:
#
#   sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=10 slurm/pretrain_base.sh
#   RUN_DIR=runs/base_2 sbatch --nodes=16 --ntasks-per-node=8 --gpus-per-node=8 slurm/pretrain_base.sh
#
# World size = nodes x tasks per node; each phase's global batch must be a multiple of world size x micro batch
# (the recipe's), and gradient accumulation = global batch / (world size x micro batch).
# Submit from the bert_ds checkout (or pass --chdir). Settings come from the environment (defaults in brackets):
# RECIPE [ds_configs/bert_base.json], DATA128 [data/shards128], DATA512 [data/shards512], TOKENIZER [data/tokenizer],
# RUN_DIR [runs/bert_base], PYTHON [python], PHASE [all], MASTER_PORT [20000 + job id mod 9000],
# OMP_NUM_THREADS [--cpus-per-task], EXTRA_ARGS [] (e.g. "--eval-data data/eval512 --max-steps 100").
# MAX_RESTARTS [3], RESTART_BACKOFF [5], MAX_REQUEUES [10]. Restarts in the allocation, pre-emption and requeues
# (USR1 or TERM; scontrol requeue, at most MAX_REQUEUES times, or follow-up jobs where scontrol is missing, e.g. in
# pyxis/enroot containers: slurm/submit_chain.sh): see slurm/pretrain_common.sh.
# --signal=B:USR1@N: USR1 N seconds before the time limit; N must exceed one step plus the checkpoint save (every save
# logs "checkpoint save took S s"): docs/cluster.md.
#SBATCH --job-name=bert_ds-base
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

RECIPE=${RECIPE:-ds_configs/bert_base.json}
RUN_DIR=${RUN_DIR:-runs/bert_base}
if [ ! -f slurm/pretrain_common.sh ]; then
  echo "bert_ds: slurm/pretrain_common.sh not found in $PWD: submit from the bert_ds checkout or pass --chdir" >&2
  exit 2
fi
# shellcheck source=slurm/pretrain_common.sh
source slurm/pretrain_common.sh
