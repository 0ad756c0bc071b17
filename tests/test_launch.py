"""Launchers: multi-node without ssh (two launcher invocations on this machine as node 0 and
node 1), plain torchrun, and `accelerate launch` settings honoured like the DeepSpeed JSON.

Multi-process tests reuse the single-node P = 2 reference of test_parity (launched once per
session) and stop after a few steps."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import yaml
from helpers import ACCEL_YAML, ROOT, TINY, TRAIN_PY, _env, train_losses
from test_parity import REF

from mmpipe.bench.common import free_port
from mmpipe.config.deepspeed import resolve
from mmpipe.config.schema import load_config
from mmpipe.errors import ConfigError

RUN_DS = os.path.join(ROOT, "launch", "run_deepspeed.sh")


def _ref_args(runs, out: str, stop: int) -> list:
    """The reference run's arguments, in another output dir, stopping after ``stop`` steps."""
    args = runs.base(out)
    for s in REF[2]:
        args += ["--set", s]
    return args + ["--stop-at", str(stop)]


def _tail(proc_out: str) -> str:
    return "\n".join(proc_out.splitlines()[-40:])


# ---------------------------------------------------------------------------------------------
# multi-node without ssh, torchrun
# ---------------------------------------------------------------------------------------------
def test_two_nodes_without_ssh_and_torchrun_reproduce_single_node(runs, tmp_path):
    """docs/launching.md's no-ssh multi-node line, as node 0 and node 1 on this machine (1 rank each):
    P = 2 across the two "nodes" trains exactly like the single-node P = 2 reference; so does
    a plain single-node torchrun."""
    ref = runs.get(*REF)[0]
    out = str(tmp_path / "two_nodes")
    port = str(free_port())
    procs = []
    for node in (0, 1):
        env = _env()
        # one thread per rank, like the reference (2 ranks on this machine's cores)
        env.update(NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(["bash", RUN_DS] + _ref_args(runs, out, 3), cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=400)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for node, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} failed ({p.returncode}):\n{_tail(o)}"
    losses = train_losses(out)
    assert len(losses) == 3
    np.testing.assert_allclose(losses, train_losses(ref)[:3], rtol=1e-6)

    # and plain single-node `torchrun --nproc_per_node 2 launch/train.py` (no --local_rank argument)
    out = str(tmp_path / "torchrun")
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--nproc_per_node", "2", "--master_port", str(free_port()), TRAIN_PY] + _ref_args(runs, out, 2)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, _tail(proc.stdout + proc.stderr)
    np.testing.assert_allclose(train_losses(out), train_losses(ref)[:2], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# accelerate launch: the YAML's DeepSpeed settings (exported as ACCELERATE_* variables)
# ---------------------------------------------------------------------------------------------
ACC_VARS = ("ACCELERATE_CONFIG_DS_FIELDS", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION",
            "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_GRADIENT_CLIPPING",
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "ACCELERATE_DEEPSPEED_ZERO3_INIT",
            "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL")


@pytest.fixture
def accel(monkeypatch):
    """Set the variables `accelerate launch` exports for a DeepSpeed YAML: ``accel(zero_stage="1", ...)``;
    the YAML fields are listed in ACCELERATE_CONFIG_DS_FIELDS, as Accelerate does."""
    for k in ACC_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")

    names = {"zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE", "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
             "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
             "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
             "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
             "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
             "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT"}

    def set_(mixed_precision=None, **fields):
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        listed = ["deepspeed_multinode_launcher"] + list(fields)
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", mixed_precision or "no")
        if mixed_precision is not None:
            listed.append("mixed_precision")
        for k, v in fields.items():
            monkeypatch.setenv(names[k], str(v))
        monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(listed))
    return set_


def _cfg(*sets):
    return load_config(TINY, list(sets))


def test_accelerate_settings_fill_the_run_config(accel):
    accel(mixed_precision="bf16", zero_stage=1, gradient_clipping=0.5, gradient_accumulation_steps=4,
          deepspeed_config_file="ds_configs/auto.json")
    cfg = _cfg()
    ds, topo = resolve(cfg, 2)
    assert cfg.train.precision == "bf16" and cfg.parallel.zero_stage == 1 and cfg.optim.max_grad_norm == 0.5
    assert cfg.train.deepspeed_config == "ds_configs/auto.json"
    assert ds["bf16"]["enabled"] is True and ds["zero_optimization"]["stage"] == 1
    assert ds["gradient_accumulation_steps"] == topo.accumulation_steps == 4
    # a second resolve (micro_batch_size=auto resolves again) adopts nothing new and raises nothing
    assert resolve(cfg, 2)[0] == ds


def test_accelerate_unset_fields_leave_the_run_config_alone(accel):
    accel(zero_stage=1)  # YAML without mixed_precision: Accelerate exports "no", which does not count as set
    cfg = _cfg("train.precision=bf16")
    ds, _ = resolve(cfg, 2)
    assert cfg.train.precision == "bf16" and ds["bf16"]["enabled"] is True
    assert cfg.parallel.zero_stage == 1 and cfg.train.deepspeed_config is None and cfg.optim.max_grad_norm is None


def test_accelerate_settings_agreeing_with_the_run_config_and_json(accel):
    # the same bf16 + ZeRO-1 in the Accelerate YAML, its DeepSpeed JSON and the run config
    accel(mixed_precision="bf16", zero_stage=1, gradient_accumulation_steps=4,
          deepspeed_config_file=os.path.join(ROOT, "ds_configs", "zero1_bf16.json"))
    cfg = _cfg("train.precision=bf16", "parallel.zero_stage=1")
    ds, _ = resolve(cfg, 2)
    assert cfg.train.deepspeed_config.endswith("zero1_bf16.json")
    assert cfg.parallel.zero_stage == 1 and ds["zero_optimization"]["stage"] == 1 and ds["bf16"]["enabled"] is True


@pytest.mark.parametrize("fields,sets,names", [
    ({"mixed_precision": "bf16"}, ["train.precision=fp32"], ("mixed_precision", "train.precision")),
    ({"mixed_precision": "no"}, ["train.precision=bf16"], ("mixed_precision", "train.precision")),
    ({"zero_stage": 1}, ["parallel.zero_stage=0"], ("zero_stage", "parallel.zero_stage")),
    ({"gradient_clipping": 0.5}, ["optim.max_grad_norm=1.0"], ("gradient_clipping", "optim.max_grad_norm")),
    ({"deepspeed_config_file": "ds_configs/auto.json"}, ["train.deepspeed_config=ds_configs/zero1_bf16.json"],
     ("deepspeed_config_file", "train.deepspeed_config")),
    # accumulation is derived: batch 16 / (micro 4 x DP 1) = 4
    ({"gradient_accumulation_steps": 1}, [], ("gradient_accumulation_steps", "train.batch_size")),
])
def test_accelerate_conflict_is_one_line_naming_both(accel, fields, sets, names):
    accel(**fields)
    with pytest.raises(ConfigError) as e:
        resolve(_cfg(*sets), 2)
    msg = str(e.value)
    assert "\n" not in msg and "Accelerate" in msg
    for n in names:
        assert n in msg, msg


def test_accelerate_conflict_with_the_deepspeed_json_names_both(accel):
    # ds_configs/zero1_bf16.json says bf16 + ZeRO-1; the Accelerate YAML says ZeRO 0
    accel(zero_stage=0, deepspeed_config_file="ds_configs/zero1_bf16.json")
    with pytest.raises(ConfigError) as e:
        resolve(_cfg(), 2)
    msg = str(e.value)
    assert "\n" not in msg and "zero_optimization.stage" in msg and "zero_stage" in msg and "Accelerate" in msg


def test_accelerate_offload_without_zero2_is_refused(accel):
    accel(offload_optimizer_device="cpu")
    with pytest.raises(ConfigError, match="offload_optimizer_device"):
        resolve(_cfg("parallel.zero_stage=1"), 2)
    # nor with ZeRO-1 at P = 1: mmpipe's own norms (compute_grad_norm=false) exclude DeepSpeed's offload
    with pytest.raises(ConfigError, match="offload_optimizer_device"):
        resolve(_cfg("parallel.zero_stage=1", "parallel.pipeline_stages=1"), 1)
    accel(offload_optimizer_device="none")  # Accelerate's default: nothing to do
    resolve(_cfg("parallel.zero_stage=1"), 2)


def test_accelerate_offload_goes_into_the_deepspeed_json_for_p1(accel):
    accel(offload_optimizer_device="cpu", zero_stage=2)
    ds, _ = resolve(_cfg("parallel.pipeline_stages=1"), 1)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # nvme: Accelerate does not hand the YAML's nvme path to the ranks; without one in the JSON, one line
    accel(offload_optimizer_device="nvme", zero_stage=2)
    with pytest.raises(ConfigError, match="offload_optimizer.device=nvme needs zero_optimization.offload_optimizer.nvme_path"):
        resolve(_cfg("parallel.pipeline_stages=1"), 1)


def test_accelerate_launch_honours_mixed_precision_and_zero_stage(tiny_data, tmp_path):
    """A new user's Accelerate YAML with mixed_precision: bf16 and zero_stage: 1 trains bf16 with ZeRO-1."""
    with open(ACCEL_YAML) as fh:
        acc = yaml.safe_load(fh)
    acc["mixed_precision"] = "bf16"
    acc.setdefault("deepspeed_config", {})["zero_stage"] = 1
    acc_yaml = tmp_path / "accel.yaml"
    acc_yaml.write_text(yaml.safe_dump(acc))
    out = str(tmp_path / "run")
    args = ["--config", TINY, "--set", f"data.train={tiny_data['train']}", "--set", f"data.val={tiny_data['val']}",
            "--set", f"train.output_dir={out}", "--set", "train.keep_checkpoints=0", "--stop-at", "1"]
    cmd = [shutil.which("accelerate") or "accelerate", "launch", "--config_file", str(acc_yaml),
           "--num_processes", "2", "--main_process_port", str(free_port()), TRAIN_PY] + args
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, _tail(proc.stdout + proc.stderr)
    with open(os.path.join(out, "ds_config.json")) as fh:
        ds = json.load(fh)
    assert ds["bf16"]["enabled"] is True and ds["zero_optimization"]["stage"] == 1
    with open(os.path.join(out, "config.yaml")) as fh:
        saved = yaml.safe_load(fh)
    assert saved["train"]["precision"] == "bf16" and saved["parallel"]["zero_stage"] == 1
    assert "Accelerate" in proc.stdout + proc.stderr  # the adoption is logged
    assert len(train_losses(out)) == 1 and np.isfinite(train_losses(out)).all()


def test_a_taken_rendezvous_port_is_one_line_naming_master_port(tiny_data, tmp_path):
    """The deepspeed launcher's default port already bound (another run): one line naming --master_port,
    not torch's DistNetworkError traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        env = _env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)})
        env["RANK"], env["WORLD_SIZE"] = "0", "1"  # (_env drops them for launchers; this rank is launched)
        proc = subprocess.run([sys.executable, TRAIN_PY, "--config", TINY, "--set", f"data.train={tiny_data['train']}",
                               "--set", f"train.output_dir={tmp_path / 'run'}", "--set", "parallel.pipeline_stages=1"],
                              env=env, capture_output=True, text=True, timeout=300)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("[")]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-2000:]
    assert f"port {port} (MASTER_PORT) is already in use" in err[0] and "--master_port" in err[0]
