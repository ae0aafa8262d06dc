#!/bin/bash
# Multi-node ViT training on SLURM: an example to adapt (checked with `bash -n`, not run on a cluster).
#
# One SLURM task per node runs torchrun, which starts one training process per GPU and meets the other nodes at a
# c10d rendezvous on the first node. In short, every node runs
#
#   torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
#       train_mfsdp.py --config-name vit_base dataset.path=... checkpoint.ckpt_dir=...
#
# inside the recipe's container (enroot + pyxis) or, with USE_CONTAINER=0, in the node's own Python environment.
# Edit the paths below (or pass them as environment variables), then:
#
#   sbatch slurm.sh
#   sbatch --nodes=4 slurm.sh                                   # the node count is read from SLURM_NNODES
#   CONFIG_NAME=vit_small sbatch slurm.sh
#   MFSDP_REPLICATE=4 sbatch --nodes=4 slurm.sh                 # HSDP: one replica per node, sharded within it
#
# Resuming is automatic: every entrypoint continues from the newest *complete* checkpoint in checkpoint.ckpt_dir
# (a step_N directory with a COMPLETE marker; a step_N.tmp left by a job killed mid-save is ignored), restoring
# model, optimizer, schedule, data position and random streams. After the time limit or a node failure, submit the
# same script again with the same CKPT_DIR (or add --requeue). Work since the last save is lost, so choose
# checkpoint.save_every accordingly. On a different number of GPUs the model and optimizer still resume, but the data
# order and random streams start afresh.
#
# Everything after train_*.py is a Hydra override; hydra_config/defaults.yaml documents every key.

#SBATCH --job-name=vit
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun per node; it starts the per-GPU processes itself
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x_%j.out

set -euo pipefail

# ------------------------------------------------------------------------------------------------ what to run
TRAIN_SCRIPT=${TRAIN_SCRIPT:-train_mfsdp.py}    # train_mfsdp.py | train_fsdp2.py | train_ddp.py
CONFIG_NAME=${CONFIG_NAME:-vit_base}
MFSDP_REPLICATE=${MFSDP_REPLICATE:-1}             # train_mfsdp.py: full replicas (HSDP); 1 = shard over all GPUs
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

# Host paths, on a file system that every node sees: each rank writes its own checkpoint shards, and rank 0 writes
# metrics.jsonl, validation.jsonl, summary.json, best_model/ and final_model/ to the output directory.
DATA_DIR=${DATA_DIR:-/lustre/datasets/imagenet}  # an image folder: train/<class>/..., validation/<class>/... (or root/<class>/...)
CKPT_DIR=${CKPT_DIR:-/lustre/checkpoints/vit_base}
OUTPUT_DIR=${OUTPUT_DIR:-/lustre/runs/vit_base}

# Container (enroot + pyxis): an image built from this folder's Dockerfile, for example a squashfs file made with
#   enroot import -o vit.sqsh dockerd://vit
# USE_CONTAINER=0 runs bare torchrun instead, from RECIPE_DIR, in whatever Python environment the nodes have (torch,
# TransformerEngine and requirements.txt installed).
USE_CONTAINER=${USE_CONTAINER:-1}
CONTAINER_IMAGE=${CONTAINER_IMAGE:-$PWD/vit.sqsh}
RECIPE_DIR=${RECIPE_DIR:-$PWD}

# ------------------------------------------------------------------------------------------------ rendezvous
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
echo "$SLURM_NNODES nodes x $GPUS_PER_NODE GPUs, rendezvous at $MASTER_ADDR:$MASTER_PORT"

mkdir -p "$CKPT_DIR" "$OUTPUT_DIR"
if [[ "$USE_CONTAINER" == 1 ]]; then
    # Paths as the training processes see them inside the container.
    DATA=/data CKPT=/checkpoints OUT=/outputs
else
    DATA=$DATA_DIR CKPT=$CKPT_DIR OUT=$OUTPUT_DIR
fi

TRAIN_ARGS=(
    --config-name "$CONFIG_NAME"
    "dataset.path=$DATA"
    "checkpoint.ckpt_dir=$CKPT"
    "output_dir=$OUT"
    # The shipped configs set no step count or checkpoint interval; a real run wants all of these:
    num_train_steps=100000
    checkpoint.save_every=1000
    checkpoint.save_final=true
    export_final_model=true
    # Each rank decodes and augments its share of the images in its data-loader workers (no preprocessing step).
)
if [[ "$TRAIN_SCRIPT" == train_mfsdp.py ]]; then
    TRAIN_ARGS+=("mfsdp.dp_replicate=$MFSDP_REPLICATE")
fi

TORCHRUN=(
    torchrun
    --nnodes="$SLURM_NNODES"
    --nproc_per_node="$GPUS_PER_NODE"
    --rdzv_id="$SLURM_JOB_ID"
    --rdzv_backend=c10d
    --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"
)

if [[ "$USE_CONTAINER" == 1 ]]; then
    srun --kill-on-bad-exit=1 \
        --container-image="$CONTAINER_IMAGE" \
        --container-mounts="$DATA_DIR:/data:ro,$CKPT_DIR:/checkpoints,$OUTPUT_DIR:/outputs" \
        --container-workdir=/workspace/vit \
        "${TORCHRUN[@]}" "$TRAIN_SCRIPT" "${TRAIN_ARGS[@]}"
else
    srun --kill-on-bad-exit=1 --chdir="$RECIPE_DIR" \
        "${TORCHRUN[@]}" "$TRAIN_SCRIPT" "${TRAIN_ARGS[@]}"
fi
