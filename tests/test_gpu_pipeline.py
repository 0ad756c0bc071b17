"""``mmpipe bench gpu --pipeline`` at tiny size on this CPU (the form a GPU session runs at real size): P = 2
against P = 1 on the same device, every gradient compared by name (``log.grads``), launched as the one-GPU form
launches (both ranks LOCAL_RANK 0); where two ranks can run; and the gradient comparison's power to see the
accumulation bugs the bench exists for."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import mmpipe
from mmpipe.bench.gpu_pipeline import GRAD_RTOL, two_rank_plan
from mmpipe.errors import MmpipeError
from mmpipe.train.grad_dump import compare_grads, grad_norm_of


def test_two_ranks_go_to_two_devices_or_share_one_with_a_recent_nccl():
    assert two_rank_plan("cuda", 2, (2, 27, 3))["local_ranks"] == [0, 1]
    shared = two_rank_plan("cuda", 1, (2, 30, 7))
    assert shared["local_ranks"] == [0, 0] and shared["env"] == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    assert two_rank_plan("cuda", 2, (2, 30, 7), share=True)["local_ranks"] == [0, 0]
    with pytest.raises(MmpipeError, match=r"NCCL >= 2\.30 .* torch has NCCL 2\.27\.3: pip install"):
        two_rank_plan("cuda", 1, (2, 27, 3))
    assert two_rank_plan("cpu", 0, None)["local_ranks"] == [0, 1]
    assert two_rank_plan("cpu", 0, None, share=True)["local_ranks"] == [0, 0]


def test_the_gradient_comparison_sees_a_scaled_stage_and_a_single_micro_batch():
    g = torch.Generator().manual_seed(0)
    micro = [{"vision.w": torch.randn(8, 8, generator=g), "llm.w": torch.randn(8, 8, generator=g),
              "llm.k_proj.bias": torch.randn(8, generator=g) * 1e-9} for _ in range(8)]
    want = {k: sum(m[k] for m in micro) / 8 for k in micro[0]}
    floor = 1e-4 * grad_norm_of(want)
    noisy = {k: v + 1e-3 * v.abs().max() * torch.randn(v.shape, generator=g) for k, v in want.items()}
    assert compare_grads(noisy, want, floor)["worst"][1] < GRAD_RTOL  # rounding, and a bias with no gradient
    layers = ["vision", "llm"]
    assert compare_grads(noisy, want, floor, layers)["worst_layer"][1] < GRAD_RTOL
    scaled = dict(want, **{"vision.w": want["vision.w"] / 64})  # the earlier stage at 1/GAS^2 (DeepSpeed#8152)
    assert compare_grads(scaled, want, floor)["worst"] == ("vision.w", pytest.approx(63 / 64))
    assert compare_grads(scaled, want, floor, layers)["worst_layer"] == ("vision", pytest.approx(63 / 64))
    last = {k: v / 8 for k, v in micro[-1].items()}  # only the last micro-batch trained (Automodel#3530)
    assert compare_grads(last, want, floor, layers)["worst_layer"][1] > 0.5
    assert compare_grads({"llm.w": want["llm.w"]}, want)["missing"] == ["llm.k_proj.bias", "vision.w"]


def test_log_grads_takes_step_numbers():
    with pytest.raises(mmpipe.errors.ConfigError, match=r"log.grads must be a list of step numbers"):
        mmpipe.load_config("configs/tiny.yaml", ["log.grads=[0]"])


def test_pipeline_bench_holds_p2_to_p1_at_accumulation_8_with_the_one_device_launch(tmp_path):
    """Qwen2.5-VL (shapes differ per micro-batch and between stages), packed rows attended by their span
    boundaries across the cut (model.attention=varlen), bf16, accumulation 8: every step's loss and every
    gradient of P = 2 within bf16 tolerance of P = 1, both stages timed, the memory model per stage, a timeline."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mmpipe.cli.main", "bench", "gpu", "--pipeline", "--tiny", "--jobs",
                           "qwen_full", "--accumulation", "8", "--share-device", "--steps", "2", "--attention",
                           "varlen", "--no-append", "--out", str(out), "--timeout", "400"],
                          capture_output=True, text=True, cwd=str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((out / "pipeline_results.json").read_text())
    assert "both LOCAL_RANK 0" in rec["where"] and not rec["failures"]
    [r] = rec["results"]
    assert r["ok"] and r["accumulation"] == 8 and len(r["losses_p1"]) == len(r["losses_p2"]) == 2
    assert r["loss_rel"] <= 1e-2
    for g in r["grads"].values():  # every trainable parameter of both stages, none missing
        assert g["count"] > 50 and not g["missing"] and not g["extra"] and g["worst_layer"][1] <= GRAD_RTOL
        assert g["norm_p1"] > 0 and abs(g["norm_p2"] / g["norm_p1"] - 1) < 1e-2
    assert [s["stage"] for s in r["stages"]] == [0, 1]
    assert all(s["predicted_mb"] > 0 and s["fwd_ms"] > 0 and s["bwd_ms"] > 0 for s in r["stages"])
    assert (out / "pipeline_qwen_full_gas8_timeline.png").stat().st_size > 1000
    assert "| qwen_full | 8 |" in proc.stdout


def test_the_gpu_session_script_runs_its_commands_at_tiny_size(tmp_path):
    """``launch/gpu_checks.sh`` (what a session lent a GPU runs): its attention part at tiny size on this CPU,
    BENCHMARKS.md untouched; every part's command line parses."""
    import os
    from helpers import ROOT, _env
    env = _env({"TINY": "1", "NO_APPEND": "1", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable})
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "gpu_checks.sh"), "attention"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| spans |" in proc.stdout and "not run: CUDA only" in proc.stdout
    from mmpipe.cli.main import build_parser
    parser = build_parser()
    for argv in (["bench", "gpu", "--pipeline", "--attention", "varlen", "--out", "o", "--timeout", "300"],
                 ["bench", "gpu", "--jobs", "vlm_lora", "qwen_lora", "--attention", "varlen", "sdpa", "--out", "o"],
                 ["bench", "attention", "--shape", "qwen"]):
        assert parser.parse_args(argv).func
