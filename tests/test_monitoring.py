"""Monitoring the ecosystem expects: DeepSpeed's own ``tensorboard`` and ``csv_monitor`` blocks in
the DeepSpeed JSON receive the same scalars as ``metrics.jsonl`` (from a P=2 run, whose metrics
live on rank 1 while DeepSpeed's monitors write from rank 0); ``mmpipe report`` draws the run."""
from __future__ import annotations

import csv
import glob
import json
import os

import pytest
from helpers import launch

from mmpipe.train.metrics import read_metrics


@pytest.fixture(scope="module")
def monitored_run(runs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitored")
    ds = tmp / "ds.json"
    ds.write_text(json.dumps({"tensorboard": {"enabled": True, "job_name": "tb"},
                              "csv_monitor": {"enabled": True, "job_name": "csv"}}))
    out = str(tmp / "run")
    launch(2, runs.base(out, "--set", "parallel.pipeline_stages=2", "--set", f"train.deepspeed_config={ds}"))
    return out


def test_deepspeed_tensorboard_and_csv_monitors_get_the_metrics(monitored_run):
    recs = read_metrics(os.path.join(monitored_run, "metrics.jsonl"))
    assert len(recs) == 6
    base = os.path.join(monitored_run, "ds_monitor")  # no output_path in the JSON: the run directory
    with open(os.path.join(base, "csv", "mmpipe_loss.csv")) as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["step", "loss"]
    assert [(int(s), float(v)) for s, v in rows[1:]] == [(r["step"], r["loss"]) for r in recs]
    with open(os.path.join(base, "csv", "mmpipe_grad_norm.vision.csv")) as fh:
        assert [float(v) for _, v in list(csv.reader(fh))[1:]] == pytest.approx([r["grad_norm.vision"] for r in recs])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = glob.glob(os.path.join(base, "tb", "events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"mmpipe/loss", "mmpipe/samples_per_sec", "mmpipe/stage1.idle"} <= set(tags)
    evals = read_metrics(os.path.join(monitored_run, "metrics.jsonl"), kind="eval")
    assert evals and [e.value for e in acc.Scalars("mmpipe/eval/i2t_r1")] == pytest.approx([e["i2t_r1"] for e in evals])
    got = [(e.step, e.value) for e in acc.Scalars("mmpipe/loss")]
    assert [s for s, _ in got] == [r["step"] for r in recs]
    assert [v for _, v in got] == pytest.approx([r["loss"] for r in recs], rel=1e-6)


def test_mmpipe_report_writes_its_charts(monitored_run, capsys):
    from PIL import Image

    from mmpipe.cli.main import main
    assert main(["report", "--run", monitored_run]) == 0
    for name in ("loss", "throughput", "stages", "grad_norms"):
        path = os.path.join(monitored_run, "report", f"{name}.png")
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size[0] > 300
    capsys.readouterr()
    assert main(["report", "--run", os.path.dirname(monitored_run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no metrics.jsonl" in err[0]


def test_report_of_a_one_stage_run_draws_that_stage(runs, tmp_path):
    """P = 1 with log.stage_timing true: stages.png says what is true (one stage, nothing to compare)
    and draws its compute / loader-wait split, not "no stage timing in this run"."""
    import shutil

    import matplotlib
    from PIL import Image

    from mmpipe.cli import report
    from mmpipe.config.schema import load_config
    p1, _ = runs.get("p1", 1, ["parallel.pipeline_stages=1"], "python", flags=["--stop-at", "4"])
    run = str(tmp_path / "p1")
    shutil.copytree(p1, run, ignore=shutil.ignore_patterns("checkpoints"))
    assert load_config(os.path.join(run, "config.yaml")).log.stage_timing
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mmpipe.train.metrics import read_metrics
    recs = read_metrics(os.path.join(run, "metrics.jsonl"))
    fig = report._stages_chart(plt, recs, report._pipeline_stages(run))
    texts = [fig.axes[0].get_title()] + [t.get_text() for t in fig.axes[0].texts]
    assert "one pipeline stage (P = 1)" in texts[0] and not any("no stage timing" in t for t in texts)
    assert any(t.startswith("compute ") and "loader wait" in t for t in texts)
    plt.close(fig)
    written = report.write_report(run)
    with Image.open([p for p in written if p.endswith("stages.png")][0]) as im:
        assert im.format == "PNG"
