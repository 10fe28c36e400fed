#!/usr/bin/env bash
# Scaling efficiency of one recipe under SLURM: within a node (1, 2, 4, 8 GPUs) and across nodes
# (1, 2, ..., SLURM_JOB_NUM_NODES nodes of 8 GPUs), weak scaling (fixed per-rank batch).
#
#   sbatch --nodes=4 scripts/slurm_scale.sh recipes/llama7b_zero3.yaml [key=value ...]
#   STRONG=1 sbatch --nodes=4 scripts/slurm_scale.sh recipes/llama7b_zero3.yaml     # fixed global batch
#
# Writes runs/scale/<recipe>-intra/ and runs/scale/<recipe>-inter/ (scaling.{md,csv,html,png} and
# scaling_comm.*). Efficiency across nodes is relative to one full node (the smallest N measured).
# Resumable: submit the same command again after a preemption. output dirs must be on a shared filesystem.
#SBATCH --job-name=trainprof-scale
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=06:00:00
#SBATCH --signal=B:TERM@120
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: sbatch [--nodes=N] $0 RECIPE [key=value ...]" >&2
  exit 2
fi
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
RECIPE=$1
shift
NAME=$(basename "$RECIPE" .yaml)
GPUS=${SLURM_GPUS_PER_NODE:-8}
NODES=$(seq -s, 1 "${SLURM_JOB_NUM_NODES:-1}")   # 1,2,...,N
MODE=()
[[ -n "${STRONG:-}" ]] && MODE=(--strong)

# within one node: 1, 2, 4, ... GPUs
INTRA=$(python -c "print(','.join(str(2**i) for i in range(10) if 2**i <= $GPUS))")
trainprof scale "$RECIPE" "$@" --nproc "$INTRA" "${MODE[@]}" --out "runs/scale/$NAME-intra"
# across nodes: full nodes; cells with more than one node are started with srun by trainprof
if [[ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]]; then
  trainprof scale "$RECIPE" "$@" --nproc "$GPUS" --nnodes "$NODES" "${MODE[@]}" --out "runs/scale/$NAME-inter"
fi
