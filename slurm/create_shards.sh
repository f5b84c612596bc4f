#!/usr/bin/env bash
# Shard creation across the nodes of a Slurm job: one MPI rank per task. Rank r makes the chunks c with c mod N = r
# and rank 0 writes index.json, so the shards and index.json are byte-identical to a 1-process run's.
#
#   sbatch --nodes=4 --ntasks-per-node=32 slurm/create_shards.sh --input corpus/ --tokenizer data/tokenizer \
#       --seq-len 128 --out data/shards128 --dupe-factor 5
#
# The arguments after the script go to bert-ds-create-shards unchanged (python tools/create_shards.py --help). Every
# rank reads all of --input to find the chunk cuts, and --out must be on a file system all nodes see. PYTHON [python]
# picks the interpreter; its mpi4py must be built against the Open MPI whose mpirun is on PATH.
#SBATCH --job-name=bert_ds-shards
#SBATCH --time=12:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

PYTHON=${PYTHON:-python}
if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "bert_ds: submit this with sbatch (its ranks are the job's tasks)" >&2
  exit 2
fi
echo "bert_ds: shard creation on $SLURM_NTASKS MPI rank(s) across $SLURM_JOB_NUM_NODES node(s)"
# Open MPI's mpirun takes its hosts and rank count from the allocation. It, not `srun --mpi=pmix`, starts the ranks
# because bert_ds recognises an MPI launch by mpirun's OMPI_COMM_WORLD_SIZE, which a PMIx direct launch does not set.
# --bind-to none: Open MPI binds each of up to 2 ranks to a single core, which would squeeze a rank's --workers onto it.
exec mpirun --bind-to none "$PYTHON" -m bert_ds.data.create "$@"
