#!/bin/bash
# Multi-node ESM-2 / AMPLIFY pre-training with the Trainer on SLURM: an example to adapt (checked with `bash -n` in
# the CPU tests, not run on a cluster).
#
# One SLURM task per node runs `accelerate launch`, which starts one training process per GPU; the nodes meet at a
# c10d rendezvous on the first node. In short, node N runs
#
#   accelerate launch --config_file accelerate_config/fsdp2_te.yaml --num_machines $SLURM_NNODES \
#       --num_processes $((SLURM_NNODES * 8)) --machine_rank N --main_process_ip $MASTER_ADDR \
#       --main_process_port 29500 --rdzv_backend c10d train.py --config-name L1_650M dataset.path=... output_dir=...
#
# inside the recipe's container (enroot + pyxis) or, with USE_CONTAINER=0, in the node's own Python environment.
# Edit the paths below (or pass them as environment variables), then:
#
#   sbatch slurm.sh
#   sbatch --nodes=4 slurm.sh                                     # the node count is read from SLURM_NNODES
#   ACCELERATE_CONFIG=accelerate_config/fp8_fsdp2.yaml CONFIG_NAME=L1_amplify_350M sbatch slurm.sh
#
# Resuming is automatic: train.py continues from the newest *complete* checkpoint-<step> in output_dir (one with a
# COMPLETE marker; a directory left by a job killed mid-save is ignored), restoring model, optimizer, schedule, data
# position and random streams. After the time limit or a node failure, submit the same script again with the same
# OUTPUT_DIR (or add --requeue). Work since the last save is lost, so choose checkpoint.save_every accordingly. A
# checkpoint continues only on the number of processes that wrote it.
#
# Everything after train.py is a Hydra override; hydra_config/defaults.yaml documents every key.

#SBATCH --job-name=esm2_accelerate_te
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one accelerate launch per node; it starts the per-GPU processes itself
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x_%j.out

set -euo pipefail

# ------------------------------------------------------------------------------------------------ what to run
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-accelerate_config/fsdp2_te.yaml}  # default, fsdp2_te, fsdp2_hf, fp8, fp8_fsdp2
CONFIG_NAME=${CONFIG_NAME:-L1_650M}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

# Host paths, on a file system that every node sees: checkpoints (sharded under FSDP2: every rank writes its part),
# metrics.jsonl, summary.json and final_model/ all go to the output directory.
DATA_DIR=${DATA_DIR:-/lustre/datasets/uniref50}  # Parquet shards with a "sequence" column (FASTA/CSV/JSONL work too)
OUTPUT_DIR=${OUTPUT_DIR:-/lustre/runs/esm2_650M_trainer}

# Container (enroot + pyxis): an image built from this folder's Dockerfile, for example a squashfs file made with
#   enroot import -o esm2_accelerate_te.sqsh dockerd://esm2_accelerate_te
# USE_CONTAINER=0 runs bare accelerate launch instead, from RECIPE_DIR, in whatever Python environment the nodes have
# (torch, TransformerEngine and requirements.txt installed).
USE_CONTAINER=${USE_CONTAINER:-1}
CONTAINER_IMAGE=${CONTAINER_IMAGE:-$PWD/esm2_accelerate_te.sqsh}
RECIPE_DIR=${RECIPE_DIR:-$PWD}

# ------------------------------------------------------------------------------------------------ rendezvous
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
echo "$SLURM_NNODES nodes x $GPUS_PER_NODE GPUs, rendezvous at $MASTER_ADDR:$MASTER_PORT, $ACCELERATE_CONFIG"

mkdir -p "$OUTPUT_DIR"
if [[ "$USE_CONTAINER" == 1 ]]; then
    DATA=/data OUT=/outputs  # paths as the training processes see them inside the container
else
    DATA=$DATA_DIR OUT=$OUTPUT_DIR
fi

TRAIN_ARGS=(
    --config-name "$CONFIG_NAME"
    "dataset.path=$DATA/*.parquet"       # quoted: the data loader expands the glob, not the shell
    "output_dir=$OUT"
    # The L1 configs are benchmarks (200 steps, no checkpoints, no export); a real run wants all three:
    num_train_steps=500000
    checkpoint.save_every=1000
    checkpoint.save_final=true
    export_final_model=true
    # Map-style data is tokenized once, up front, into the datasets cache (default ~/.cache/huggingface;
    # dataset.cache_dir moves it, dataset.num_proc parallelises it). dataset.streaming=true skips that step.
)

# The machine rank differs per node: SLURM_NODEID is read by the shell that srun starts on each node.
LAUNCH='accelerate launch --config_file "$0" --num_machines "$1" --num_processes "$(($1 * $2))" \
    --machine_rank "$SLURM_NODEID" --main_process_ip "$3" --main_process_port "$4" --rdzv_backend c10d \
    train.py "${@:5}"'
LAUNCH_ARGS=("$ACCELERATE_CONFIG" "$SLURM_NNODES" "$GPUS_PER_NODE" "$MASTER_ADDR" "$MASTER_PORT" "${TRAIN_ARGS[@]}")

if [[ "$USE_CONTAINER" == 1 ]]; then
    srun --kill-on-bad-exit=1 \
        --container-image="$CONTAINER_IMAGE" \
        --container-mounts="$DATA_DIR:/data:ro,$OUTPUT_DIR:/outputs" \
        --container-workdir=/workspace/esm2_accelerate_te \
        bash -c "$LAUNCH" "${LAUNCH_ARGS[@]}"
else
    srun --kill-on-bad-exit=1 --chdir="$RECIPE_DIR" bash -c "$LAUNCH" "${LAUNCH_ARGS[@]}"
fi
