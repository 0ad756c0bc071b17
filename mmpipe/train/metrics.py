"""Run outputs on the reporting rank: ``metrics.jsonl`` (one object per optimizer step, plus eval
lines and every rank's memory after a launch's first step), optional TensorBoard, a progress bar,
and ``print0``-style logging. Other ranks get a null writer, so the training loop has no rank checks."""
from __future__ import annotations

import json
import os
import sys
from typing import Optional


class NullWriter:
    enabled = False

    def log_step(self, record: dict) -> None: ...
    def log_eval(self, record: dict, line: str = None) -> None: ...
    def log_memory(self, ranks: list) -> None: ...
    def log_event(self, kind: str, record: dict) -> None: ...
    def info(self, msg: str) -> None: ...
    def progress(self, step: int, record: dict) -> None: ...
    def close(self) -> None: ...


class MetricsWriter(NullWriter):
    enabled = True

    def __init__(self, output_dir: str, total_steps: int, start_step: int = 0, progress: bool = True,
                 tensorboard: bool = False, every: int = 1):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        _truncate_after(self.path, start_step)
        self.fh = open(self.path, "a")
        self.every = max(1, every)
        self.step = start_step  # the last step logged
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(output_dir, "tb"))
        self.bar = None
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=sys.stderr,
                            dynamic_ncols=True)

    def _write(self, record: dict) -> None:
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, record["step"])

    def log_step(self, record: dict) -> None:
        self._write(dict(kind="train", **record))
        self.step = record["step"]
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", sps=f"{record['samples_per_sec']:.1f}")
        elif record["step"] % self.every == 0:
            gn = record.get("grad_norm")
            self.info(f"step {record['step']} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                      + (f"grad_norm {gn:.3f} " if gn is not None else "")
                      + f"samples/s {record['samples_per_sec']:.1f}")

    def log_eval(self, record: dict, line: str = None) -> None:
        """One eval record; ``line``: the family's summary of it (else its numbers, in order)."""
        self._write(dict(kind="eval", **record))
        self.info(line or f"eval step {record['step']}: " + " ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items() if k != "step"))

    def log_memory(self, ranks: list) -> None:
        """``{"kind": "memory", "step": S, "ranks": [...]}``: every rank's ``step_stats.memory_record``
        (rank, stage, params, trainable, optimizer_state_mb, peak_mb, peak_of, cpu_threads) after
        step S, the launch's first (``read_memory_record``)."""
        self._write({"kind": "memory", "step": self.step, "ranks": ranks})

    def log_event(self, kind: str, record: dict) -> None:
        """A ``{"kind": kind, "step": ..., ...}`` record: what the run did at a step (``replan``, ``refit``)."""
        self._write({"kind": kind, **record})

    def info(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(f"[mmpipe] {msg}", file=sys.stderr)
        else:
            print(f"[mmpipe] {msg}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.fh.close()


def _truncate_after(path: str, step: int) -> None:
    """On resume, drop records of steps after the checkpoint (they will be redone)."""
    if not os.path.isfile(path):
        return
    if step == 0:
        os.remove(path)
        return
    with open(path) as fh:
        keep = [line for line in fh if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(path, "w") as fh:
        fh.writelines(keep)


def read_metrics(path: str, kind: Optional[str] = "train") -> list[dict]:
    out = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                if kind is None or r.get("kind") == kind:
                    out.append(r)
    return out


def read_memory_record(run_dir: str) -> list[dict]:
    """Every rank's memory figures from the run's latest memory record in ``metrics.jsonl``
    (``MetricsWriter.log_memory``); empty without one."""
    recs = read_metrics(os.path.join(run_dir, "metrics.jsonl"), kind="memory")
    return recs[-1]["ranks"] if recs else []


def measured_from_run(run_dir: str, skip: int = 3) -> dict:
    """Median step time and mean per-stage idle/busy fractions of a run's metrics.jsonl."""
    import statistics

    from mmpipe.train.metrics import read_metrics
    recs = read_metrics(os.path.join(run_dir, "metrics.jsonl"))[skip:]
    if not recs:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps after the first {skip}")
    P = sum(1 for k in recs[0] if k.startswith("stage") and k.endswith(".idle"))
    return {"step_time": statistics.median(r["step_time"] for r in recs),
            "idle_frac": [statistics.mean(r[f"stage{s}.idle"] for r in recs) for s in range(P)],
            "busy_frac": [statistics.mean(r[f"stage{s}.busy"] for r in recs) for s in range(P)],
            "steps": len(recs)}
