"""Analytic FLOPs per step and MFU / HFU (issue 42 item 2): the families' products agree with torch's
own FLOP counter on the real models (full, frozen tower, LoRA, activation checkpointing, a text-only
VLM micro-batch), a single-process run logs ``tflops`` / ``mfu`` / ``hfu`` from its real micro-batches,
``mmpipe report`` shows them, the peak table and ``log.peak_tflops``."""
from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import TINY, TINY_CONFIGS, TINY_VLM, launch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, sdpa_backward_flop_count, sdpa_flop_count

from mmpipe.cli.main import main
from mmpipe.config.groups import apply_freeze, frozen_layout, resolve_groups
from mmpipe.config.resolve import build_family
from mmpipe.config.schema import load_config
from mmpipe.families.products import MicroBatch
from mmpipe.parallel.layers import set_activation_checkpointing
from mmpipe.parallel.plain import plain_model
from mmpipe.planning.flops import (
    StepCounter,
    device_kind,
    layer_flops,
    peak_tflops,
    training,
    utilization,
)

aten = torch.ops.aten
# torch counts sdpa's CUDA kernels; on the CPU sdpa runs its own flash kernel, counted here by torch's
# formulas for the CUDA ones (QK^T and AV forward, twice that backward)
CPU_SDPA = {aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, **kw: sdpa_flop_count(q, k, v),
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
                lambda g, q, k, v, *a, **kw: sdpa_backward_flop_count(g, q, k, v),
            # torch's convolution_backward formula leaves out ``groups`` (a depthwise conv's input gradient counted
            # as a dense one: x channels): each gradient a convolution wants costs what its forward does
            aten.convolution_backward: lambda g, x, w, bias, stride, padding, dilation, transposed, out_pad, groups, mask,
            *a, **kw: conv_flop_count(x, w, g, transposed) * (int(mask[0]) + int(mask[1]))}


def grouped_mm_flops(a, b, *args, **kw) -> int:
    """``aten._grouped_mm`` (transformers' experts path; torch's counter has no formula for it), from the operands'
    shapes: each group's (m x k) @ (k x n), the groups' rows (or, for a weight's gradient, the shared dimension)
    split by ``offs``."""
    if len(a) == 2 and len(b) == 3:  # tokens (S x K) by each group's weight (K x N)
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:  # (K x S) @ (S x N), S split into groups: a weight's gradient
        return 2 * a[0] * a[1] * b[1]
    return 2 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1)


CPU_SDPA[aten._grouped_mm] = grouped_mm_flops
CLIP_SETS = ["model.text.vocab_size=300", "model.text.max_position_embeddings=16", "model.negatives=micro_batch"]
VLM_SETS = ["model.llm.vocab_size=120", "model.image_token_id=5", "model.llm.max_position_embeddings=64"]
TINY_QWEN = TINY_CONFIGS["qwen2_5_vl"]
TINY_QWEN3_5 = TINY_CONFIGS["qwen3_5"]
QWEN_SETS = ["model.llm.vocab_size=120", "model.image_token_id=5"]
VARIANTS = {
    "clip": (TINY, CLIP_SETS),
    "clip-frozen-vision": (TINY, CLIP_SETS + ["optim.freeze_vision=true"]),
    "clip-lora": (TINY, CLIP_SETS + ["optim.train_type=lora"]),
    "clip-checkpointed": (TINY, CLIP_SETS + ["parallel.activation_checkpointing=all"]),
    "clip-resnet-bert": (TINY, CLIP_SETS + ["model.vision.arch=resnet", "model.vision.hidden_size=null",
                                            "model.vision.num_hidden_layers=null", "model.vision.num_attention_heads=null",
                                            "model.vision.intermediate_size=null", "model.vision.patch_size=null",
                                            "model.text.arch=bert", "model.text.pooling=pooler"]),
    "vlm": (TINY_VLM, VLM_SETS),
    "vlm-frozen-vision": (TINY_VLM, VLM_SETS + ["optim.freeze_vit=true"]),
    "vlm-lora": (TINY_VLM, VLM_SETS + ["optim.train_type=lora"]),
    "vlm-checkpointed": (TINY_VLM, VLM_SETS + ["parallel.activation_checkpointing=all"]),
    "vlm-text-only": (TINY_VLM, VLM_SETS),
    "qwen": (TINY_QWEN, QWEN_SETS),  # 8 x 8 patches each: windows of 4 x 4 (2 x 2 merged tokens)
    "qwen-frozen-vision-lora": (TINY_QWEN, QWEN_SETS + ["optim.freeze_vit=true", "optim.train_type=lora"]),
    "qwen-uneven-windows": (TINY_QWEN, QWEN_SETS),  # 6 x 10 patches: windows of 4 x 4, 4 x 2, 2 x 4, 2 x 2
    "qwen-text-only": (TINY_QWEN, QWEN_SETS),
    # Qwen3.5: GatedDeltaNet blocks (the chunked delta rule: rows of 24 positions padded to its chunk of 64) and
    # a gated full-attention block; packed rows run the linear attention sample by sample (runs of 12)
    "qwen3_5": (TINY_QWEN3_5, QWEN_SETS),
    "qwen3_5-packed": (TINY_QWEN3_5, QWEN_SETS),
    "qwen3_5-long-packed": (TINY_QWEN3_5, QWEN_SETS),  # rows of 150: runs of 75, two chunks each
    "qwen3_5-lora": (TINY_QWEN3_5, QWEN_SETS + ["optim.train_type=lora"]),
    "qwen3_5-checkpointed": (TINY_QWEN3_5, QWEN_SETS + ["parallel.activation_checkpointing=all"]),
    "qwen3_5-text-only": (TINY_QWEN3_5, QWEN_SETS),
    # Qwen3-VL: Qwen3.5's ViT with DeepStack's two mergers, the Qwen3 decoder
    "qwen3_vl": (TINY_CONFIGS["qwen3_vl"], QWEN_SETS),
    "qwen3_vl-lora": (TINY_CONFIGS["qwen3_vl"], QWEN_SETS + ["optim.train_type=lora", "optim.freeze_vit=true"]),
    "qwen3_vl-text-only": (TINY_CONFIGS["qwen3_vl"], QWEN_SETS),
    # the MoE siblings: the router, each token's top-k experts (transformers' grouped products) and Qwen3.5-MoE's
    # shared expert; Qwen3-VL-MoE's dense block 2 its MLP
    "qwen3_5_moe": (TINY_CONFIGS["qwen3_5_moe"], QWEN_SETS),
    "qwen3_vl_moe": (TINY_CONFIGS["qwen3_vl_moe"], QWEN_SETS),
}


def _batch(family, name: str) -> dict:
    batch = family.example_batch(4, 150 if "long" in name else 24, "cpu", **({"grid": (1, 6, 10)} if name == "qwen-uneven-windows" else {}),
                                 **({"packed": True} if name.endswith("packed") else {}))
    if name in ("vlm-text-only", "qwen-text-only", "qwen3_5-text-only", "qwen3_vl-text-only"):  # no images: the vision blocks run on one zero row or
        ids = batch["input_ids"]                       # merge unit (chat.layers.through)
        ids[ids == family.image_token_id] = 0
        batch["pixel_values"] = batch["pixel_values"][:0]
        if "image_grid_thw" in batch:
            batch["image_grid_thw"] = batch["image_grid_thw"][:0]
    return batch


def _counted(name: str) -> tuple:
    """(torch's forward FLOPs, torch's forward + backward FLOPs, the analytic layers) of one
    training micro-batch of the variant's real plain model (frozen groups, forward-only prefix,
    checkpointing as a run applies them)."""
    path, sets = VARIANTS[name]
    cfg = load_config(path, sets)
    family = build_family(cfg)
    groups = resolve_groups(cfg.optim, type(family))
    layout = frozen_layout(family, groups)
    model = plain_model(family, layout[2])
    apply_freeze(model.named_parameters(), groups, lora=family.lora is not None)
    checkpointing = cfg.parallel.activation_checkpointing == "all"
    if checkpointing:
        set_activation_checkpointing(model)
    model.train()
    batch = _batch(family, name)
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as forward:
        loss = model(*(batch[f] for f in family.inputs + family.labels))
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as backward:
        loss.backward()
    layers = layer_flops(family, family.micro_batch(batch), training(family, layout, checkpointing))
    return forward.get_total_flops(), forward.get_total_flops() + backward.get_total_flops(), layers


@pytest.mark.parametrize("name", list(VARIANTS))
def test_analytic_flops_agree_with_torchs_flop_counter(name):
    """Forward FLOPs, and forward + backward: torch counts what the kernels run (the hardware FLOPs:
    sdpa's backward recomputes QK^T, checkpointing its layers' forwards), within 5%; the model
    FLOPs leave those out, so they lie below it by no more than that."""
    fwd, total, layers = _counted(name)
    analytic_fwd = sum(la.forward for la in layers)
    model, hardware = sum(la.model for la in layers), sum(la.hardware for la in layers)
    print(f"{name}: forward {analytic_fwd / fwd:.4f}, hardware {hardware / total:.4f}, model {model / total:.4f} "
          "of torch's count")
    exact = name.startswith("qwen")  # every product counted as torch counts it: no slack for a miscounted span
    assert fwd > 0 and abs(analytic_fwd / fwd - 1) < (1e-9 if exact else 0.05), (analytic_fwd, fwd)
    assert abs(hardware / total - 1) < (1e-9 if exact else 0.05), (hardware, total)
    # (rows of 150: sdpa's backward scores QK^T again, 8% of the step)
    assert model <= hardware and (model / total > 0.95 or "checkpointed" in name or "long" in name), (model, total)


def test_frozen_parts_and_checkpointing_change_the_backward_as_autograd_does():
    full, frozen, lora, ckpt = (_counted(n)[2] for n in ("vlm", "vlm-frozen-vision", "vlm-lora", "vlm-checkpointed"))
    by = lambda ls: {la.name: la for la in ls}  # noqa: E731
    f, z, c = by(full), by(frozen), by(ckpt)
    assert f["llm.blocks.0"].backward == 2 * f["llm.blocks.0"].forward  # trains: input and weight gradients
    assert z["vision.blocks.0"].backward == 0  # the frozen prefix runs forward-only
    assert z["projector"].backward < f["projector"].backward  # its first product: no input gradient
    assert sum(la.model for la in lora) < sum(la.model for la in full)  # base weights: input gradients only
    assert all(la.recompute == 0 for la in full if not la.name.startswith(("vision.blocks", "llm.blocks")))
    again = c["llm.blocks.0"].recompute - f["llm.blocks.0"].recompute
    assert 0 < again < c["llm.blocks.0"].forward  # checkpointed: all but its last linear runs again


def test_a_step_loss_runs_a_feature_pass_and_scores_against_the_global_batch():
    cfg = load_config(TINY, CLIP_SETS[:2])  # model.negatives: global
    family = build_family(cfg)
    layout = frozen_layout(family, resolve_groups(cfg.optim, type(family)))
    mb = MicroBatch(4, 16, 4)
    local = layer_flops(family, mb, training(family, layout))
    wide = layer_flops(family, mb._replace(negatives=16), training(family, layout))
    assert all(la.recompute >= la.forward for la in local)  # the feature pass: one more forward of every layer
    assert wide[-1].forward == 4 * local[-1].forward  # 4 x 16 logits instead of 4 x 4


def test_peak_table_by_device_name_and_the_override():
    assert device_kind("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert device_kind("NVIDIA H100 PCIe") == "H100 PCIe"
    assert device_kind("NVIDIA H200") == "H200"
    assert device_kind("NVIDIA A100-SXM4-80GB") == device_kind("NVIDIA A100-PCIE-40GB") == "A100"
    assert device_kind("NVIDIA L40S") == "L40S"
    assert device_kind("NVIDIA L40") is device_kind("NVIDIA H100 NVL") is device_kind("cpu") is None
    assert peak_tflops("bf16", device="NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("fp16", device="NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("bf16", device="cpu") is None
    assert peak_tflops("bf16", override=123.0, device="cpu") == 123.0
    u = utilization(2e12, 3e12, 0.5, 2, 4.0)
    assert u == {"tflops": 2.0, "mfu": 0.5, "hfu": 0.75}
    assert utilization(2e12, 3e12, 0.5, 2, None) == {"tflops": 2.0, "mfu": None, "hfu": None}


@pytest.mark.parametrize("value, says", [("-1", "log.peak_tflops=-1.0 is out of range: it accepts > 0"),
                                         ("fast", "log.peak_tflops must be a number, got 'fast'")])
def test_peak_tflops_is_checked_in_one_line(capsys, tmp_path, value, says):
    rc = main(["train", "--config", TINY, "--set", f"log.peak_tflops={value}",
               "--set", f"train.output_dir={tmp_path / 'run'}"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("mmpipe: error: ") and says in lines[0], lines
    assert not (tmp_path / "run").exists()


# ---- a short single-process run -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def clip_run(tmp_path_factory):
    """Tiny CLIP, one process, two steps of 4 micro-batches padded to data.max_length (every
    micro-batch the same shape), checkpointed, with a peak of 0.5 TFLOP/s."""
    from mmpipe.data.synth import synth
    d = tmp_path_factory.mktemp("flops")
    data = synth(str(d / "data"), 40, val_fraction=0.1, size=32, seed=1, progress=False)
    run = str(d / "run")
    sets = [f"data.train={data['train']}", f"train.output_dir={run}", "train.steps=2", "parallel.pipeline_stages=1",
            "data.padding=max_length", "parallel.activation_checkpointing=all", "log.peak_tflops=0.5",
            "log.profile=[2,2]"]
    launch(1, ["--config", TINY] + [a for s in sets for a in ("--set", s)], launcher="python")
    return run


def test_every_step_record_carries_tflops_mfu_and_hfu_of_its_micro_batches(clip_run):
    with open(os.path.join(clip_run, "metrics.jsonl")) as fh:
        steps = [r for r in map(json.loads, fh) if r["kind"] == "train"]
    cfg = load_config(os.path.join(clip_run, "config.yaml"))
    family = build_family(cfg)
    t = training(family, frozen_layout(family, resolve_groups(cfg.optim, type(family))), checkpointing=True)
    model, hardware = StepCounter(family, t, negatives=16)({"input_ids": torch.zeros(4, 16), "pixel_values":
                                                            torch.zeros(4, 3, 32, 32)})
    assert len(steps) == 2
    for r in steps:
        flops = r["tflops"] * 1e12 * r["step_time"]  # one device
        assert abs(flops / (4 * model) - 1) < 1e-9, (flops, 4 * model)
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.5)
        assert r["hfu"] / r["mfu"] == pytest.approx(hardware / model) and hardware > model


def test_report_prints_the_median_tflops_and_mfu(clip_run, capsys):
    assert main(["report", "--run", clip_run]) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s per device, MFU " in out and "HFU " in out and "(median of 2 steps)" in out, out


def test_log_profile_writes_the_steps_under_torch_profiler(clip_run):
    """``log.profile: [2, 2]``: step 2 as a Perfetto trace and a table of operators by time."""
    trace = json.load(open(os.path.join(clip_run, "profile", "rank0.json")))
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    text = open(os.path.join(clip_run, "profile", "rank0.txt")).read()
    assert text.startswith("steps 2-2: wall ") and "by host time:" in text and "aten::" in text


def test_the_feature_pass_is_counted_only_where_it_runs():
    """A step loss repeats the forward only with a pipeline or several micro-batches per rank
    (``parallel.strategies``); one micro-batch per rank at P = 1 runs once."""
    from types import SimpleNamespace

    from mmpipe.parallel.topology import Topology
    from mmpipe.planning.flops import step_counter
    cfg = load_config(TINY, ["parallel.pipeline_stages=1", "model.text.vocab_size=300"])
    family = build_family(cfg)
    frozen = frozen_layout(family, resolve_groups(cfg.optim, type(family)))
    batch = {"input_ids": torch.zeros(4, 16), "pixel_values": torch.zeros(4, 3, 32, 32)}
    counts = {}
    for P, world, mbs, batch_size in ((1, 1, 4, 4), (1, 1, 4, 16), (2, 2, 4, 16), (1, 4, 4, 16)):
        run = SimpleNamespace(family=family, cfg=cfg, frozen=frozen, topo=Topology(world, P, mbs, batch_size))
        counts[(P, world, batch_size)] = step_counter(run)(batch)
    one_pass = counts[(1, 1, 4)][1] / counts[(1, 1, 4)][0]
    assert counts[(1, 4, 16)][1] / counts[(1, 4, 16)][0] == pytest.approx(one_pass, rel=1e-3)  # DP4, one micro-batch each
    assert counts[(1, 1, 16)][1] > counts[(1, 1, 16)][0] * one_pass * 1.2  # 4 micro-batches: the feature pass
    assert counts[(2, 2, 16)][1] > counts[(2, 2, 16)][0] * one_pass * 1.2  # a pipeline always runs it


def test_qwen_vit_patches_and_attention_spans_are_transformers_own():
    """The native-resolution ViT's products are priced from its image grids: the patches, the pairs its
    full-attention blocks span (each frame) and its windowed blocks (each window), against the spans
    transformers' own ``get_vision_cu_seqlens`` / ``get_vision_window_index`` give the model, on grids
    of several frames, sides the window divides and sides it does not, several images a micro-batch."""
    import random

    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    from mmpipe.families.qwen_vl.products import grid_shape
    rng = random.Random(0)
    for window_px in (56, 112):
        for _ in range(40):
            grids = [(rng.choice([1, 1, 2, 3]), 2 * rng.randint(1, 20), 2 * rng.randint(1, 20))
                     for _ in range(rng.randint(1, 4))]
            values = torch.tensor(grids)
            full = get_vision_cu_seqlens(values).diff()
            _, cu = get_vision_window_index(values, spatial_merge_size=2, window_size=window_px, patch_size=14)
            windows = torch.as_tensor(cu).diff()
            assert grid_shape(grids, 2, window_px // 2 // 14) == (
                sum(t * h * w for t, h, w in grids), int((full ** 2).sum()), int((windows ** 2).sum())), grids
