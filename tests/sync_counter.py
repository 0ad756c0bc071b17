"""Run ``mmpipe train ARGS`` in this process and count, per training step, the operations that read a
tensor's value to the host (``aten::_local_scalar_dense``, ``item``, ``is_nonzero``: on an accelerator,
each a device synchronisation), with where they were called from (mmpipe / DeepSpeed / torch frames).

    python tests/sync_counter.py OUT.json --config C --set ...

Used by ``test_host_syncs.py``."""
from __future__ import annotations

import collections
import json
import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.ops.aten.is_nonzero.default}


def _owner(filename: str) -> str:
    if "site-packages" in filename:
        return filename.split("site-packages/")[-1].split("/")[0]
    return "mmpipe" if "/mmpipe/" in filename else "other"


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.where = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.count()
        return func(*args, **(kwargs or {}))

    def count(self) -> None:
        stack = [f for f in traceback.extract_stack()[:-2] if not f.filename.endswith("sync_counter.py")]
        # the innermost frame outside torch's dispatch and autograd machinery: whose code asked
        top = next((f for f in reversed(stack) if _owner(f.filename) in ("mmpipe", "deepspeed")
                    or "/torch/optim/" in f.filename), stack[-1])
        owner = "torch.optim" if "/torch/optim/" in top.filename else _owner(top.filename)
        self.where[f"{owner} {os.path.basename(top.filename)}:{top.lineno}:{top.name}"] += 1

    def __enter__(self):  # tolist() and numpy() read to the host without dispatching an operator
        self.saved = torch.Tensor.tolist, torch.Tensor.numpy
        mode = self

        def reader(original):
            def read(t, *a, **k):
                mode.count()
                return original(t, *a, **k)
            return read
        torch.Tensor.tolist, torch.Tensor.numpy = reader(self.saved[0]), reader(self.saved[1])
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self.saved
        return super().__exit__(*exc)


def main() -> int:
    out, argv = sys.argv[1], sys.argv[2:]
    import mmpipe.train.trainer as trainer
    original, steps = trainer.Trainer.step, []

    def step(self, n, **kw):
        with HostReads() as reads:
            record = original(self, n, **kw)
        steps.append(dict(reads.where))
        return record
    trainer.Trainer.step = step
    from mmpipe.cli.main import main as cli
    rc = cli(["train"] + argv)
    with open(out, "w") as fh:
        json.dump({"rc": rc, "steps": steps}, fh)
    return rc


if __name__ == "__main__":
    sys.exit(main())
