"""What every bench shares: the machine line, launching a training run, pooling its measured steps,
and appending a result to BENCHMARKS.md."""
from __future__ import annotations

import datetime
import os
import re
import shutil
import statistics
import subprocess
import sys


def machine() -> str:
    import deepspeed
    import torch
    return (f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads in this process "
            f"(1 per rank when 2 ranks share 2 cores), torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
            f"python {sys.version.split()[0]}")


def launch(nprocs: int, config: str, sets: list, out: str) -> str:
    cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(nprocs), os.path.join(ROOT, "launch", "train.py"),
           "--config", config, "--set", f"train.output_dir={out}", "--set", "log.progress=false", "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.getcwd())
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise SystemExit(f"mmpipe bench: run failed: {' '.join(cmd)}\n{tail}")
    return proc.stdout + proc.stderr


def _steps(out: str, warmup: int) -> list:
    from mmpipe.train.metrics import read_metrics
    return read_metrics(os.path.join(out, "metrics.jsonl"))[warmup:]


def pooled(outs: list, warmup: int) -> tuple:
    """Repeated runs of one variant: the median step over every run's steps after ``warmup`` (so a
    round caught in one of this machine's slow or fast spells weighs only its share), the run whose
    own median is the middle one (for its idle and memory figures), and each run's median."""
    per = {o: [r["step_time"] for r in _steps(o, warmup)] for o in outs}
    meds = {o: statistics.median(v) for o, v in per.items()}
    mid = sorted(outs, key=meds.get)[(len(outs) - 1) // 2]
    return statistics.median([t for v in per.values() for t in v]), mid, [meds[o] for o in outs]


def append_benchmarks(title: str, command: str, table: str, notes: str) -> None:
    path = os.path.join(os.getcwd(), "BENCHMARKS.md")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with open(path, "a") as fh:
        fh.write(f"\n## {title} ({stamp})\n\n`{command}`\n\nMachine: {machine()}\n\n{table}\n\n{notes}\n")
    print(f"appended to {path}")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- mmpipe bench strategies ---------------------------------------------------------------------------
_MEM_LINE = re.compile(r"rank (\d+) stage \d+: params [\d.]+M \(trainable [\d.]+M\), optimizer state ([\d.]+) MB, "
                       r"max RSS (\d+) MB")
