"""``mmpipe report --run DIR``: PNG charts of a run's ``metrics.jsonl`` over steps, in DIR/report/:
``loss.png`` (training loss and eval losses on one axis; eval ratios such as accuracy or recall on a
second), ``throughput.png`` (samples/s and step time; model TFLOP/s per device and MFU / HFU, the
medians over the steps, in its title), ``stages.png`` (per-stage busy / data / idle share of each
step) and ``grad_norms.png`` (per-group gradient norms, and the clip limits' effect); the command
prints the TFLOP/s line too."""
from __future__ import annotations

import os

from mmpipe.config.schema import load_config
from mmpipe.errors import MmpipeError
from mmpipe.train.metrics import read_metrics


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_report(run_dir: str, out: str = None) -> list:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise MmpipeError(f"--run {run_dir}: no metrics.jsonl (not an mmpipe run directory, or it has not "
                          "finished a step)")
    recs = read_metrics(path)
    if not recs:
        raise MmpipeError(f"{path}: no training steps recorded yet")
    evals = read_metrics(path, kind="eval")
    out = out or os.path.join(run_dir, "report")
    os.makedirs(out, exist_ok=True)
    plt = _plt()
    steps = [r["step"] for r in recs]
    written = []

    def save(fig, name):
        fig.tight_layout()
        p = os.path.join(out, name)
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    save(_loss_chart(plt, recs, evals), "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r.get("samples_per_sec") for r in recs], label="samples/s")
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s")
    ax2 = ax.twinx()
    ax2.plot(steps, [1e3 * r.get("step_time", float("nan")) for r in recs], "C1", alpha=0.6, label="step ms")
    ax2.set_ylabel("step ms")
    ax.legend(loc="upper left", fontsize=7)
    ax2.legend(loc="upper right", fontsize=7)
    util = utilization_line(recs)
    ax.set_title("throughput" + (f"\n{util}" if util else ""), fontsize=9)
    save(fig, "throughput.png")

    save(_stages_chart(plt, recs, _pipeline_stages(run_dir)), "stages.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    groups = [k for k in recs[0] if k.startswith("grad_norm.")]
    for k in groups or ["grad_norm"]:
        ax.plot(steps, [r.get(k) for r in recs], label=k)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm (before clipping)")
    ax.legend(fontsize=7)
    ax.set_title("per-group gradient norms")
    save(fig, "grad_norms.png")
    return written


def _loss_chart(plt, recs: list, evals: list):
    """The training loss, with the eval losses beside it on the loss axis (a VLM's ``val_loss``) and
    the eval ratios (accuracy, recall) on a second axis."""
    steps = [r["step"] for r in recs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r.get("loss") for r in recs], label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    skipped = [r["step"] for r in recs if r.get("skipped")]
    for s in skipped:
        ax.axvline(s, color="r", alpha=0.3)
    keys = [k for k in (evals[0] if evals else {}) if k not in ("kind", "step", "n") and isinstance(evals[0][k], float)]
    at = [e["step"] for e in evals]
    for key in [k for k in keys if "loss" in k]:
        ax.plot(at, [e.get(key) for e in evals], "o--", label=f"eval {key}")
    ratios = [k for k in keys if "loss" not in k][:4]
    if ratios:
        ax2 = ax.twinx()
        for i, key in enumerate(ratios):
            ax2.plot(at, [e.get(key) for e in evals], "s:", color=f"C{i + 2}", label=f"eval {key}")
        ax2.set_ylabel("eval (ratio)")
        ax2.legend(loc="upper right", fontsize=7)
    ax.legend(loc="upper left", fontsize=7)
    ax.set_title("loss" + (f" (red: {len(skipped)} skipped steps)" if skipped else ""))
    return fig


def _pipeline_stages(run_dir: str) -> int:
    """P of the run (its resolved config.yaml; 1 when it has none)."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return 1
    p = load_config(path).parallel.pipeline_stages
    return p if isinstance(p, int) else 1


def _stages_chart(plt, recs: list, pipeline_stages: int = 1):
    """Per-stage busy / data / idle share of the step, averaged over the steps (P = 1: the one
    stage's compute and loader wait)."""
    P = sum(1 for k in recs[0] if k.startswith("stage") and k.endswith(".busy"))
    fig, ax = plt.subplots(figsize=(7, 1.2 + 1.3 * max(1, P)))
    if P:
        for s in range(P):
            busy = sum(r.get(f"stage{s}.busy", 0) for r in recs) / len(recs)
            data = sum(r.get(f"stage{s}.data", 0) for r in recs) / len(recs)
            idle = sum(r.get(f"stage{s}.idle", 0) for r in recs) / len(recs)
            ax.barh(s, busy, color="C0", label="busy" if s == 0 else None)
            ax.barh(s, data, left=busy, color="C2", label="data" if s == 0 else None)
            ax.barh(s, idle, left=busy + data, color="C3", alpha=0.5, label="idle" if s == 0 else None)
            ax.text(0.01, s, f"busy {busy:.0%} idle {idle:.0%}", va="center", fontsize=8, color="w")
        ax.set_yticks(range(P))
        ax.set_yticklabels([f"stage {s}" for s in range(P)])
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of the step (mean over steps)")
        ax.legend(fontsize=7, loc="lower right")
        ax.set_title("per-stage busy / data / idle")
    elif all("loader_wait_frac" in r for r in recs) and pipeline_stages == 1:
        # one stage (P = 1): nothing to compare between stages; the step's split is compute vs loader wait
        data = sum(r["loader_wait_frac"] for r in recs) / len(recs)
        ax.barh(0, 1 - data, color="C0", label="compute (forward, backward, optimizer)")
        ax.barh(0, data, left=1 - data, color="C2", label="waiting for the loader")
        ax.text(0.01, 0, f"compute {1 - data:.0%} loader wait {data:.0%}", va="center", fontsize=8, color="w")
        ax.set_yticks([0])
        ax.set_yticklabels(["the one stage"])
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of the step (mean over steps)")
        ax.legend(fontsize=7, loc="lower right")
        ax.set_title("one pipeline stage (P = 1): no stages to compare")
    else:
        ax.text(0.5, 0.5, "no stage timing in this run (log.stage_timing false)", ha="center")
    return fig


def utilization_line(recs: list):
    """Model TFLOP/s per device and MFU / HFU, medians over the steps that logged them (metrics.jsonl's
    ``tflops``, ``mfu``, ``hfu``); None when no step did."""
    import statistics
    tflops = [r["tflops"] for r in recs if r.get("tflops") is not None]
    if not tflops:
        return None
    line = f"{statistics.median(tflops):.4g} TFLOP/s per device"
    for key in ("mfu", "hfu"):
        v = [r[key] for r in recs if r.get(key) is not None]
        line += f", {key.upper()} {statistics.median(v):.1%}" if v else f", {key.upper()} n/a (no peak: log.peak_tflops)"
    return line + f" (median of {len(tflops)} steps)"


def cmd_report(args) -> int:
    for p in write_report(args.run, args.out):
        print(f"wrote {p}")
    line = utilization_line(read_metrics(os.path.join(args.run, "metrics.jsonl")))
    if line:
        print(line)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="PNG charts of a run: loss, throughput, per-stage busy/idle, gradient norms")
    p.add_argument("--run", required=True, help="run directory (train.output_dir)")
    p.add_argument("--out", help="where the PNGs go (default: RUN/report)")
    p.set_defaults(func=cmd_report)
