"""Runs that survive faults (multi-process, CPU + gloo, real signals and abrupt exits): a SIGTERM to
one rank stops every rank at a step boundary with a checkpoint; a rank dying in the middle of a
checkpoint leaves ``latest`` on the previous complete one; a non-finite gradient on one rank skips
the step on every rank; ``train.max_bad_steps`` stops the run with one line."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from mmpipe.bench.common import free_port
import torch
from helpers import ROOT, TRAIN_PY, _env
from helpers import launch as _launch
from test_parity import REF, assert_weights_close, reference

from mmpipe.train.checkpoint_weights import load_model_weights
from mmpipe.train.metrics import read_metrics


def launch(nprocs, args, launcher="deepspeed-cli", **kw):
    """Faults and signals under the ``deepspeed`` command itself (its launcher's own handling of a rank that
    dies is part of what these tests check)."""
    return _launch(nprocs, args, launcher, **kw)


def _latest(out):
    return open(os.path.join(out, "checkpoints", "latest")).read().strip()


def _by_step(out):
    """step -> loss, the last record of each step (a resumed run logs the steps after its checkpoint again)."""
    return {r["step"]: r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))}


def _rank_pid(out: str, local_rank: int) -> int:
    ps = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True).stdout
    for line in ps.splitlines():
        pid, args = line.strip().split(" ", 1)
        if f"--local_rank={local_rank}" in args and out in args and "train.py" in args:
            return int(pid)
    raise AssertionError(f"no rank {local_rank} process for {out}")


def _wait_for_step(proc, out: str, step: int) -> None:
    """Until the run in ``out`` has logged ``step`` (it must still be running then)."""
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.isfile(metrics) and any(f'"step": {step},' in line for line in open(metrics)):
            break
        time.sleep(0.1)
    assert proc.poll() is None


def test_sigterm_to_one_rank_stops_every_rank_at_a_step_boundary(runs, tmp_path):
    out = str(tmp_path / "preempted")
    steps = 2000  # far more than the test waits for: the signal arrives mid-training
    args = runs.base(out) + ["--set", "parallel.pipeline_stages=2", "--set", f"train.steps={steps}"]
    port = str(free_port())
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", port, TRAIN_PY] + args
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_step(proc, out, 3)
    os.kill(_rank_pid(out, 1), signal.SIGTERM)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, log[-3000:]  # 128 + SIGTERM: stopped with a checkpoint, not finished
    stopped = [line for line in log.splitlines() if "stopped at step" in line]
    assert len(stopped) == 1 and "by SIGTERM (rank 1)" in stopped[0], log[-3000:]
    k = int(stopped[0].split("stopped at step ")[1].split()[0])
    assert 3 <= k < steps and _latest(out) == f"global_step{k}"
    end = k + 3  # resume for three steps; the straight run (same config) stops there too
    launch(2, args + ["--resume", "--stop-at", str(end)])
    straight = str(tmp_path / "straight")
    launch(2, runs.base(straight) + ["--set", "parallel.pipeline_stages=2", "--set", f"train.steps={steps}",
                                     "--stop-at", str(end)])
    got, want = _by_step(out), _by_step(straight)
    assert sorted(got) == list(range(1, end + 1))
    np.testing.assert_allclose([got[s] for s in range(1, end + 1)], [want[s] for s in range(1, end + 1)], rtol=1e-6)
    assert_weights_close(load_model_weights(os.path.join(out, "checkpoints"), f"global_step{end}"),
                         load_model_weights(os.path.join(straight, "checkpoints"), f"global_step{end}"),
                         rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_ctrl_c_under_a_launcher_stops_with_a_complete_checkpoint(runs, tmp_path, launcher):
    """Ctrl-C: SIGINT to the launcher's whole process group. Under ``deepspeed`` each rank gets it
    and, at once, a SIGTERM from DeepSpeed's launch.py: one stop request, so every rank stops at the
    next step boundary with a complete checkpoint and exits 130 (the launchers' own exit status after a
    Ctrl-C is theirs: DeepSpeed's launch.py exits 1 from its signal handler)."""
    out = str(tmp_path / f"ctrl_c_{launcher}")
    args = runs.base(out) + ["--set", "parallel.pipeline_stages=2", "--set", "train.steps=2000"]
    port = str(free_port())
    head = (["deepspeed", "--num_gpus", "2", "--master_port", port] if launcher == "deepspeed" else
            ["torchrun", "--nproc_per_node", "2", "--master_port", port])
    proc = subprocess.Popen(head + [TRAIN_PY] + args, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _wait_for_step(proc, out, 3)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    log, _ = proc.communicate(timeout=120)
    stopped = [line for line in log.splitlines() if "stopped at step" in line]
    assert len(stopped) == 1 and "by SIGINT" in stopped[0], log[-3000:]
    k = int(stopped[0].split("stopped at step ")[1].split()[0])
    assert _latest(out) == f"global_step{k}"
    assert os.path.isfile(os.path.join(out, "checkpoints", f"global_step{k}", "COMPLETE"))
    assert not [line for line in log.splitlines() if line.startswith("mmpipe: ")], log[-3000:]  # no error
    if launcher == "torchrun" and "OMP_NUM_THREADS" not in os.environ:  # torchrun's default is not the user's
        assert "OMP_NUM_THREADS=1 came from the launcher" in log, log[-3000:]


def test_a_rank_dying_while_saving_leaves_latest_on_the_complete_checkpoint(runs, tmp_path):
    """Rank 1 exits abruptly (os._exit, as kill -9) inside the step-4 checkpoint: the other rank
    stops within the bound, ``latest`` still names step 2, and --resume from it reproduces the
    straight run."""
    out = str(tmp_path / "died")
    args = runs.base(out)
    for s in REF[2]:
        args += ["--set", s]
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="launch failed") as e:
        launch(2, args, env={"MMPIPE_TEST_DIE_IN_SAVE": "4:1"})
    assert time.monotonic() - t0 < 120  # start-up (~15 s) + 4 steps + the survivor's exit
    lines = [line for line in str(e.value).splitlines() if line.startswith("mmpipe: [rank 0] stopped")]
    assert len(lines) == 1 and re.search(r"stopped: rank 1 \(pid \d+\) is gone", lines[0]), str(e.value)[-3000:]
    ck = os.path.join(out, "checkpoints")
    assert _latest(out) == "global_step2"
    assert not os.path.isfile(os.path.join(ck, "global_step4", "COMPLETE"))
    proc = launch(2, args + ["--resume"])
    assert "removed the incomplete checkpoint" in proc.stdout + proc.stderr
    ref = reference(runs)
    got, want = _by_step(out), _by_step(ref)
    np.testing.assert_allclose([got[s] for s in range(1, 7)], [want[s] for s in range(1, 7)], rtol=1e-6)
    assert_weights_close(load_model_weights(ck, "global_step6"),
                         load_model_weights(os.path.join(ref, "checkpoints"), "global_step6"), rtol=1e-6, atol=1e-7)


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(runs, tmp_path):
    out = str(tmp_path / "nan3")
    args = runs.base(out) + ["--set", "parallel.pipeline_stages=2", "--set", "train.save_every=1", "--stop-at", "4"]
    launch(2, args, env={"MMPIPE_TEST_NAN_GRAD": "3:1"})
    ck = os.path.join(out, "checkpoints")
    recs = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["skipped"] for r in recs] == [False, False, True, False]
    assert recs[-1]["skipped_steps"] == 1
    w2, w3, w4 = (load_model_weights(ck, f"global_step{s}") for s in (2, 3, 4))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)  # no weight changed at the skipped step ...
    assert any(not torch.equal(w3[k], w4[k]) for k in w3)  # ... and the next step trains again
    for rank in (0, 1):  # nor any optimizer state (both Adam moments, step counts)
        a = torch.load(os.path.join(ck, "global_step2", f"mp_rank_0{rank}_model_states.pt"), weights_only=False)
        b = torch.load(os.path.join(ck, "global_step3", f"mp_rank_0{rank}_model_states.pt"), weights_only=False)
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        assert sa.keys() == sb.keys() and sa
        assert all(torch.equal(torch.as_tensor(sa[i][f]), torch.as_tensor(sb[i][f])) for i in sa for f in sa[i])


def test_max_bad_steps_stops_the_run_with_one_line(runs, tmp_path):
    out = str(tmp_path / "nan_run")
    args = runs.base(out) + ["--set", "parallel.pipeline_stages=2", "--set", "train.max_bad_steps=2"]
    with pytest.raises(AssertionError) as e:
        launch(2, args, env={"MMPIPE_TEST_NAN_GRAD": "2-:0"})
    lines = [line for line in str(e.value).splitlines() if line.startswith("mmpipe: ")]
    assert len(lines) == 1 and "step 3: 2 consecutive steps skipped for non-finite gradients" in lines[0], lines
    assert "grad_norm.vision=nan" in lines[0]


@pytest.mark.parametrize("damage,sets,expect", [
    ("truncate", [], "cannot read"),
    (None, ["model.projection_dim=24"], "was saved by another model config (model.projection_dim: 32 saved, 24 now)"),
    ("remove", [], "--resume: no checkpoint in"),
])
def test_unusable_checkpoints_are_one_line(runs, tmp_path, damage, sets, expect):
    import shutil
    ref = reference(runs)
    out = str(tmp_path / "copy")
    shutil.copytree(ref, out)
    if damage == "truncate":
        for f in os.listdir(os.path.join(out, "checkpoints", "global_step6")):
            if f.startswith("layer_"):
                path = os.path.join(out, "checkpoints", "global_step6", f)
                open(path, "r+b").truncate(100)
    if damage == "remove":
        shutil.rmtree(os.path.join(out, "checkpoints"))
    args = runs.base(out) + ["--set", "parallel.pipeline_stages=1", "--set", "train.steps=8"]
    for s in sets:
        args += ["--set", s]
    with pytest.raises(AssertionError) as e:
        launch(1, args + ["--resume"], "python")
    lines = [line for line in str(e.value).splitlines() if line.startswith("mmpipe: ")]
    where = os.path.join(out, "checkpoints") if damage == "remove" else "global_step6"
    assert len(lines) == 1 and expect in lines[0] and where in lines[0], str(e.value)[-2000:]
    assert "Traceback" not in str(e.value)
