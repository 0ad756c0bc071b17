#!/usr/bin/env python
"""mmpipe training entry point (= ``mmpipe train``).

Copy-paste launches (CPU lines work on this machine; on GPUs drop DS_ACCELERATOR):

  # 2 pipeline stages on one node (image branch on stage 0, text branch + loss on stage 1)
  deepspeed --num_gpus 2 launch/train.py --config configs/demo.yaml
  DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/train.py --config configs/demo.yaml

  # pipeline x data parallel: 4 ranks, P = 2, DP = 2
  deepspeed --num_gpus 4 launch/train.py --config configs/demo.yaml --set parallel.pipeline_stages=2

  # multi-node with a hostfile (see launch/hostfile.example)
  deepspeed --hostfile launch/hostfile.example --master_addr node0 launch/train.py --config configs/demo.yaml

  # multi-node without ssh: torchrun on every node (or launch/run_deepspeed.sh with NNODES/NODE_RANK/...)
  torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 --master_addr node0 --master_port 29500 launch/train.py --config C
  torchrun --nproc_per_node 2 launch/train.py --config configs/demo.yaml

  # Accelerate only starts the processes; mmpipe drives DeepSpeed's pipeline engine itself and
  # honours the YAML's mixed_precision / zero_stage / gradient_clipping / deepspeed_config_file
  accelerate launch --config_file launch/accelerate/cpu_2proc.yaml launch/train.py --config configs/demo.yaml

  # P = 1, one process, no launcher
  python launch/train.py --config configs/demo.yaml --set parallel.pipeline_stages=1

  # resume from the latest checkpoint in train.output_dir
  deepspeed --num_gpus 2 launch/train.py --config configs/demo.yaml --resume
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmpipe.cli.main import train_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_main())
