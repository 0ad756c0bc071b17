"""What a checkpoint records so that later commands refuse, in one line, what would silently go
wrong: a LoRA run's frozen base (the fingerprint of its pretrained weight files: export,
load_weights and --resume refuse another base; config.yaml names it by an absolute path), the
LoRA spec (a resume with other settings is refused naming the key; a precision change resumes through
the layout-free files; a checkpoint
without that record still refuses adapters other than its own instead of dropping them), the data
position's unit (data.packing); the adapter export loads with peft from anywhere and after a move; damaged
record / COMPLETE / RNG files and a lost ``latest`` are one line naming the file or the complete
checkpoints. One tiny LoRA run (P = 1, 3 steps) on a LLaVA directory given by a relative path."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import TINY_VLM, TRAIN_PY, _env

import mmpipe
from mmpipe.errors import MmpipeError
from mmpipe.train import checkpoint_record, resume_checks

pytestmark = pytest.mark.dist  # every test reads the LoRA run the module's fixture trains (subprocesses)

LORA = ["optim.train_type=lora", "optim.lora_dropout=0", "optim.target_modules=[q_proj,k_proj]", "train.steps=4",
        "model.pretrained=llava_base", "data.tokenizer=llava_base"]


def _train(cwd: str, sets: list, flags=()) -> subprocess.CompletedProcess:
    args = [sys.executable, TRAIN_PY, "--config", TINY_VLM, "--set", "data.val=null"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args + list(flags), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run stopped at step 3 (of 4), trained on ``llava_base`` (a relative path: an export of a
    1-step full run), launched from its own working directory."""
    from mmpipe.data.synth import synth_vlm
    from mmpipe.train.export import export
    work = tmp_path_factory.mktemp("ckrec")
    data = synth_vlm(str(work / "data"), 40, val_fraction=0.1, size=32, seed=3, text_only=0.3, progress=False)
    full = _train(str(work), [f"data.train={data['train']}", "train.steps=1", "train.output_dir=full"])
    assert full.returncode == 0, full.stderr[-2000:]
    export(str(work / "full"), str(work / "llava_base"))
    proc = _train(str(work), LORA + [f"data.train={data['train']}", "train.output_dir=run"], ["--stop-at", "3"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"work": str(work), "run": str(work / "run"), "base": str(work / "llava_base"), "train": data["train"]}


def _copy(lora_run, tmp_path, name="copy") -> str:
    out = str(tmp_path / name)
    shutil.copytree(lora_run["run"], out)
    return out


def _current(run: str, *sets) -> tuple:
    """What a resume of ``run`` with ``sets`` compares (``Checkpointer.record`` on rank 0)."""
    cfg = mmpipe.load_config(os.path.join(run, "config.yaml"), list(sets))
    record = {**checkpoint_record.run_record(cfg, {}, None),
              "frozen_base": checkpoint_record.base_fingerprint(cfg.to_dict()["model"])}
    return record, bool(cfg.data.packing)


def _record_path(run: str) -> str:
    return os.path.join(run, "checkpoints", "global_step3", checkpoint_record.RECORD_FILE)


def test_lora_checkpoint_records_its_frozen_base_and_refuses_another(lora_run, tmp_path, monkeypatch):
    """config.yaml names the pretrained base by an absolute path (export and load_weights work from
    any directory); the checkpoint records the base's fingerprint, and a base whose weights changed
    (+0.5 on one tensor) is refused by load_weights, export and --resume in one line."""
    import yaml
    from safetensors.torch import load_file, save_file

    from mmpipe.train.export import export
    run = lora_run["run"]
    saved = yaml.safe_load(open(os.path.join(run, "config.yaml")))
    assert saved["model"]["pretrained"] == lora_run["base"] and saved["data"]["tokenizer"] == lora_run["base"]
    assert json.load(open(_record_path(run)))["frozen_base"]["model.pretrained"]["dir"] == lora_run["base"]
    monkeypatch.chdir(tmp_path)  # not the launch directory
    assert any(".lora_A." in k for k in mmpipe.load_weights(run))
    changed = str(tmp_path / "llava_changed")
    shutil.copytree(lora_run["base"], changed)
    sd = load_file(os.path.join(changed, "model.safetensors"))
    key = next(k for k in sd if "layers.0.mlp.up_proj" in k)
    sd[key] = sd[key] + 0.5
    save_file(sd, os.path.join(changed, "model.safetensors"), metadata={"format": "pt"})
    other = _copy(lora_run, tmp_path)
    cfg_text = open(os.path.join(other, "config.yaml")).read().replace(f"pretrained: {lora_run['base']}",
                                                                       f"pretrained: {changed}")
    open(os.path.join(other, "config.yaml"), "w").write(cfg_text)
    with pytest.raises(MmpipeError, match=r"model.pretrained=.*llava_changed differs from the base trained on") as e:
        mmpipe.load_weights(other)
    assert "\n" not in str(e.value)
    with pytest.raises(MmpipeError, match="differs from the base trained on"):
        export(other, str(tmp_path / "exp"))
    assert not os.path.exists(tmp_path / "exp")
    with pytest.raises(MmpipeError, match="--resume: model.pretrained=.*differs from the base trained on"):
        resume_checks.check_resume(os.path.join(other, "checkpoints"), *_current(other))
    resume_checks.check_resume(os.path.join(run, "checkpoints"), *_current(run))  # its own base: fine


def test_lora_adapter_export_loads_with_auto_peft_model_from_anywhere(lora_run, tmp_path, monkeypatch):
    """adapter_config.json names its base as peft users expect: the absolute path of the base copy inside
    the export (AutoPeftModel.from_pretrained(OUT) from another directory); moved elsewhere, the copy still
    serves (PeftModel + OUT/base). A run whose base was a hub id names that id and its commit instead, and
    AutoPeftModel loads the base from the Hugging Face cache (offline)."""
    from peft import AutoPeftModel, PeftModel
    from transformers import LlavaForConditionalGeneration

    from mmpipe.train.export import export
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = str(tmp_path / "exp")
    export(lora_run["run"], out)
    assert json.load(open(os.path.join(out, "adapter_config.json")))["base_model_name_or_path"] == \
        os.path.join(out, "base")
    monkeypatch.chdir(tmp_path)
    model = AutoPeftModel.from_pretrained(out)
    assert any("lora_A" in n for n, _ in model.named_parameters())
    moved = str(tmp_path / "elsewhere" / "adapter")
    shutil.move(out, moved)
    PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(os.path.join(moved, "base")), moved)

    # the same run as if started from the hub id tiny-org/llava (config.yaml keeps the pin)
    cache, commit = str(tmp_path / "hub"), "5" * 40
    repo_dir = os.path.join(cache, "models--tiny-org--llava")
    shutil.copytree(lora_run["base"], os.path.join(repo_dir, "snapshots", commit))
    os.makedirs(os.path.join(repo_dir, "refs"))
    open(os.path.join(repo_dir, "refs", "main"), "w").write(commit)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    pinned = _copy(lora_run, tmp_path, "pinned")
    text = open(os.path.join(pinned, "config.yaml")).read().replace(f"pretrained: {lora_run['base']}",
                                                                    f"pretrained: tiny-org/llava@{commit}")
    open(os.path.join(pinned, "config.yaml"), "w").write(text)
    out = str(tmp_path / "exp_pinned")
    export(pinned, out)
    adapter_cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    assert adapter_cfg["base_model_name_or_path"] == "tiny-org/llava" and adapter_cfg["revision"] == commit
    # the base from the cache, by id (huggingface_hub read HF_HUB_CACHE when imported: the cache given here)
    model = AutoPeftModel.from_pretrained(out, cache_dir=cache, local_files_only=True)
    assert any("lora_A" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("change,key", [("optim.target_modules=[q_proj,v_proj]", "optim.target_modules"),
                                        ("optim.lora_alpha=8", "optim.lora_alpha"),
                                        ("optim.lora_rank=4", "optim.lora_rank"),
                                        ("optim.lora_dropout=0.1", "optim.lora_dropout"),
                                        ("optim.train_type=full", "optim.train_type"),
                                        ("data.packing=true", "data.packing")])
def test_resume_refuses_other_lora_settings_or_packing(lora_run, change, key):
    """The checkpoint records the LoRA spec and what its data position counts: a resume that changes
    one is refused naming it (the same settings resume)."""
    root = os.path.join(lora_run["run"], "checkpoints")
    with pytest.raises(MmpipeError, match=f"--resume: .*{key}=.*{key}=") as e:
        resume_checks.check_resume(root, *_current(lora_run["run"], change))
    assert "\n" not in str(e.value)


def test_a_precision_change_resumes_through_the_layout_free_files(lora_run, tmp_path):
    """fp32 -> bf16: DeepSpeed's optimizer wrapper differs, so its own files do not fit (they failed with
    KeyError 'dynamic_loss_scale'); the layout-free weights and Adam moments do, by parameter name."""
    from mmpipe.parallel.schedules import Order
    one = Order("1f1b")
    saved = checkpoint_record.layout_record(_Topo(), _cfg("fp32"), None, None, one)
    assert not resume_checks.same_layout(saved, checkpoint_record.layout_record(_Topo(), _cfg("bf16"), None, None, one))
    assert resume_checks.same_layout(saved, checkpoint_record.layout_record(_Topo(), _cfg("fp32"), None, None, one))
    # the pipeline order is recorded, and holds no state: another one reads the same per-stage files
    for order in (Order("frozen_first", 1), Order("zb_h1")):
        other = checkpoint_record.layout_record(_Topo(), _cfg("fp32"), None, None, order)
        assert other["schedule"] == order.name and other["frozen_stages"] == order.frozen
        assert saved["schedule"] == "1f1b" and resume_checks.same_layout(saved, other)
    run = _copy(lora_run, tmp_path)
    sets = LORA + [f"data.train={lora_run['train']}", f"train.output_dir={run}", "train.precision=bf16"]
    proc = _train(lora_run["work"], sets, ["--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    from helpers import train_losses
    assert len(train_losses(run)) > 3 and all(x == x for x in train_losses(run))


class _Topo:
    pipeline_stages, data_parallel, expert_parallel = 1, 1, 1


def _cfg(precision):
    import mmpipe
    return mmpipe.load_config(TINY_VLM, [f"train.precision={precision}"])


def test_lora_checkpoint_resumed_with_other_targets_keeps_its_adapters(lora_run, tmp_path):
    """Resumed with other target modules of the same shapes (q_proj, v_proj for q_proj, k_proj): refused
    naming optim.target_modules; a checkpoint without that record (an older mmpipe) is refused naming
    the adapters, not loaded non-strictly without them; with its own settings it resumes."""
    run = _copy(lora_run, tmp_path)
    sets = LORA + [f"data.train={lora_run['train']}", f"train.output_dir={run}"]
    other = [s.replace("k_proj]", "v_proj]") for s in sets]
    proc = _train(lora_run["work"], other, ["--resume"])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "optim.target_modules=[q_proj,k_proj] at the checkpoint, [q_proj,v_proj] now" in proc.stderr
    record = json.load(open(_record_path(run)))
    for k in ("training", "frozen_base"):
        record.pop(k, None)
    json.dump(record, open(_record_path(run), "w"))
    proc = _train(lora_run["work"], other, ["--resume"])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "holds adapters this run has not: llm.blocks.0.self_attn.k_proj.lora_A" in proc.stderr
    ok = _train(lora_run["work"], sets, ["--resume"])
    assert ok.returncode == 0, ok.stderr[-2000:]


@pytest.mark.parametrize("name,damage", [(checkpoint_record.RECORD_FILE, lambda t: t[:100]),
                                         ("COMPLETE", lambda t: "garbage")])
def test_damaged_record_or_complete_is_one_line(lora_run, tmp_path, name, damage):
    """A damaged mmpipe_checkpoint.json or COMPLETE: load_weights (export, generate) and --resume say so
    in one line naming the file."""
    run = _copy(lora_run, tmp_path)
    path = os.path.join(run, "checkpoints", "global_step3", name)
    text = open(path).read()
    open(path, "w").write(damage(text))
    for call in (lambda: mmpipe.load_weights(run),
                 lambda: resume_checks.check_resume(os.path.join(run, "checkpoints"), *_current(lora_run["run"]))):
        with pytest.raises(MmpipeError, match=f"cannot read {path}: .*point latest at an earlier checkpoint") as e:
            call()
        assert "\n" not in str(e.value)


def test_damaged_rng_file_is_one_line_on_resume(lora_run, tmp_path):
    run = _copy(lora_run, tmp_path)
    rng = os.path.join(run, "checkpoints", "global_step3", "rng_rank0.pt")
    data = open(rng, "rb").read()
    open(rng, "wb").write(data[:100])
    proc = _train(lora_run["work"], LORA + [f"data.train={lora_run['train']}", f"train.output_dir={run}"], ["--resume"])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"cannot read {rng}" in proc.stderr and "point latest at an earlier checkpoint" in proc.stderr


def test_lost_latest_names_the_complete_checkpoints(lora_run, tmp_path):
    """A checkpoints directory without 'latest' but with a complete checkpoint: --resume, a fresh run
    into it (which --overwrite would delete) and load_weights name it and how to point latest at it."""
    from mmpipe.train.run_dir import check_run_dir
    run = _copy(lora_run, tmp_path)
    os.remove(os.path.join(run, "checkpoints", "latest"))
    hint = f"echo global_step3 > {os.path.join(run, 'checkpoints', 'latest')}"
    for call in (lambda: check_run_dir(run, resume=False, overwrite=False),
                 lambda: mmpipe.load_weights(run),
                 lambda: resume_checks.check_resume(os.path.join(run, "checkpoints"), *_current(lora_run["run"]))):
        with pytest.raises(MmpipeError, match="global_step3") as e:
            call()
        assert hint in str(e.value)
