#!/bin/bash
# Multi-node OpenGenome2 pre-training on SLURM: an example to adapt (checked with `bash -n`, not run on a cluster).
#
# One SLURM task per node runs torchrun, which starts one training process per GPU and meets the other nodes at a
# c10d rendezvous on the first node. In short, every node runs
#
#   torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
#       train_fsdp2.py --config-name og2_7b_thd_gqa dataset.path=... validation.path=... output_dir=...
#
# inside the recipe's container (enroot + pyxis) or, with USE_CONTAINER=0, in the node's own Python environment.
# Edit the paths below (or pass them as environment variables), then:
#
#   sbatch slurm.sh
#   sbatch --nodes=4 slurm.sh                                     # the node count is read from SLURM_NNODES
#   CONFIG_NAME=og2_7b_thd_gqa_fp8 sbatch slurm.sh
#   CONFIG_NAME=og2_7b_thd_gqa_global_shuffle TRAIN_DATA=/lustre/og2_shuffled sbatch slurm.sh
#
# The global batch is GPUs x grad_acc_steps x dataset.token_budget tokens: with more nodes, lower GRAD_ACC_STEPS to keep
# the one the config was tuned for (og2_7b_thd_gqa: 8 GPUs x 8 x 8,192 = 524,288 tokens per step).
#
# Resuming is automatic: train_fsdp2.py continues from the newest *complete* checkpoint under $OUTPUT_DIR/checkpoints
# (a step_N directory with a COMPLETE marker; a step_N.tmp left by a job killed mid-save is ignored), restoring
# model, optimizer, schedule, each rank's data cursor and random streams. After the time limit or a node failure,
# submit the same script again with the same OUTPUT_DIR (or add --requeue). On a different number of GPUs the model
# and optimizer still resume, but the data cursors and random streams start afresh.

#SBATCH --job-name=og2_llama
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1          # one torchrun per node; it starts the per-GPU processes itself
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x_%j.out

set -euo pipefail

# ------------------------------------------------------------------------------------------------ what to run
CONFIG_NAME=${CONFIG_NAME:-og2_7b_thd_gqa}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
GRAD_ACC_STEPS=${GRAD_ACC_STEPS:-2}  # 4 nodes x 8 GPUs x 2 x 8,192 = the 524,288-token step of 8 GPUs x 8

# Host paths, on a file system that every node sees: each rank writes its own checkpoint shards, rank 0 writes
# metrics.jsonl, validation.jsonl, summary.json and final_model/ to the output directory.
TRAIN_DATA=${TRAIN_DATA:-/lustre/datasets/opengenome2/train}   # JSONL(.gz) shards, or the reshard script's Parquet
VALID_DATA=${VALID_DATA:-/lustre/datasets/opengenome2/valid/data_valid.jsonl.gz}
OUTPUT_DIR=${OUTPUT_DIR:-/lustre/runs/og2_7b}

# Container (enroot + pyxis): an image built from this folder's Dockerfile, for example a squashfs file made with
#   enroot import -o opengenome2_llama_native_te.sqsh dockerd://opengenome2_llama_native_te
# USE_CONTAINER=0 runs bare torchrun instead, from RECIPE_DIR, in whatever Python environment the nodes have (torch,
# TransformerEngine and requirements.txt installed).
USE_CONTAINER=${USE_CONTAINER:-1}
CONTAINER_IMAGE=${CONTAINER_IMAGE:-$PWD/opengenome2_llama_native_te.sqsh}
RECIPE_DIR=${RECIPE_DIR:-$PWD}

# ------------------------------------------------------------------------------------------------ rendezvous
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
echo "$SLURM_NNODES nodes x $GPUS_PER_NODE GPUs, rendezvous at $MASTER_ADDR:$MASTER_PORT"

mkdir -p "$OUTPUT_DIR"
if [[ "$USE_CONTAINER" == 1 ]]; then
    # Paths as the training processes see them inside the container.
    TRAIN=/data/train VALID=/data/valid/$(basename "$VALID_DATA") OUT=/outputs
else
    TRAIN=$TRAIN_DATA VALID=$VALID_DATA OUT=$OUTPUT_DIR
fi

TRAIN_ARGS=(
    --config-name "$CONFIG_NAME"
    "dataset.path=$TRAIN"      # a directory: every .jsonl(.gz)/.fa(.gz)/.parquet file in it, streamed
    "validation.path=$VALID"
    "output_dir=$OUT"
    "grad_acc_steps=$GRAD_ACC_STEPS"
)

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
        --container-mounts="$TRAIN_DATA:/data/train:ro,$(dirname "$VALID_DATA"):/data/valid:ro,$OUTPUT_DIR:/outputs" \
        --container-workdir=/workspace/opengenome2_llama_native_te \
        "${TORCHRUN[@]}" train_fsdp2.py "${TRAIN_ARGS[@]}"
else
    srun --kill-on-bad-exit=1 --chdir="$RECIPE_DIR" \
        "${TORCHRUN[@]}" train_fsdp2.py "${TRAIN_ARGS[@]}"
fi
