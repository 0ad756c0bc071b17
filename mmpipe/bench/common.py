"""What every bench shares: the machine line, its temporary directory (removed when it ends),
launching a training run, pooling its measured steps, and appending a result to BENCHMARKS.md."""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from mmpipe.train.metrics import read_metrics


def machine() -> str:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu":  # a GPU section: the device, driver and library versions
        import transformers
        return (f"GPU: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()} (CUDA {torch.version.cuda}), "
                f"{os.cpu_count()} cores, torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers "
                f"{transformers.__version__}, python {sys.version.split()[0]}")
    return (f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads in this process "
            f"(1 per rank when 2 ranks share 2 cores), torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
            f"python {sys.version.split()[0]}")


@contextlib.contextmanager
def scratch_dir(name: str):
    """A bench's temporary directory (``mmpipe-bench-NAME-*``: synthetic data, caches, runs), removed
    when the bench ends, on an error or Ctrl-C too."""
    tmp = tempfile.mkdtemp(prefix=f"mmpipe-bench-{name}-")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def with_scratch(name: str):
    """``@with_scratch("data")`` on ``bench_data(args, tmp)``: called as ``bench_data(args)``, with
    ``tmp`` a ``scratch_dir(name)``."""
    def wrap(bench):
        @functools.wraps(bench)
        def run(args) -> int:
            with scratch_dir(name) as tmp:
                return bench(args, tmp)
        return run
    return wrap


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


def free_port() -> int:
    """A free local TCP port for a launcher's rendezvous (the benches start several in one run)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(out: str, warmup: int) -> list:
    return read_metrics(os.path.join(out, "metrics.jsonl"))[warmup:]


def pooled(outs: list, warmup: int) -> tuple:
    """Repeated runs of one variant: the median step over every run's steps after ``warmup`` (so a
    round caught in one of this machine's slow or fast spells weighs only its share), the run whose
    own median is the middle one (for its idle and memory figures), and each run's median."""
    per = {o: [r["step_time"] for r in _steps(o, warmup)] for o in outs}
    meds = {o: statistics.median(v) for o, v in per.items()}
    mid = sorted(outs, key=meds.get)[(len(outs) - 1) // 2]
    return statistics.median([t for v in per.values() for t in v]), mid, [meds[o] for o in outs]


HISTORY = os.path.join("docs", "benchmarks", "history.md")
INTRO = """# mmpipe benchmarks

The latest result of each bench, newest first; every run, oldest first, is in
[docs/benchmarks/history.md](docs/benchmarks/history.md). Each section was written by a `mmpipe bench ...`
command: the exact command, the machine, and ratios against a baseline measured **in the same run**.
Absolute times on a shared 2-core CPU machine are noise; read the ratios. CPU runs are
multi-process (`deepspeed --num_gpus N` on the CPU accelerator with gloo); GPU sections say so.
"""
HISTORY_INTRO = "# Benchmark history\n\nEvery `mmpipe bench` result, oldest first (the latest of each: BENCHMARKS.md).\n"
_HEADING = re.compile(r"^## (.*?) \((\d{4}-\d{2}-\d{2}[^)]*)\)\s*$")


def append_benchmarks(title: str, command: str, table: str, notes: str, root: str = None) -> None:
    """Append a result to the history and rewrite BENCHMARKS.md as the latest result of each bench."""
    root = root or os.getcwd()
    history = os.path.join(root, HISTORY)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    os.makedirs(os.path.dirname(history), exist_ok=True)
    if not os.path.isfile(history):
        with open(history, "w") as fh:
            fh.write(HISTORY_INTRO)
    with open(history, "a") as fh:
        fh.write(f"\n## {title} ({stamp})\n\n`{command}`\n\nMachine: {machine()}\n\n{table}\n\n{notes}\n")
    write_latest(root)
    print(f"appended to {history}; BENCHMARKS.md shows the latest of each bench")


def sections(text: str) -> list:
    """(title, stamp, section text) of every ``## title (stamp)`` section, in order."""
    out, current = [], None
    for line in text.splitlines(keepends=True):
        m = _HEADING.match(line)
        if m:
            current = [m.group(1), m.group(2), line]
            out.append(current)
        elif current is not None:
            current[2] += line
    return [tuple(c) for c in out]


_HOW_LONG = re.compile(r"\s--(steps|warmup|rounds|repeats|n)\s+\d+|\s--refresh\b")


def _subject(section: str) -> str:
    """What a bench section measured: its command without the how-long flags (steps, rounds...)."""
    m = re.search(r"^`(mmpipe bench [^`]*)`", section, re.M)
    return _HOW_LONG.sub("", m.group(1)).strip() if m else ""


def write_latest(root: str) -> None:
    """BENCHMARKS.md: the latest section of each bench and subject, newest first."""
    with open(os.path.join(root, HISTORY)) as fh:
        latest = {(title, _subject(text)): (stamp, text) for title, stamp, text in sections(fh.read())}
    ordered = sorted(latest.values(), key=lambda st: st[0], reverse=True)
    with open(os.path.join(root, "BENCHMARKS.md"), "w") as fh:
        fh.write(INTRO + "".join("\n" + text.strip("\n") + "\n" for _, text in ordered))


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


# ---- mmpipe bench strategies ---------------------------------------------------------------------------
_MEM_LINE = re.compile(r"rank (\d+) stage \d+: params [\d.]+M \(trainable [\d.]+M\), optimizer state ([\d.]+) MB, "
                       r"max RSS (\d+) MB")
