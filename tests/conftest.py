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
TINY_VLM = os.path.join(ROOT, "configs", "tiny_vlm.yaml")
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


@pytest.fixture(scope="session")
def tiny_chat_data(tmp_path_factory):
    """70 synthetic chat samples (ms-swift JSONL; about a third text-only, so some micro-batches
    hold no image) + three unusable lines: a missing image, a corrupt JPEG, an <image> count that
    does not match the images."""
    from mmpipe.data.synth import synth_vlm
    out = tmp_path_factory.mktemp("tinychat")
    info = synth_vlm(str(out), 70, val_fraction=0.1, size=32, seed=1, text_only=0.3, progress=False)
    with open(out / "images" / "corrupt.jpg", "wb") as fh:
        fh.write(b"\xff\xd8\xff\xe0 this is not a jpeg at all" * 3)
    turn = [{"role": "user", "content": "<image>\nwhat colour is the shape?"}, {"role": "assistant", "content": "red"}]
    with open(info["train"], "a") as fh:
        fh.write(json.dumps({"messages": turn, "images": ["images/does_not_exist.jpg"]}) + "\n")
        fh.write(json.dumps({"messages": turn, "images": ["images/corrupt.jpg"]}) + "\n")
        fh.write(json.dumps({"messages": turn, "images": []}) + "\n")
    return {"dir": str(out), "train": info["train"], "val": info["val"]}


def _env(extra=None):
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if extra and extra.get("MMPIPE_PLUGINS"):  # a family defined in a test module: tests/ on the path
        env["PYTHONPATH"] = os.path.join(ROOT, "tests") + os.pathsep + env["PYTHONPATH"]
    env.update(extra or {})
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def launch(nprocs: int, args: list, launcher: str = "deepspeed", timeout: int = 600,
           env: dict = None) -> subprocess.CompletedProcess:
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
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc


class Runs:
    """Lazily launched, cached training runs (each multi-process launch costs ~10-20 s here)."""

    def __init__(self, tmp, data, config: str = TINY, env: dict = None):
        self.tmp, self.data, self.cache, self.config, self.env = tmp, data, {}, config, env

    def base(self, out: str, *extra) -> list:
        return ["--config", self.config, "--set", f"data.train={self.data['train']}", "--set", f"data.val={self.data['val']}",
                "--set", f"train.output_dir={out}", "--set", "train.steps=6", "--set", "train.keep_checkpoints=0",
                *extra]

    def get(self, key: str, nprocs: int, sets: list, launcher="deepspeed", flags=()):
        if key not in self.cache:
            out = str(self.tmp / key)
            args = self.base(out)
            for s in sets:
                args += ["--set", s]
            proc = launch(nprocs, args + list(flags), launcher, env=self.env)
            self.cache[key] = (out, proc)
        return self.cache[key]

    def resume(self, key: str, nprocs: int, sets: list):
        """Run to step 3 (--stop-at 3), then --resume to the end in the same output dir."""
        if key not in self.cache:
            out = str(self.tmp / key)
            args = self.base(out)
            for s in sets:
                args += ["--set", s]
            launch(nprocs, args + ["--stop-at", "3"], env=self.env)
            proc = launch(nprocs, args + ["--resume"], env=self.env)
            self.cache[key] = (out, proc)
        return self.cache[key]


@pytest.fixture(scope="session")
def runs(tmp_path_factory, tiny_data):
    return Runs(tmp_path_factory.mktemp("runs"), tiny_data)


# Model families the shared grouped-clipping tests run on: name -> the module that registers it
# (None: built in). A plugin module defines its family and ``FAMILY_CONFIG`` (a tiny run config).
FAMILIES = {"clip": None, "toy": "test_toy_family"}
# ... and the layout-parity and resume tests (the VLM: its tiny config, on chat data)
PARITY_FAMILIES = {**FAMILIES, "vlm": None}


@pytest.fixture(scope="session")
def family_runs_of(tmp_path_factory, tiny_data, tiny_chat_data, runs):
    """family name -> its Runs (CLIP's are the shared ``runs``)."""
    cache = {"clip": runs}

    def get(name: str) -> Runs:
        if name not in cache:
            d = tmp_path_factory.mktemp(f"runs_{name}")
            if name == "vlm":
                cache[name] = Runs(d, tiny_chat_data, TINY_VLM)
                return cache[name]
            import importlib
            module = FAMILIES[name]
            cfg = d / f"{name}.yaml"
            cfg.write_text(importlib.import_module(module).FAMILY_CONFIG)
            cache[name] = Runs(d, tiny_data, str(cfg), env={"MMPIPE_PLUGINS": module})
        return cache[name]
    return get


@pytest.fixture(params=list(FAMILIES))
def family(request):
    """A registered family's name; tests taking it run once per family."""
    if FAMILIES[request.param]:
        import importlib
        importlib.import_module(FAMILIES[request.param])
    return request.param


@pytest.fixture(params=list(PARITY_FAMILIES))
def parity_family(request):
    if PARITY_FAMILIES[request.param]:
        import importlib
        importlib.import_module(FAMILIES[request.param])
    return request.param


def train_losses(out: str) -> list:
    from mmpipe.train.metrics import read_metrics
    return [r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))]
