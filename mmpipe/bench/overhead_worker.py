"""One rank of the raw DeepSpeed baseline of ``mmpipe bench overhead``: the same plain model mmpipe
trains (``mmpipe.build_model`` of the mmpipe run's resolved config), torch AdamW with the run's
settings, DeepSpeed's own gradient clipping, micro-batches of the run's shapes made up front (no
loader), and the loop a DeepSpeed user writes: forward, ``engine.backward``, ``engine.step`` per
micro-batch (P = 1), or ``engine.train_batch`` over a ``PipelineModule`` of the family's layers
(P = 2). Writes each step's seconds (rank 0).

    deepspeed --num_gpus N mmpipe/bench/overhead_worker.py SPEC.json
"""
from __future__ import annotations

import json
import os
import sys
import time
from mmpipe.config.deepspeed import fused_adamw
from mmpipe.config.resolve import build_family
from mmpipe.config.schema import load_config
from mmpipe.parallel.plain import plain_model
from mmpipe.parallel.runtime import initialize
from mmpipe.parallel.topology import cpu_threads


class _Step:
    """A family layer as DeepSpeed's pipeline calls it: activations in, activations out."""

    def __new__(cls, module, step):
        import torch.nn as nn

        class Step(nn.Module):
            def __init__(self):
                super().__init__()
                self.module = module

            def forward(self, acts):
                return step(self.module, acts if isinstance(acts, tuple) else (acts,))
        return Step()


def main(spec_path: str) -> None:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    with open(spec_path) as fh:
        spec = json.load(fh)
    deepspeed.init_distributed(dist_backend="gloo" if get_accelerator().device_name() == "cpu" else None)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or torch.distributed.get_world_size())
    torch.set_num_threads(cpu_threads(local, os.cpu_count() or 1)[0])  # as an mmpipe rank (OMP_NUM_THREADS first)
    cfg = load_config(os.path.join(spec["run"], "config.yaml"))
    family = build_family(cfg, cfg.train.seed)
    P, world = spec["stages"], torch.distributed.get_world_size()
    mbs, A = cfg.parallel.micro_batch_size, cfg.train.batch_size // (cfg.parallel.micro_batch_size * (world // P))
    ds = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": A, "steps_per_print": 10 ** 9,
          "gradient_clipping": spec["clip"], "wall_clock_breakdown": False}
    if cfg.train.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    device = get_accelerator().device_name()
    batch = family.example_batch(mbs, cfg.data.max_length, device)
    inputs = tuple(batch[f] for f in family.inputs)
    labels = tuple(batch[f] for f in family.labels)
    o = cfg.optim
    adamw = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                 **({"fused": True} if fused_adamw(cfg) else {}))  # the same AdamW kernel as mmpipe's run
    if P == 1:
        model = plain_model(family)
        opt = torch.optim.AdamW(model.parameters(), **adamw)
        engine, _, _, _ = initialize(model=model, optimizer=opt, config=ds)

        def step():
            loss = None
            for _ in range(A):
                loss = engine(*inputs, *labels)
                engine.backward(loss)
                engine.step()
            return float(loss.detach())
    else:
        from deepspeed.pipe import PipelineModule
        layers = [_Step(family.build_layer(la.name), la.step) for la in family.layers()]
        def loss_fn(out, lab):
            if not family.labels:  # the last layer computes the loss (CLIP); labels are a placeholder
                return out[0] if isinstance(out, tuple) else out
            return family.loss(out, *(lab if isinstance(lab, tuple) else (lab,)))
        module = PipelineModule(layers=layers, num_stages=P, partition_method="parameters", loss_fn=loss_fn)
        if not labels:
            labels = (torch.zeros(1),)
        opt = torch.optim.AdamW([p for p in module.parameters()], **adamw)
        engine, _, _, _ = initialize(model=module, optimizer=opt, config=ds)
        data = iter(lambda: (inputs, labels), None)

        def step():
            return float(engine.train_batch(data))
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if torch.distributed.get_rank() == 0:
        with open(spec["out"], "w") as fh:
            json.dump({"step_times": times}, fh)
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's CPU communication threads abort the interpreter's normal teardown here


if __name__ == "__main__":
    main(sys.argv[-1])
