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

from mmpipe.parallel.startup import free_port  # noqa: F401 (the benches and tests take their ports here)
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


def launch(nprocs: int, config: str, sets: list, out: str, env: dict = None) -> str:
    """``deepspeed --num_gpus nprocs launch/train.py`` on ``config`` with ``sets``, into ``out`` (``env``: more
    environment variables); its output, or the bench stops with its last lines."""
    cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(nprocs), "--master_port", str(free_port()),
           os.path.join(ROOT, "launch", "train.py"), "--config", config, "--set", f"train.output_dir={out}", "--set", "log.progress=false", "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, **(env or {}), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.getcwd())
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise SystemExit(f"mmpipe bench: run failed: {' '.join(cmd)}\n{tail}")
    return proc.stdout + proc.stderr


def run_worker(script: str, nprocs: int, spec: dict, tmp: str, what: str) -> None:
    """``deepspeed --num_gpus nprocs mmpipe/bench/<script> <spec.json>``: a bench's own worker on ``spec``
    (written to ``tmp``); the bench stops with the worker's last lines when it fails (``what``: in that line)."""
    import json
    path = os.path.join(tmp, os.path.splitext(script)[0] + "_spec.json")
    with open(path, "w") as fh:
        json.dump(spec, fh)
    cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(nprocs), "--master_port", str(free_port()),
           os.path.join(ROOT, "mmpipe", "bench", script), path]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"mmpipe bench: {what} failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:]))


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

One section per bench. `mmpipe bench NAME` files its result at the end of the `NAME` section (a bench
without one gets a new section at the end), in place of that section's earlier result of the same title
and subject (the command without its how-long flags): each section holds the latest result of each
variant, oldest first. Every run, oldest first, is in
[docs/benchmarks/history.md](docs/benchmarks/history.md). Each entry names the command that wrote it,
the machine, and ratios against a baseline measured **in the same run**. Absolute times on a shared
2-core CPU machine are noise; read the ratios. CPU runs are multi-process (`deepspeed --num_gpus N` on
the CPU accelerator with gloo); GPU entries say so.
"""
HISTORY_INTRO = "# Benchmark history\n\nEvery `mmpipe bench` result, oldest first (the latest of each: BENCHMARKS.md).\n"
_SECTION = re.compile(r"^## (\S.*?)\s*$")  # a bench's section in BENCHMARKS.md
_ENTRY = re.compile(r"^### (.*?) \((\d{4}-\d{2}-\d{2}[^)]*)\)\s*$")  # one result in it


def append_benchmarks(title: str, command: str, table: str, notes: str, root: str = None) -> None:
    """Append a result to the history and file it at the end of its bench's section of BENCHMARKS.md."""
    root = root or os.getcwd()
    history = os.path.join(root, HISTORY)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    entry = f"{title} ({stamp})\n\n`{command}`\n\nMachine: {machine()}\n\n{table}\n\n{notes}\n"
    os.makedirs(os.path.dirname(history), exist_ok=True)
    if not os.path.isfile(history):
        with open(history, "w") as fh:
            fh.write(HISTORY_INTRO)
    with open(history, "a") as fh:
        fh.write(f"\n## {entry}")
    bench = bench_name(command)
    file_result(os.path.join(root, "BENCHMARKS.md"), bench, "### " + entry)
    print(f"appended to {history}; BENCHMARKS.md: at the end of its section '{bench}'")


def bench_name(command: str) -> str:
    """The bench a result belongs to, read from the command that wrote it:
    ``mmpipe bench overhead --rounds 3`` -> ``overhead``."""
    m = re.search(r"\bmmpipe bench (\S+)", command)
    return m.group(1) if m else "other"


def bench_sections(text: str) -> dict:
    """BENCHMARKS.md's ``## bench`` sections in order: {bench: its blocks}, each block a ``### title
    (stamp)`` result (or the text before the first one); what precedes the first section is dropped."""
    out, blocks = {}, None
    for line in text.splitlines(keepends=True):
        m = _SECTION.match(line)
        if m:
            blocks = out.setdefault(m.group(1), [""])
        elif blocks is not None:
            if _ENTRY.match(line):
                blocks.append("")
            blocks[-1] += line
    return out


_HOW_LONG = re.compile(r"\s--(steps|warmup|rounds|repeats|n)\s+\d+|\s--refresh\b")


def _subject(section: str) -> str:
    """What a bench section measured: its command without the how-long flags (steps, rounds...)."""
    m = re.search(r"^`(mmpipe bench [^`]*)`", section, re.M)
    return _HOW_LONG.sub("", m.group(1)).strip() if m else ""


def _variant(block: str):
    """(title, subject) of a result block; None for text that is no result."""
    m = _ENTRY.match(block.split("\n", 1)[0])
    return (m.group(1), _subject(block)) if m else None


def file_result(path: str, bench: str, entry: str) -> None:
    """Rewrite BENCHMARKS.md with ``entry`` last in the ``## bench`` section (a new section goes last),
    the same variant's earlier result in that section dropped, and the contents list redrawn."""
    benches = {}
    if os.path.isfile(path):
        with open(path) as fh:
            benches = bench_sections(fh.read())
    blocks = benches.setdefault(bench, [""])
    blocks[:] = [b for b in blocks if _variant(b) != _variant(entry)] + [entry]
    contents = "".join(f"- [{name}](#{re.sub(r'[^a-z0-9_ -]', '', name.lower()).replace(' ', '-')}): "
                       + "; ".join(dict.fromkeys(v[0] for v in map(_variant, blocks) if v)) + "\n"
                       for name, blocks in benches.items())
    body = "".join(f"\n## {name}\n" + "".join("\n" + b.strip("\n") + "\n" for b in blocks if b.strip())
                   for name, blocks in benches.items())
    with open(path, "w") as fh:
        fh.write(INTRO + "\nContents:\n\n" + contents + body)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
