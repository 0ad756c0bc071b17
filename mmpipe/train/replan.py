"""``parallel.replan: auto``: move the stage boundaries during a run when the measured step is slower
than the best placement for the *measured* costs predicts.

After each step (from the step after the first), rank 0 scales every stage's profiled layer times by
that stage's measured busy time over its predicted one (what the stage clock saw against the profile:
data that costs otherwise, a profile taken on a busy machine, a frozen group that now trains), asks the
planner for the best cut of those costs (``auto``: modality or balanced) and compares. When the
median of the last ``parallel.replan_window`` steps is slower than that cut's prediction by more than
``parallel.replan_margin``, and the current cut's own prediction is too (the gain is the cut's, not
a slow machine's), for ``replan_window`` steps in a row, every rank saves a checkpoint, rank 0 writes
the new cut as a plan file and a ``replan`` record in metrics.jsonl, and every process replaces itself
(``os.execv``: the same process, the launcher never notices; under torch's elastic agent the continued
ranks leave the agent's store, as under the deepspeed launcher) with the same command plus ``--resume``
and ``parallel.plan=`` that file: the layout-free resume continues exactly (the same losses and
weights as a run that never moved). One move per run (no thrash); ``MMPIPE_REPLANNED`` marks the
continued run, which logs the gain it then measures (a ``replan_measured`` record)."""
from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Optional

import torch.distributed as dist

from mmpipe.errors import ConfigError
from mmpipe.parallel.plan import stage_lists
from mmpipe.parallel.startup import close_distributed, free_port
from mmpipe.planning.measure import get_profile
from mmpipe.planning.place import layer_costs, place, predict, stage_times
from mmpipe.train.faults import _warn
from mmpipe.train.setup import cut_limits

MOVED = "MMPIPE_REPLANNED"
MOVED_FROM = "MMPIPE_REPLANNED_STEP"  # the measured step (seconds) that the move left behind


class Replanner:
    def __init__(self, run, start_step: int):
        p = run.cfg.parallel
        self.on = p.replan == "auto" and run.topo.pipeline_stages > 1 and not os.environ.get(MOVED)
        if p.replan == "auto" and run.topo.pipeline_stages == 1 and run.is_reporter:
            _warn("parallel.replan=auto moves pipeline stage boundaries: off at parallel.pipeline_stages=1")
        self.window, self.margin = p.replan_window, p.replan_margin
        self.first = start_step + 2  # the first step after this process's first (warm-up) step
        self.seen: list = []  # (step seconds, [busy seconds per stage]) of the recent steps
        self.hits = 0
        self.prof = None
        # the continued run of a move: the measured step before it, until the gain is measured
        self.before = float(os.environ[MOVED_FROM]) if os.environ.get(MOVED) and os.environ.get(MOVED_FROM) else None
        self.after: list = []

    def measured(self, step: int, record: dict) -> Optional[dict]:
        """After a move: once ``replan_window`` steps of the new cut (past the new processes' first) are
        measured, the ``replan_measured`` record (the median step before the move and after it, the gain)."""
        if self.before is None or step < self.first:
            return None
        self.after.append(record["step_time"])
        if len(self.after) < self.window:
            return None
        after, before = statistics.median(self.after), self.before
        self.before = None
        return {"step": step, "measured_before": before, "measured_after": after, "measured_gain": before / after}

    def after_step(self, run, step: int, record: dict) -> Optional[dict]:
        """The move every rank makes after ``step`` (rank 0 decides, everyone learns it), or None."""
        if not self.on or step < self.first:
            return None
        P = run.topo.pipeline_stages
        busy = [sum(record.get(f"stage{s}.{k}_ms", 0.0) for k in ("fwd", "bwd", "opt")) / 1e3 for s in range(P)]
        self.seen = (self.seen + [(record["step_time"], busy)])[-self.window:]
        decision = [None]
        if run.rank == 0 and len(self.seen) == self.window:
            decision[0] = self._decide(run)
        dist.broadcast_object_list(decision, src=0)
        return decision[0]

    def _decide(self, run) -> Optional[dict]:
        plan, cfg, topo = run.plan, run.cfg, run.topo
        M = topo.accumulation_steps
        if self.prof is None:
            _, frozen, forward_only = run.frozen
            self.prof = get_profile(cfg, run.family, topo.micro_batch_size, forward_only, frozen, measure_comm=False,
                                    log=lambda s: print(f"[mmpipe] replan: {s}", flush=True))
        t = stage_times(self.prof, plan.parts)
        measured = statistics.median(s for s, _ in self.seen)
        scale = []
        for s in range(plan.num_stages):
            predicted = M * (t["F"][s] + t["B"][s]) + t["opt"][s]
            seen = statistics.median(b[s] for _, b in self.seen)
            scale.append(seen / predicted if predicted > 0 and seen > 0 else 1.0)
        costs = layer_costs(self.prof)
        scaled = dict(self.prof, layers=[])
        for s in range(plan.num_stages):
            for c in costs[plan.parts[s]:plan.parts[s + 1]]:
                d = c.to_dict()
                for k in ("fwd_ms", "bwd_ms", "bwd_in_ms", "bwd_w_ms"):
                    d[k] = d[k] * scale[s] if d.get(k) is not None else d.get(k)
                scaled["layers"].append(d)
        try:  # under the run's memory budget, as its own plan was: a cut that does not fit is never a move; under
            # the run's schedule (a new cut may change frozen_first's leading frozen stages, nothing else)
            best = place(plan.layers, plan.segments, plan.num_stages, "auto", M, schedule=plan.order.name,
                         prof=scaled, micro_batch_size=topo.micro_batch_size, precision=cfg.train.precision,
                         zero_stage=cfg.parallel.zero_stage, data_parallel=topo.data_parallel,
                         **cut_limits(cfg, run.family.meta_params(), run.frozen[1]))
        except ConfigError:  # no cut fits the budget
            return None
        now = predict(scaled, plan.parts, M, plan.order).step_time
        then = predict(scaled, best.parts, M, best.order).step_time
        slow = measured > then * (1 + self.margin) and now > then * (1 + self.margin) and best.parts != plan.parts
        self.hits = self.hits + 1 if slow else 0
        if self.hits < self.window:
            return None
        return {"old_parts": list(plan.parts), "new_parts": list(best.parts), "measured_step": measured,
                "predicted_now": now, "predicted_new": then, "stage_scale": scale}


def continue_on_new_cut(run, writer, step: int, decision: dict) -> None:
    """Every rank, after its checkpoint at ``step`` and with its data closed (the trainer's part of the
    decision): the new cut as a plan file, then this same process again on it (``os.execv``)."""
    path = os.path.join(run.out_dir, f"replan_step{step}.json")
    port = [None]
    if run.rank == 0:
        with open(path, "w") as fh:
            json.dump({"stages": stage_lists(run.plan.layers, decision["new_parts"])}, fh, indent=2)
        port[0] = free_port()
    if run.is_reporter:
        writer.log_event("replan", {"step": step, **decision})
        writer.info(f"replan at step {step}: stage boundaries {decision['old_parts']} -> "
                    f"{decision['new_parts']} (measured {1e3 * decision['measured_step']:.0f} ms/step, "
                    f"predicted {1e3 * decision['predicted_new']:.0f} ms on the new cut); continuing from "
                    f"the step-{step} checkpoint")
    dist.broadcast_object_list(port, src=0)
    writer.close()
    close_distributed(force=True)  # every rank is here: a barrier, then the groups go (a caller's too: execv)
    os.environ[MOVED] = "1"
    os.environ[MOVED_FROM] = repr(float(decision["measured_step"]))
    os.environ["MASTER_PORT"] = str(port[0])
    # under torch's elastic agent (torchrun, accelerate launch) the ranks joined as clients of the agent's
    # store at its MASTER_PORT; no one serves the new port, and the agent's store still holds the first
    # group's keys: the continued ranks rendezvous as the deepspeed launcher's do (rank 0 hosts a new store)
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    argv = [a for a in sys.argv if a != "--overwrite"]
    argv += ([] if "--resume" in argv else ["--resume"]) + ["--set", f"parallel.plan={path}"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable] + argv)
