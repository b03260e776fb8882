#!/usr/bin/env bash
# Example sbatch script: Qwen3-30B-A3B on 8 nodes x 8 GPUs. Submit with `sbatch scripts/launch-slurm.sh`.
#SBATCH --job-name=moetrain
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --time=24:00:00
set -euo pipefail
CONFIG=${CONFIG:-configs/qwen3-30b-a3b.yaml}
# Print the layout from the real ranks first (fast, exits 0), then train. Ranks are placed in
# order, so consecutive ranks (one EP group with ep_outside: false) share a node.
srun build/moetrain train "$CONFIG" --dry-run
srun build/moetrain train "$CONFIG" --resume auto "$@"
