"""Config: loading and overrides, the DeepSpeed-JSON / Accelerate contract, the generated
reference, ranges, derived (never mutated) run configs, topology arithmetic and CPU threads."""
from __future__ import annotations

import json
import os

import pytest
from helpers import TINY

import mmpipe
from mmpipe.config.schema import load_config, reference
from mmpipe.errors import ConfigError


# ---- config --------------------------------------------------------------------------------
def test_load_config_and_overrides_track_explicit_keys():
    cfg = load_config(TINY, ["train.steps=7", "optim.lr=3e-3", "model.vision.hidden_size=64"])
    assert cfg.train.steps == 7 and cfg.optim.lr == pytest.approx(3e-3)
    assert cfg.model.vision.hidden_size == 64
    assert "train.steps" in cfg.explicit and "train.batch_size" in cfg.explicit  # from the file
    assert "train.seed" not in cfg.explicit


def test_inf_max_grad_norm_parses():
    assert load_config(None, ["optim.max_grad_norm=inf"]).optim.max_grad_norm == float("inf")


def test_reference_lists_every_key_with_help():
    ref = reference()
    for key in ("`model.vision.arch`", "`parallel.pipeline_stages`", "`train.deepspeed_config`", "`data.tokenizer`"):
        assert key in ref
    import re
    for row in ref.splitlines()[2:]:
        cells = re.split(r"(?<!\\)\|", row)[1:-1]
        assert len(cells) == 3 and cells[2].strip(), row


# ---- DeepSpeed config -------------------------------------------------------------------------
def _write(tmp_path, d):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_auto_values_are_filled(tmp_path):
    from mmpipe.config.deepspeed import resolve
    path = _write(tmp_path, json.load(open(os.path.join(os.path.dirname(TINY), "..", "ds_configs", "auto.json"))))
    cfg = load_config(TINY, [f"train.deepspeed_config={path}", "train.precision=bf16", "optim.max_grad_norm=2.0"])
    ds, topo = resolve(cfg, world_size=4)
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == topo.accumulation_steps == 2
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["gradient_clipping"] == 0.0  # mmpipe clips, DeepSpeed must not clip again
    assert ds["optimizer"]["params"]["lr"] == pytest.approx(1e-3)
    assert ds["zero_optimization"]["stage"] == 0


def test_concrete_json_value_is_adopted_when_run_config_is_silent(tmp_path):
    from mmpipe.config.deepspeed import resolve
    path = _write(tmp_path, {"gradient_clipping": 1.5, "train_micro_batch_size_per_gpu": 2})
    cfg = load_config(None, [f"train.deepspeed_config={path}", "train.batch_size=8"])
    ds, topo = resolve(cfg, world_size=1)
    assert cfg.optim.max_grad_norm == 1.5 and ds["gradient_clipping"] == 0.0
    assert cfg.parallel.micro_batch_size == 2 and topo.accumulation_steps == 4


def test_gradient_accumulation_mismatch(tmp_path):
    from mmpipe.config.deepspeed import resolve
    path = _write(tmp_path, {"gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=3"):
        resolve(load_config(TINY, [f"train.deepspeed_config={path}"]), world_size=2)


def test_generated_config_when_no_json():
    from mmpipe.config.deepspeed import resolve
    ds, _ = resolve(load_config(TINY), world_size=2)
    assert ds["optimizer"]["type"] == "AdamW" and ds["gradient_accumulation_steps"] == 4


# ---- topology ----------------------------------------------------------------------------------
def test_topology_arithmetic_and_reporting_rank():
    from mmpipe.parallel.topology import Topology
    t = Topology(world_size=4, pipeline_stages=2, micro_batch_size=4, batch_size=32)
    assert (t.data_parallel, t.accumulation_steps) == (2, 4)
    assert t.coords(t.reporting_rank) == (1, 0)
    assert sorted(t.rank_of(s, d) for s in range(2) for d in range(2)) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        Topology(world_size=3, pipeline_stages=2, micro_batch_size=4, batch_size=32)


def test_the_run_directory_defaults_to_the_familys(tmp_path):
    """Unset ``train.output_dir`` is ``runs/<model.type>`` (a VLM's plan is not written under runs/clip)."""
    from mmpipe.config.schema import load_config
    for family in ("clip", "vlm", "siglip"):
        (tmp_path / f"{family}.yaml").write_text(f"model: {{type: {family}}}\n")
        assert load_config(str(tmp_path / f"{family}.yaml"), weights=False).train.output_dir == f"runs/{family}"
    assert load_config(None, ["train.output_dir=mine"]).train.output_dir == "mine"


def test_docs_config_reference_is_in_sync():
    readme = open(os.path.join(os.path.dirname(TINY), "..", "docs", "configuration.md")).read()
    a = readme.index("<!-- config-reference:start")
    table = readme[readme.index("\n", a) + 1:readme.index("<!-- config-reference:end -->")].strip()
    assert table == reference().strip(), "docs/configuration.md reference is stale: regenerate with mmpipe config --reference"


def test_a_resolved_config_is_derived_not_mutated_and_sealed():
    """Resolution (tokenizer fields, auto micro-batch) makes a new config; once sealed, any change is
    an error naming the field, and the config the user passed in is never touched."""
    from mmpipe.config.schema import family_of, replace
    cfg = mmpipe.load_config(TINY)
    before = cfg.to_dict()
    from mmpipe.data.tokenizer import StandInTokenizer
    model = family_of(cfg).resolve(cfg.model, StandInTokenizer(77), cfg.data)
    resolved = replace(cfg, model=model, parallel__micro_batch_size=2)
    assert cfg.to_dict() == before  # the input is unchanged
    assert resolved.model.text.vocab_size == 77 and resolved.parallel.micro_batch_size == 2
    resolved.seal()
    with pytest.raises(AttributeError, match="read-only: cannot set TrainConfig.steps"):
        resolved.train.steps = 3
    with pytest.raises(AttributeError, match="cannot set TextConfig.vocab_size"):
        resolved.model.text.vocab_size = 5
    again = replace(resolved, train__steps=3)  # a further derivation is writable again
    assert again.train.steps == 3 and resolved.train.steps == cfg.train.steps


def test_the_trainer_resolves_a_copy_and_leaves_the_callers_config_alone(tiny_data, tmp_path):
    """Validation adopts the DeepSpeed JSON's values and a stand-in for ``micro_batch_size: auto``
    into the run's own copy; the config object the caller passed is unchanged."""
    from mmpipe.train.setup import validate
    cfg = mmpipe.load_config(TINY, [f"data.train={tiny_data['train']}", f"train.output_dir={tmp_path / 'o'}",
                                    "parallel.micro_batch_size=auto", "train.deepspeed_config=ds_configs/auto.json",
                                    "parallel.pipeline_stages=1"])
    before = cfg.to_dict()
    run_cfg = validate(cfg, resume=False, stop_at=None, overwrite=False)[0]
    assert run_cfg is not cfg and run_cfg.parallel.micro_batch_size != "auto"
    assert cfg.to_dict() == before


def test_every_number_of_the_config_has_a_range_checked_at_load():
    """Values that mean "never" or are out of range are one line naming the key and what it accepts."""
    import dataclasses
    import typing

    from mmpipe.config.schema import RunConfig
    for f in dataclasses.fields(RunConfig):
        if f.name == "model" or f.metadata.get("internal"):
            continue
        section = typing.get_type_hints(RunConfig)[f.name]
        if not dataclasses.is_dataclass(section):
            continue
        hints = typing.get_type_hints(section)
        for g in dataclasses.fields(section):
            kinds = typing.get_args(hints[g.name]) or (hints[g.name],)
            if (int in kinds or float in kinds) and str not in kinds:
                assert g.metadata.get("range"), f"{f.name}.{g.name} declares no range"
    from mmpipe.config.schema import validate
    for key, value, shown, accepts in (("train.max_bad_steps", -1, "-1", ">= 0"),
                                       ("train.save_every_minutes", -1, "-1.0", "> 0"),
                                       ("train.collective_timeout_minutes", -1, "-1.0", "> 0"),
                                       ("log.every", 0, "0", ">= 1"), ("data.shuffle_buffer", 0, "0", ">= 1"),
                                       ("parallel.memory_budget_gb", 0, "0.0", "> 0"),
                                       ("model.vision.hidden_size", 0, "0", ">= 1")):
        with pytest.raises(ConfigError, match=rf"{key}={shown} is out of range: it accepts {accepts} \("):
            validate(load_config(TINY, [f"{key}={value}"]))


def test_a_launchers_omp_default_does_not_cut_a_cpu_ranks_threads():
    from mmpipe.parallel.topology import cpu_threads
    assert cpu_threads(2, 16, env={}, parent_env=set())[0] == 8
    # torchrun / accelerate launch export OMP_NUM_THREADS=1 for their ranks: not in the launcher's own env
    for marker in ("TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU"):
        threads, why = cpu_threads(2, 16, env={"OMP_NUM_THREADS": "1", marker: "x"}, parent_env={"PATH"})
        assert threads == 8 and "came from the launcher" in why
    # under plain python (or the deepspeed launcher) the value is the user's, even when exported in an
    # interactive shell after it started (so absent from the parent's start-up environment)
    assert cpu_threads(1, 16, env={"OMP_NUM_THREADS": "1"}, parent_env={"PATH"}) == (1, "OMP_NUM_THREADS=1")
    # the user's own setting (the launcher was started with it) is honoured
    assert cpu_threads(2, 16, env={"OMP_NUM_THREADS": "3"}, parent_env={"OMP_NUM_THREADS"}) == (3, "OMP_NUM_THREADS=3")
