"""Host reads of tensor values per training step (issue 42): on an accelerator each one is a device
synchronisation, so none may come per micro-batch and mmpipe's own stay a fixed handful per step.
Counted on this CPU by ``sync_counter.py`` (a dispatch mode over ``aten::_local_scalar_dense``,
``item``, ``is_nonzero``, plus ``Tensor.tolist`` / ``numpy``), attributed to the code that asked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, TINY, _env

# mmpipe's own reads per step: the grouped-norm values (they decide the clip coefficients and whether a
# non-finite step is skipped, as DeepSpeed's overflow check reads to decide its own) and the step's one
# gather (loss, counters, lrs, stage clock, the stop and save agreement: every metric of the step)
MMPIPE_READS_PER_STEP = 2


@pytest.fixture(scope="module")
def reads(tmp_path_factory):
    """{micro-batches per step: [reads per step, by caller]} of a tiny CLIP in bf16 at P = 1 (DeepSpeed's
    FP16_UnfusedOptimizer, whose overflow check read every gradient in turn)."""
    from mmpipe.data.synth import synth
    d = tmp_path_factory.mktemp("syncs")
    data = synth(str(d / "data"), 160, val_fraction=0.0, size=32, seed=0, progress=False)
    out = {}
    for A in (2, 6):
        path = d / f"reads{A}.json"
        sets = [f"data.train={data['train']}", "data.val=null", f"train.output_dir={d / f'run{A}'}", "train.steps=3",
                "parallel.pipeline_stages=1", "train.precision=bf16", "train.save=false", "parallel.micro_batch_size=4",
                f"train.batch_size={4 * A}", "data.num_workers=0"]
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sync_counter.py"), str(path), "--config", TINY]
                              + [a for s in sets for a in ("--set", s)], capture_output=True, text=True,
                              env=_env({"OMP_NUM_THREADS": "1"}), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[A] = json.loads(path.read_text())["steps"]
    return out


def _by_owner(step: dict, owner: str) -> int:
    """Reads asked by ``owner``'s code (mmpipe's patch of DeepSpeed's overflow check counts as DeepSpeed's)."""
    return sum(v for k, v in step.items() if k.split(" ")[0] == owner and "ds_compat" not in k)


def test_no_host_read_per_micro_batch(reads):
    """Three times the micro-batches per step, the same reads per step, caller by caller: a read added
    per micro-batch anywhere (mmpipe, DeepSpeed, torch) fails this."""
    for a, b in zip(reads[2][1:], reads[6][1:]):  # after the first step (optimizer state made lazily)
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def test_mmpipe_reads_a_fixed_handful_per_step_and_deepspeeds_overflow_check_reads_once(reads):
    for step in reads[6][1:]:
        assert _by_owner(step, "mmpipe") == MMPIPE_READS_PER_STEP, step
        assert sum(v for k, v in step.items() if k.startswith("mmpipe") and "gather" in k) == 1, step
        overflow = {k: v for k, v in step.items() if "has_overflow" in k or "inf_or_nan" in k}
        # ds_compat.one_read_overflow_check: one read for every gradient (was one per parameter)
        assert sum(v for k, v in overflow.items() if "ds_compat" in k) == 1, overflow
        assert not any("has_overflow_serial" in k and k.startswith("deepspeed") for k in overflow), overflow
