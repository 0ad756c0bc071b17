#!/usr/bin/env bash
# What a session lent a GPU runs, in one call (docs/gpu.md): the pipeline against P = 1 on the devices present
# (two GPUs, or two ranks sharing one: NCCL >= 2.30), the attention kernels of packed rows, then the LoRA jobs
# with both attention paths beside the Trainer. Results go to BENCHMARKS.md (GPU sections, with the device) and
# to OUT (default gpu_checks/): JSON, timelines, traces.
#
#   bash launch/gpu_checks.sh            # everything (estimated 15 minutes on one H200)
#   bash launch/gpu_checks.sh pipeline   # the pipeline check alone (12 runs of 3 steps: estimated 6 minutes)
#   TINY=1 bash launch/gpu_checks.sh     # the same commands at tiny size (a CPU is enough)
# NO_APPEND=1 leaves BENCHMARKS.md as it is; PYTHON names the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_checks}
PART=${1:-all}
PY=${PYTHON:-python}
SIZE=()
if [[ "${TINY:-0}" == "1" ]]; then SIZE=(--tiny --steps 2); fi
APPEND=()
if [[ "${NO_APPEND:-0}" == "1" ]]; then APPEND=(--no-append); fi
mkdir -p "$OUT"
mmpipe() { "$PY" -m mmpipe.cli.main "$@"; }
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None, 'devices', torch.cuda.device_count())"

if [[ "$PART" == "all" || "$PART" == "pipeline" ]]; then
  mmpipe bench gpu --pipeline --steps 3 --full-layers 4 ${SIZE[@]+"${SIZE[@]}"} ${APPEND[@]+"${APPEND[@]}"} --attention varlen --out "$OUT/pipeline" --timeout 300
fi
if [[ "$PART" == "all" || "$PART" == "attention" ]]; then
  if [[ "${TINY:-0}" == "1" ]]; then
    mmpipe bench attention --shape tiny --row 256 --lengths 40 120 --reps 2 ${APPEND[@]+"${APPEND[@]}"}
  else
    mmpipe bench attention --shape llava ${APPEND[@]+"${APPEND[@]}"}
    mmpipe bench attention --shape qwen ${APPEND[@]+"${APPEND[@]}"}
  fi
fi
if [[ "$PART" == "all" || "$PART" == "lora" ]]; then
  mmpipe bench gpu ${SIZE[@]+"${SIZE[@]}"} ${APPEND[@]+"${APPEND[@]}"} --jobs vlm_lora qwen_lora --attention varlen sdpa --out "$OUT/lora"
fi
