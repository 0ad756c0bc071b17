"""Pictures of plans: the layouts chart of ``mmpipe plan --world`` and a pipeline plan's stage
balance (predicted, and measured from a run)."""
from __future__ import annotations

from typing import Optional

from mmpipe.planning.layouts import LayoutPrediction


def write_memory_png(path: str, rows: list, chosen: Optional[LayoutPrediction], budget: int, title: str = "") -> None:
    """Predicted peak memory per layout (bar: the fullest rank; dots: every stage), the budget as a
    dashed line; the chosen layout green, those that do not fit red."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted((r for r in rows if r.micro_batches), key=lambda r: r.peak)
    fig, ax = plt.subplots(figsize=(2 + 0.5 * len(rows), 4.5))
    colour = ["C2" if chosen is not None and r.name == chosen.name else ("C0" if r.fits else "C3") for r in rows]
    ax.bar(range(len(rows)), [r.peak / 2**30 for r in rows], 0.7, color=colour)
    for i, r in enumerate(rows):
        ax.plot([i] * len(r.memory), [m / 2**30 for m in r.memory], "k.", markersize=4)
    ax.axhline(budget / 2**30, color="k", linestyle="--", linewidth=1, label=f"budget {budget / 2**30:.1f} GB")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r.name for r in rows], rotation=40, ha="right", fontsize=7)
    ax.set_ylabel("GB per rank (bar: fullest stage, dots: each stage)")
    ax.set_title(title or "predicted peak memory per layout (green: chosen, red: does not fit)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_png(path: str, rows: list, chosen: Optional[LayoutPrediction] = None,
              measured: Optional[dict] = None, title: str = "") -> None:
    """Predicted step time (and measured, if given) per layout; layouts that do not fit hatched."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r.micro_batches]
    fig, ax = plt.subplots(figsize=(2 + 0.9 * len(rows), 4))
    xs = range(len(rows))
    ax.bar(xs, [1e3 * r.step_time for r in rows], 0.4 if measured else 0.7,
           color=["C2" if chosen is not None and r.name == chosen.name else "C0" for r in rows],
           hatch=None, label="predicted")
    for i, r in enumerate(rows):
        if not r.fits:
            ax.text(i, 1e3 * r.step_time, "does not fit", ha="center", va="bottom", fontsize=7, rotation=90)
    if measured:
        ax.bar([i + 0.4 for i in xs], [1e3 * measured.get(r.name, float("nan")) for r in rows], 0.4, color="C1",
               label="measured")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r.name for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_title(title or "layouts: predicted step time (green: chosen)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plan_png(path: str, plan: dict, measured: Optional[dict] = None) -> None:
    """Per placement, per stage: predicted busy and idle milliseconds per step (and measured, if given)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(plan["placements"])
    P = len(plan["placements"][names[0]]["stages"])
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(names), 4))
    width = 0.8 / P
    for s in range(P):
        xs = [i + s * width for i in range(len(names))]
        busy = [1e3 * plan["placements"][n]["sim"]["busy"][s] for n in names]
        step = [1e3 * plan["placements"][n]["sim"]["step_time"] for n in names]
        ax.bar(xs, busy, width * 0.9, color=f"C{s}", label=f"stage {s} busy")
        ax.bar(xs, [a - b for a, b in zip(step, busy)], width * 0.9, bottom=busy, color=f"C{s}", alpha=0.25,
               label=f"stage {s} idle")
    if measured:
        for i, n in enumerate(names):
            if n in measured:
                ax.plot([i - 0.05, i + 0.8], [1e3 * measured[n]] * 2, "k--", lw=1)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
    ax.set_xticklabels(names)
    ax.set_ylabel("ms per step (predicted)")
    ax.set_title("stage balance per placement" + (" (dashed: measured step)" if measured else ""))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
