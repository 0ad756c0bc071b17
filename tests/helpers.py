"""What tests share besides fixtures: paths, the environment of a launched run, launching one
(DeepSpeed's ranks, the deepspeed command or accelerate), the lazily launched multi-process runs, and reading
a run's losses."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import preloaded_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


TINY = os.path.join(ROOT, "configs", "tiny.yaml")


TINY_VLM = os.path.join(ROOT, "configs", "tiny_vlm.yaml")
# Every built-in family's tiny run config: a new built-in adds its line, and the layout-parity and
# resume tests (conftest's PARITY_FAMILIES) run on it, on the tiny data of its ``data_format``
# (test_structure holds the table to the registry's built-ins)
TINY_CONFIGS = {"clip": TINY, "vlm": TINY_VLM, "qwen2_5_vl": os.path.join(ROOT, "configs", "tiny_qwen2_5_vl.yaml"),
                "qwen3_5": os.path.join(ROOT, "configs", "tiny_qwen3_5.yaml"),
                "qwen3_vl": os.path.join(ROOT, "configs", "tiny_qwen3_vl.yaml"),
                "qwen3_5_moe": os.path.join(ROOT, "configs", "tiny_qwen3_5_moe.yaml"),
                "qwen3_vl_moe": os.path.join(ROOT, "configs", "tiny_qwen3_vl_moe.yaml"),
                "siglip": os.path.join(ROOT, "configs", "tiny_siglip.yaml")}


TRAIN_PY = os.path.join(ROOT, "launch", "train.py")


ACCEL_YAML = os.path.join(ROOT, "launch", "accelerate", "cpu_2proc.yaml")


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
    """Run launch/train.py under the given launcher; return the completed process (output kept).
    ``deepspeed``: the ranks DeepSpeed's single-node launcher starts, started here (``spawn_like_deepspeed``);
    ``deepspeed-cli``: the ``deepspeed`` command itself (the tests of launching, signals and faults)."""
    from mmpipe.bench.common import free_port
    for attempt in range(3):
        port = str(free_port())  # (tests run on two workers: never the launchers' default port)
        if launcher == "deepspeed":
            proc = spawn_like_deepspeed(nprocs, [TRAIN_PY] + args, port, _env(env), timeout)
        else:
            if launcher == "python":
                proc = run_processes([[TRAIN_PY] + args], [_env(env)], timeout)
                break
            if launcher == "accelerate":
                cmd = [shutil.which("accelerate") or "accelerate", "launch", "--config_file", ACCEL_YAML,
                       "--num_processes", str(nprocs), "--main_process_port", port, TRAIN_PY] + args
            else:
                cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(nprocs), "--master_port", port,
                       TRAIN_PY] + args
            proc = subprocess.run(cmd, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=timeout)
        # the port was free when drawn; the other worker's launch may bind it first: draw again
        if not (proc.returncode == 2 and "(MASTER_PORT) is already in use" in proc.stderr):
            break
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"launch failed ({proc.returncode}): {' '.join(proc.args)}\n{tail}")
    return proc


def spawn_like_deepspeed(nprocs: int, script: list, port: str, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """The ranks of ``deepspeed --num_gpus N script`` on one node, without its two launcher processes (the
    runner and ``deepspeed.launcher.launch`` each import DeepSpeed: ~6 s of CPU per launch, a tenth of the
    suite on two cores). The same contract as ``deepspeed.launcher.launch``: MASTER_ADDR / MASTER_PORT,
    WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_SIZE, CROSS_RANK / CROSS_SIZE, the visible-devices variable, ``python
    -u script --local_rank=i``, one output for all ranks, and a rank that exits non-zero takes the others
    down (SIGTERM, as its launcher does) and is the exit status. tests/test_launch.py and test_faults.py run
    the ``deepspeed`` command itself."""
    base = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(nprocs), LOCAL_SIZE=str(nprocs),
                CROSS_RANK="0", CROSS_SIZE="1", CUDA_VISIBLE_DEVICES=",".join(map(str, range(nprocs))))
    return run_processes([script + [f"--local_rank={r}"] for r in range(nprocs)],
                         [dict(base, RANK=str(r), LOCAL_RANK=str(r)) for r in range(nprocs)], timeout)


def run_processes(argvs: list, envs: list, timeout: int) -> subprocess.CompletedProcess:
    """``python -u argv`` for each argv (its environment beside it), one output for all; the first to exit
    non-zero takes the others down (SIGTERM) and is the exit status."""
    import signal
    import tempfile
    import time
    cmd = [sys.executable, "-u"] + argvs[0]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        if FORK_RANKS and all(preloaded_ranks.usable(e) for e in envs):
            procs = [_Forked(preloaded_ranks.start(a, e, ROOT, out, err)) for a, e in zip(argvs, envs)]
        else:
            with open(out, "w") as o, open(err, "w") as e:
                procs = [subprocess.Popen([sys.executable, "-u"] + a, cwd=ROOT, stdout=o, stderr=e, env=v)
                         for a, v in zip(argvs, envs)]
        deadline, code = time.monotonic() + timeout, 0
        try:
            while any(p.poll() is None for p in procs):
                failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
                if failed:
                    code = failed[0]
                    for p in procs:
                        if p.poll() is None:
                            p.send_signal(signal.SIGTERM)
                    break
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                time.sleep(0.05)
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        code = code or next((p.returncode for p in procs if p.returncode), 0)
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(cmd, code, o.read(), e.read())


# Ranks fork from a server that imported torch, DeepSpeed and transformers once (tests/preloaded_ranks.py):
# ~7 s of CPU less per rank. MMPIPE_TEST_FRESH_RANKS=1 starts every rank as a fresh interpreter instead.
FORK_RANKS = os.environ.get("MMPIPE_TEST_FRESH_RANKS") != "1"


class _Forked:
    """A forked rank with subprocess.Popen's face (poll, wait, returncode, send_signal, kill)."""

    def __init__(self, proc):
        self.proc = proc

    @property
    def returncode(self):
        return self.proc.exitcode

    def poll(self):
        return self.proc.exitcode

    def wait(self, timeout=None):
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("rank", timeout)
        return self.proc.exitcode

    def send_signal(self, sig):
        if self.proc.exitcode is None:
            os.kill(self.proc.pid, sig)

    def kill(self):
        self.proc.kill()


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


def train_losses(out: str) -> list:
    from mmpipe.train.metrics import read_metrics
    return [r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))]


# A key projection's bias has no gradient in exact arithmetic (softmax attention is shift-invariant in its
# keys): from 0 it moves only on rounding noise, which Adam scales up, so any change of summation order (a
# data-parallel rank summing its share of the global loss's gradient with the others') leaves it ~1e-6
# elsewhere. Compared at atol 1e-5; every other weight at the test's own tolerance.
NO_GRADIENT = ("self_attn.k_proj.bias", "attention.self.key.bias")


def weight_atol(name: str, atol: float) -> float:
    return max(atol, 1e-5) if name.endswith(NO_GRADIENT) else atol


def assert_same_training(a: str, b: str, steps: int = 4, loss_rtol: float = 1e-5, rtol: float = 1e-4,
                         atol: float = 1e-6) -> None:
    """Runs ``a`` and ``b`` give the same losses for ``steps`` steps and the same weights after them."""
    import numpy as np
    import torch

    from mmpipe.train.checkpoint_weights import load_model_weights
    np.testing.assert_allclose(train_losses(a)[:steps], train_losses(b)[:steps], rtol=loss_rtol)
    wa = load_model_weights(os.path.join(a, "checkpoints"), f"global_step{steps}")
    wb = load_model_weights(os.path.join(b, "checkpoints"), f"global_step{steps}")
    for k in wa:
        torch.testing.assert_close(wa[k].float(), wb[k].float(), rtol=rtol, atol=weight_atol(k, atol),
                                   msg=lambda m: f"{k}: {m}")
