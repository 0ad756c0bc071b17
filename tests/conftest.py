"""Shared fixtures: a tiny synthetic data set (with one missing and one corrupt image), the tiny
config, and the multi-process runs, each launched once per session and shared by the tests."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
TRAIN_PY = os.path.join(ROOT, "launch", "train.py")
ACCEL_YAML = os.path.join(ROOT, "launch", "accelerate", "cpu_2proc.yaml")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """80 synthetic pairs + a missing image and a corrupt JPEG in the training manifest."""
    from mmpipe.data.synth import synth
    out = tmp_path_factory.mktemp("tinydata")
    info = synth(str(out), 80, val_fraction=0.1, size=48, seed=1, progress=False)
    with open(out / "images" / "corrupt.jpg", "wb") as fh:
        fh.write(b"\xff\xd8\xff\xe0 this is not a jpeg at all" * 3)
    with open(info["train"], "a") as fh:
        fh.write(json.dumps({"image": "images/does_not_exist.jpg", "text": "a small red circle"}) + "\n")
        fh.write(json.dumps({"image": "images/corrupt.jpg", "text": "a large blue square"}) + "\n")
    return {"dir": str(out), "train": info["train"], "val": info["val"]}


def _env():
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def launch(nprocs: int, args: list, launcher: str = "deepspeed", timeout: int = 600) -> subprocess.CompletedProcess:
    """Run launch/train.py under the given launcher; return the completed process (output kept)."""
    if launcher == "python":
        cmd = [sys.executable, TRAIN_PY] + args
    elif launcher == "accelerate":
        cmd = [shutil.which("accelerate") or "accelerate", "launch", "--config_file", ACCEL_YAML,
               "--num_processes", str(nprocs), TRAIN_PY] + args
    else:
        port = str(29500 + (os.getpid() % 1000) + nprocs * 7)
        cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(nprocs), "--master_port", port,
               TRAIN_PY] + args
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc


class Runs:
    """Lazily launched, cached training runs (each multi-process launch costs ~10-20 s here)."""

    def __init__(self, tmp, data):
        self.tmp, self.data, self.cache = tmp, data, {}

    def base(self, out: str, *extra) -> list:
        return ["--config", TINY, "--set", f"data.train={self.data['train']}", "--set", f"data.val={self.data['val']}",
                "--set", f"train.output_dir={out}", "--set", "train.steps=6", "--set", "train.keep_checkpoints=0",
                *extra]

    def get(self, key: str, nprocs: int, sets: list, launcher="deepspeed", flags=()):
        if key not in self.cache:
            out = str(self.tmp / key)
            args = self.base(out)
            for s in sets:
                args += ["--set", s]
            proc = launch(nprocs, args + list(flags), launcher)
            self.cache[key] = (out, proc)
        return self.cache[key]

    def resume(self, key: str, nprocs: int, sets: list):
        """Run to step 3 (--stop-at 3), then --resume to the end in the same output dir."""
        if key not in self.cache:
            out = str(self.tmp / key)
            args = self.base(out)
            for s in sets:
                args += ["--set", s]
            launch(nprocs, args + ["--stop-at", "3"])
            proc = launch(nprocs, args + ["--resume"])
            self.cache[key] = (out, proc)
        return self.cache[key]


@pytest.fixture(scope="session")
def runs(tmp_path_factory, tiny_data):
    return Runs(tmp_path_factory.mktemp("runs"), tiny_data)


def train_losses(out: str) -> list:
    from mmpipe.metrics import read_metrics
    return [r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))]
