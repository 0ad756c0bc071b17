#!/usr/bin/env bash
# Launch mmpipe with `accelerate launch` (Accelerate starts the ranks; mmpipe drives DeepSpeed).
#   bash launch/run_accelerate.sh --config configs/demo.yaml                     # CPU, 2 ranks
#   ACCEL_CONFIG=launch/accelerate/gpu_1node.yaml NPROC_PER_NODE=8 bash launch/run_accelerate.sh --config C
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 NPROC_PER_NODE=8 ACCEL_CONFIG=launch/accelerate/gpu_1node.yaml \
#     bash launch/run_accelerate.sh --config C
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
ACCEL_CONFIG=${ACCEL_CONFIG:-$here/accelerate/cpu_2proc.yaml}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
args=(--config_file "$ACCEL_CONFIG" --num_machines "$NNODES" --machine_rank "$NODE_RANK"
      --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT")
if [ -n "${NPROC_PER_NODE:-}" ]; then
  args+=(--num_processes $((NPROC_PER_NODE * NNODES)))
fi
exec accelerate launch "${args[@]}" "$here/train.py" "$@"
