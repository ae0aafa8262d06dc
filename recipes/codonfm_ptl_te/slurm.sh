#!/bin/bash
# Multi-node Encodon pre-training on SLURM, the Lightning way: an example to adapt (checked with `bash -n`, not run on
# a cluster).
#
# SLURM starts one task per GPU (`--ntasks-per-node` = `--gpus-per-node`), and each task runs `python train.py`.
# Lightning's SLURMEnvironment reads the rank, local rank, world size and the first node's address from SLURM's
# variables, and trainer_setup.process_counts reads devices = SLURM_NTASKS / SLURM_NNODES and num_nodes = SLURM_NNODES,
# so the command line never repeats the counts. (No torchrun here: Lightning does the rendezvous itself.)
#
# Each task runs inside the recipe's container (enroot + pyxis) or, with USE_CONTAINER=0, in the node's own Python
# environment. Edit the paths below (or pass them as environment variables), then:
#
#   sbatch slurm.sh
#   sbatch --nodes=4 slurm.sh                                   # the node count is read from SLURM_NNODES
#   CONFIG_NAME=encodon_1b STRATEGY=fsdp2 sbatch slurm.sh
#
# Resuming is automatic: train.py continues from <CKPT_DIR>/last.ckpt, which is replaced only once a new checkpoint is
# completely written (a `.last.ckpt.partial` left by a job killed mid-save is ignored), restoring model, optimizer,
# schedule, every rank's data position and the dropout streams. After the time limit or a node failure, submit the
# same script again with the same CKPT_DIR (or add --requeue). Work since the last save is lost, so choose
# checkpoint.save_every accordingly.
#
# Everything after train.py is a Hydra override; hydra_config/defaults.yaml documents every key.

#SBATCH --job-name=codonfm_ptl_te
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8          # one task per GPU: Lightning's SLURM launch
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8            # data-loader workers (data.num_workers) per GPU
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x_%j.out

set -euo pipefail

# ------------------------------------------------------------------------------------------------ what to run
CONFIG_NAME=${CONFIG_NAME:-encodon_600m}   # encodon_80m | encodon_600m | encodon_1b
STRATEGY=${STRATEGY:-ddp}                  # ddp | fsdp | fsdp2

# Host paths, on a file system that every node sees: rank 0 writes last.ckpt, metrics.jsonl, summary.json and
# final_model/ to the output directory.
DATA_PATH=${DATA_PATH:-/lustre/datasets/cds}       # a FASTA/Parquet/CSV file of coding sequences, or a folder of them
CKPT_DIR=${CKPT_DIR:-/lustre/checkpoints/encodon_600m}
OUTPUT_DIR=${OUTPUT_DIR:-/lustre/runs/encodon_600m}

# Container (enroot + pyxis): an image built from this folder's Dockerfile, for example a squashfs file made with
#   enroot import -o codonfm_ptl_te.sqsh dockerd://codonfm_ptl_te
# USE_CONTAINER=0 runs train.py from RECIPE_DIR in whatever Python environment the nodes have (torch,
# TransformerEngine and requirements.txt installed).
USE_CONTAINER=${USE_CONTAINER:-1}
CONTAINER_IMAGE=${CONTAINER_IMAGE:-$PWD/codonfm_ptl_te.sqsh}
RECIPE_DIR=${RECIPE_DIR:-$PWD}

echo "$SLURM_NNODES nodes x $SLURM_NTASKS_PER_NODE tasks (GPUs); config $CONFIG_NAME, strategy $STRATEGY"

mkdir -p "$CKPT_DIR" "$OUTPUT_DIR"
if [[ "$USE_CONTAINER" == 1 ]]; then
    # Paths as the training processes see them inside the container.
    DATA=/data CKPT=/checkpoints OUT=/outputs
else
    DATA=$DATA_PATH CKPT=$CKPT_DIR OUT=$OUTPUT_DIR
fi

TRAIN_ARGS=(
    --config-name "$CONFIG_NAME"
    "data.train_path=$DATA"
    "strategy=$STRATEGY"
    "checkpoint.ckpt_dir=$CKPT"
    "output_dir=$OUT"
    # The shipped benchmark configs set no step count; a real run wants one:
    num_train_steps=100000
    checkpoint.save_every=1000
)

if [[ "$USE_CONTAINER" == 1 ]]; then
    srun --kill-on-bad-exit=1 \
        --container-image="$CONTAINER_IMAGE" \
        --container-mounts="$DATA_PATH:/data:ro,$CKPT_DIR:/checkpoints,$OUTPUT_DIR:/outputs" \
        --container-workdir=/workspace/codonfm_ptl_te \
        python train.py "${TRAIN_ARGS[@]}"
else
    srun --kill-on-bad-exit=1 --chdir="$RECIPE_DIR" \
        python train.py "${TRAIN_ARGS[@]}"
fi
