"""``mmpipe bench local-loss``'s loss-only part, one process per data-parallel rank (launched by the bench
with ``deepspeed --num_gpus 2``): the step loss's ``StepLossCache.fill`` (gather, loss, gradients, and with
``model.local_loss`` the reduce-scatter) on random features of the global batch, timed and its peak bytes
counted (``LiveBytes``), for one rank alone on the whole batch (two micro-batches), two ranks each the whole
B x B, and two ranks each its own rows. Writes one JSON per rank."""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from mmpipe.config.resolve import build_family
from mmpipe.config.schema import load_config
from mmpipe.parallel.live_bytes import LiveBytes
from mmpipe.parallel.step_loss import StepLossCache


def main(spec_path: str) -> None:
    with open(spec_path) as fh:
        spec = json.load(fh)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # as a training rank of two on two cores
    # (the loss reads none of the text tower's fields a tokenizer would fix: stand-ins)
    family = build_family(load_config(spec["config"], spec["sets"] + [
        "model.text.vocab_size=300", "model.text.max_position_embeddings=16", "model.text.eos_token_id=2"]).model)
    module = family.build_layer(family.layer_names()[-1])
    B, width = spec["batch"], 2 * family.projection_dim
    out = {}
    for mode, D, local in (("one rank, whole", 1, False), ("DP2, whole B x B", world, False),
                           ("DP2, own rows", world, True)):
        family.cfg.local_loss = local
        A = 2 if D == 1 else 1  # (one micro-batch on one rank would run the loss in the graph instead)
        rows = B // (D * A)
        g = torch.Generator().manual_seed(rank)
        outputs = [torch.randn(rows, width, generator=g) for _ in range(A)]
        times, peaks = [], []
        for i in range(spec["repeats"] + 1):
            if D == 1 and rank != 0:
                break
            cache = StepLossCache(family, module, A, D, rank if D > 1 else 0)
            dist.barrier() if D > 1 else None
            live = LiveBytes() if i == spec["repeats"] else None  # counted once, apart from the timed repeats
            t0 = time.perf_counter()
            if live is not None:
                with live:
                    cache.fill(outputs)
                peaks.append(live.peak)
            else:
                cache.fill(outputs)
                if i:
                    times.append(time.perf_counter() - t0)
            assert cache.local == (local and D > 1)
            loss = float(cache.loss)
        if times:
            out[mode] = {"seconds": statistics.median(times), "peak_bytes": peaks[0], "loss": loss,
                         "rows": rows * A, "micro_batches": A, "ranks": D, "features_bytes": rows * width * 4}
        if world > 1:
            dist.barrier()
    with open(spec["out"] + f".{rank}", "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[-1])
