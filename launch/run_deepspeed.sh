#!/usr/bin/env bash
# Launch mmpipe with the deepspeed launcher, configured by the environment variables torchrun /
# ms-swift users know. Extra arguments go to launch/train.py.
#
#   # one node, all visible devices (CPU here: 2 ranks)
#   bash launch/run_deepspeed.sh --config configs/demo.yaml
#   # one node, GPUs 0-3 only
#   CUDA_VISIBLE_DEVICES=0,1,2,3 bash launch/run_deepspeed.sh --config C
#   # two nodes, 8 GPUs each, no ssh: run this on every node with its NODE_RANK (started with
#   # torchrun: DeepSpeed's launcher cannot start nodes without ssh unless given a hostfile)
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NPROC_PER_NODE=8 bash launch/run_deepspeed.sh --config C
#   # or with a hostfile (ssh): HOSTFILE=launch/hostfile.example bash launch/run_deepspeed.sh --config C
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

if [ -z "${NPROC_PER_NODE:-}" ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    NPROC_PER_NODE=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NPROC_PER_NODE=$(nvidia-smi -L | grep -c GPU)
  else
    NPROC_PER_NODE=2   # CPU: one rank per pipeline stage of the demo
  fi
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

if [ -z "${HOSTFILE:-}" ] && [ "$NNODES" -gt 1 ]; then
  # Multi-node without ssh: every node starts its own ranks and they meet at MASTER_ADDR:MASTER_PORT.
  # torchrun does exactly that from these variables (`deepspeed --no_ssh` would need a hostfile
  # listing every node). mmpipe reads torchrun's RANK/LOCAL_RANK/LOCAL_WORLD_SIZE like DeepSpeed's.
  if command -v torchrun >/dev/null 2>&1; then run=(torchrun); else run=(python3 -m torch.distributed.run); fi
  exec "${run[@]}" --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$here/train.py" "$@"
fi

args=(--master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
if [ -n "${HOSTFILE:-}" ]; then
  args+=(--hostfile "$HOSTFILE")
elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  # the deepspeed launcher resets CUDA_VISIBLE_DEVICES; pass the selection explicitly
  args+=(--include "localhost:${CUDA_VISIBLE_DEVICES}")
else
  args+=(--num_gpus "$NPROC_PER_NODE")
fi
exec deepspeed "${args[@]}" "$here/train.py" "$@"
