"""The benches' own arithmetic: pooled rounds and the groups bench's baseline row."""
from __future__ import annotations

import os
import json

import pytest


def test_bench_pools_the_steps_of_every_round_and_keeps_the_middle_run(tmp_path):
    """A variant's measured step is the median over every round's steps after warm-up, so one round
    caught in a slow spell of the machine weighs only its share; idle and memory come from the run
    whose own median is the middle one."""
    from mmpipe.bench.common import pooled
    outs = []
    for i, steps in enumerate([[9.0, 1.0, 1.1, 1.2], [9.0, 2.0, 2.1, 2.2], [9.0, 1.3, 1.4, 1.5]]):
        d = tmp_path / f"r{i}"
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s + 1, "step_time": t}) + "\n"
                                                 for s, t in enumerate(steps)) + '{"kind": "eval", "step_time": 50}\n')
        outs.append(str(d))
    step, mid, medians = pooled(outs, warmup=1)
    assert step == pytest.approx(1.4)  # median of the 9 steps after warm-up; the best round alone would say 1.1
    assert mid == outs[2] and medians == pytest.approx([1.1, 2.1, 1.4])


def test_bench_groups_baseline_row_says_what_it_measures():
    """Its runs take every group's norm each step (the skip check); the label must not say "no norms"."""
    from mmpipe.bench.groups import GROUP_VARIANTS
    label, sets = GROUP_VARIANTS[0]
    assert "norms still taken" in label and "no norms" not in label
    assert not [s for s in sets if "max_grad_norm" in s or "grad_norm=false" in s]
    assert all(any("max_grad_norm" in s for s in v) for _, v in GROUP_VARIANTS[1:])


def test_benchmarks_md_shows_the_latest_of_each_bench_and_the_history_keeps_every_run(tmp_path):
    from mmpipe.bench.common import HISTORY, append_benchmarks
    append_benchmarks("Data path", "mmpipe bench data --repeats 3", "| a |", "note-a", root=str(tmp_path))
    append_benchmarks("Layouts", "mmpipe bench strategies --worlds 2 4 --steps 8", "| b |", "note-b", root=str(tmp_path))
    append_benchmarks("Data path", "mmpipe bench data", "| c |", "note-c", root=str(tmp_path))
    history = (tmp_path / HISTORY).read_text()
    assert [history.index(n) for n in ("note-a", "note-b", "note-c")] == sorted(history.index(n) for n in ("note-a", "note-b", "note-c"))
    latest = (tmp_path / "BENCHMARKS.md").read_text()
    assert "note-c" in latest and "note-b" in latest and "note-a" not in latest  # the same bench: its latest only
    assert latest.index("note-c") < latest.index("note-b")  # newest first


def test_append_benchmarks_files_a_result_at_the_end_of_its_benchs_section(tmp_path):
    """BENCHMARKS.md has one ``## <bench>`` section per bench (the name from the recorded command): a result
    goes last in its own section, before the next section's header, and a bench without a section gets one
    at the end of the file; the entries already there keep their text and order."""
    from mmpipe.bench.common import append_benchmarks
    groups_old = "### Grouped clipping (2026-01-01 00:00 UTC)\n\n`mmpipe bench groups --nproc 2`\n\nnote-g1\n"
    data_old = "### Data path (2026-01-02 00:00 UTC)\n\n`mmpipe bench data`\n\nnote-d1\n"
    (tmp_path / "BENCHMARKS.md").write_text("# mmpipe benchmarks\n\nContents:\n\n- [groups](#groups)\n- [data](#data)\n\n"
                                            f"## groups\n\n{groups_old}\n## data\n\n{data_old}")
    append_benchmarks("Grouped clipping", "mmpipe bench groups --nproc 4 --steps 3", "| g2 |", "note-g2",
                      root=str(tmp_path))
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert groups_old in text and data_old in text
    assert text.index("note-g1") < text.index("note-g2") < text.index("\n## data\n") < text.index("note-d1")
    append_benchmarks("Overhead", "mmpipe bench overhead --rounds 2", "| o |", "note-o", root=str(tmp_path))
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert text.index("note-d1") < text.index("\n## overhead\n") < text.index("note-o")
    assert text.rstrip().endswith("note-o") and text.count("\n## ") == 3
    assert "[overhead](#overhead)" in text.split("\n## ")[0]  # in the contents list


def test_the_benches_find_the_repository_they_run_in():
    """Their default configs and launch/train.py are found from the package's location."""
    from mmpipe.bench.common import ROOT
    assert os.path.isfile(os.path.join(ROOT, "launch", "train.py"))
    assert os.path.isfile(os.path.join(ROOT, "configs", "demo.yaml"))


def test_peers_reads_open_clips_step_log(tmp_path):
    """``mmpipe bench peers`` times open_clip_train by its own per-step log line (train.py's format)."""
    from mmpipe.bench.peers import open_clip_step_times
    lines = ["2026-11-25,18:01:00 | INFO | Train Epoch: 0 [   64/25600 (0%)] Data (t): 0.210 Batch (t): 1.250, "
             "51.2000/s, 25.6000/s/gpu LR: 0.000033 Logit Scale: 14.286 Contrastive_loss: 4.1589 (4.1589) Loss: "
             "4.1589 (4.1589)",
             "2026-11-25,18:01:01 | INFO | Train Epoch: 0 [  128/25600 (1%)] Data (t): 0.105 Batch (t): 0.700, "
             "200.000/s, 100.000/s/gpu LR: 0.000067 Logit Scale: 14.286 Contrastive_loss: 4.1500 (4.1544) Loss: "
             "4.1500 (4.1544)"]
    (tmp_path / "out.log").write_text("\n".join(["2026-11-25,18:00:59 | INFO | Start epoch 0"] + lines) + "\n")
    assert open_clip_step_times(str(tmp_path), 64) == [64 / 51.2, 64 / 200.0]


def test_bench_gpu_runs_every_job_beside_its_peer_at_tiny_size(tmp_path):
    """``mmpipe bench gpu --tiny`` on this CPU: mmpipe and the peer of each job run to the end (open_clip_train
    --siglip on SigLIP, the CLIP job's peer without the flag; transformers' Trainer on LLaVA and Qwen2.5-VL), each with a
    step time, mmpipe with its TFLOP/s and the memory
    model's prediction (as planned, and for the VLM at its first step's longest micro-batch); packed VLM rows
    count the samples they hold (data.log_samples)."""
    import json
    import subprocess
    import sys
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "-m", "mmpipe.cli.main", "bench", "gpu", "--tiny", "--jobs", "vlm_full",
                           "siglip_b16", "qwen_lora", "--steps", "3", "--warmup", "1", "--no-append", "--out", str(out)],
                          capture_output=True, text=True, cwd=str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())["results"]
    systems = {(r["job"], r["system"]) for r in results}
    assert systems == {("vlm_full", "mmpipe"), ("vlm_full", "Trainer"), ("siglip_b16", "mmpipe"),
                       ("siglip_b16", "open_clip_train --siglip"), ("qwen_lora", "mmpipe"), ("qwen_lora", "Trainer + peft")}
    for r in results:
        assert r["step_s"] > 0 and r["samples_s"] > 0
    mm = {r["job"]: r for r in results if r["system"] == "mmpipe"}
    assert all(r["tflops"] > 0 and r["predicted_mb"] > 0 and r["mfu"] is None for r in mm.values())  # no peak on a CPU
    assert mm["vlm_full"]["samples_per_step"] > 4  # 4 packed rows per step, several samples in each
    assert mm["qwen_lora"]["samples_per_step"] > 4
    assert "| siglip_b16 | open_clip_train --siglip |" in proc.stdout
    # the Trainer trains Qwen2.5-VL on the run's images (their patches and grids), not on its text alone
    qwen_peer = next(r for r in results if r["job"] == "qwen_lora" and r["system"] != "mmpipe")
    assert sum(qwen_peer["images_per_step"]) > 0, qwen_peer
    # timm has no SigLIP ViT of the tiny shape: open_clip's own ViT at its sizes, and the result says so
    siglip_peer = next(r for r in results if r["job"] == "siglip_b16" and r["system"] != "mmpipe")
    assert "open_clip's ViT at SigLIP's sizes" in siglip_peer["towers"], siglip_peer
    # the memory model also at the first step's longest micro-batch (packed rows padded per micro-batch) where
    # that is below the plan's data.max_length = 96; a dual encoder pads every row to its max_length: nothing to add
    vlm = mm["vlm_full"]
    lengths = [r["length"] for r in map(json.loads, (out / "samples_vlm_full.jsonl").read_text().splitlines())
               if r["step"] == 1]
    assert len(lengths) == 2 and vlm["first_length"] == max(lengths) <= 96, (lengths, vlm)
    if vlm["first_length"] < 96:
        assert 0 < vlm["predicted_at_first_mb"] < vlm["predicted_mb"], vlm
        assert f"MB at {vlm['first_length']} tokens |" in proc.stdout
    else:
        assert vlm["predicted_at_first_mb"] is None
    assert mm["siglip_b16"]["predicted_at_first_mb"] is None and mm["siglip_b16"]["first_length"] is None
    # unpacked rows padded per micro-batch stay below max_length: the model at that shape predicts less
    unpacked = subprocess.run([sys.executable, "-m", "mmpipe.cli.main", "bench", "gpu", "--tiny", "--jobs", "vlm_lora",
                               "--no-peers", "--set", "data.packing=false", "--steps", "2", "--warmup", "1",
                               "--no-append", "--out", str(tmp_path / "unpacked")], capture_output=True, text=True,
                              cwd=str(tmp_path), timeout=900)
    assert unpacked.returncode == 0, unpacked.stdout[-3000:] + unpacked.stderr[-3000:]
    lora = json.loads((tmp_path / "unpacked" / "results.json").read_text())["results"][0]
    assert 0 < lora["first_length"] < 96 and 0 < lora["predicted_at_first_mb"] < lora["predicted_mb"], lora
    assert f"MB at {lora['first_length']} tokens |" in unpacked.stdout


def test_bench_overhead_times_mmpipe_and_a_raw_deepspeed_engine_on_the_same_model(tmp_path):
    """``mmpipe bench overhead`` at P = 1 (mmpipe with its default loader workers) and P = 2: mmpipe's run and the
    raw DeepSpeed engine (the plain module; a PipelineModule of the family's layers) both train to the end, and
    the table gives each layout's step times and their ratio."""
    import re
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "mmpipe.cli.main", "bench", "overhead", "--layouts",
                           "P1-workers", "P2", "--rounds", "1", "--steps", "4", "--warmup", "1", "--n", "64",
                           "--no-append"], capture_output=True, text=True, cwd=str(tmp_path), timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"^\| (P1-workers|P2) \| (\d) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", proc.stdout, re.M)
    assert [(r[0], r[1]) for r in rows] == [("P1-workers", "1"), ("P2", "2")], proc.stdout
    # both sides at the threads an mmpipe rank takes (OMP_NUM_THREADS here), said in the notes
    assert "Both sides at the same CPU threads per rank (P = 1: 1, OMP_NUM_THREADS=1" in proc.stdout
    for _, _, raw, mm, ratio in rows:
        assert float(raw) > 0 and float(mm) > 0
        assert abs(float(ratio) - float(mm) / float(raw)) < 0.01 + 0.01 * float(ratio)


def test_swift_side_reads_its_step_times_and_gets_the_samples_in_mmpipes_order(tmp_path):
    """``bench peers --swift``: each step's seconds from ms-swift's running mean ``train_speed(s/it)``, and its
    JSONL rewritten in mmpipe's sample order with image paths made absolute (ms-swift reads it unshuffled)."""
    import json

    from mmpipe.bench.swift import ordered_jsonl, step_times
    logged = [{"train_speed(s/it)": 2.0}, {"train_speed(s/it)": 1.5}, {"train_speed(s/it)": 1.0}]
    assert step_times(logged) == [2.0, 1.0, 0.0]
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps({"messages": [], "images": [f"images/{i}.jpg"] if i % 2 else []}) + "\n"
                           for i in range(4)))
    out = ordered_jsonl(str(src), [3, 0, 2, 1], str(tmp_path / "ordered.jsonl"))
    rows = [json.loads(line) for line in open(out)]
    assert [r["images"] for r in rows] == [[str(tmp_path / "images" / "3.jpg")], [], [], [str(tmp_path / "images" / "1.jpg")]]


def test_swift_side_gives_ms_swifts_qwen_templates_the_directorys_placeholder_ids(tmp_path):
    """ms-swift's Qwen templates hard-code Qwen's vocabulary ids of ``<|image_pad|>`` / ``<|video_pad|>``
    (151655 / 151656); the bench's plugin sets the directory's own, which a tiny tokenizer puts elsewhere."""
    import ast

    from transformers import AutoTokenizer

    from mmpipe.bench.swift import placeholder_plugin
    from mmpipe.families.qwen_vl.tiny import write_tiny_qwen2_5_vl
    model_dir = str(tmp_path / "qwen")
    write_tiny_qwen2_5_vl(model_dir)
    want = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    assert want != [151655, 151656]
    tree = ast.parse(open(placeholder_plugin(model_dir, str(tmp_path / "plugin.py"))).read())
    sets = [node for node in tree.body if isinstance(node, ast.Assign)]
    assert [ast.unparse(t) for t in sets[0].targets[0].elts] == ["Qwen2VLTemplate.image_token_id",
                                                                 "Qwen2VLTemplate.video_token_id"]
    assert [c.value for c in sets[0].value.elts] == want
