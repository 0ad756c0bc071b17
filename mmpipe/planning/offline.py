"""Planning outside a training run: the config resolved as a run would resolve it
(``resolve_for_plan``), the layer profile of a layout on this machine, every placement planned and
compared (``plan_all``, ``format_plan``: ``mmpipe plan``, the benches) and the predicted memory of
a finished run (``run_memory``: ``mmpipe plan --memory``, ``mmpipe bench memory``)."""
from __future__ import annotations

import os
from typing import Optional

from mmpipe.config.groups import frozen_layout, resolve_groups
from mmpipe.config.resolve import resolve_family
from mmpipe.config.schema import family_of, replace
from mmpipe.data.tokenizer import StandInTokenizer, load_tokenizer, tokenizer_choice
from mmpipe.errors import ConfigError
from mmpipe.parallel.plan import order_of_json
from mmpipe.parallel.schedules import default_order
from mmpipe.parallel.topology import threads_per_rank
from mmpipe.planning.measure import get_profile, meta_profile
from mmpipe.planning.memory import adamw_temp_bytes, run_shape, stage_breakdown, stage_memory
from mmpipe.planning.place import layer_costs, place, predict, stage_times
from mmpipe.planning.profiler import median_costs


def run_memory(cfg, run_dir: str, world: int, use_cache: bool = True, log=None, meta: bool = False) -> list:
    """Predicted peak per stage (``MemoryBreakdown``) of a finished run: its resolved config, its
    plan's parts and micro-batches, the layer profile at its micro-batch shape (bytes only; ``meta``:
    sized on the meta device, for a model this process cannot hold or run)."""
    import json
    plan_file = os.path.join(run_dir, "plan.json")
    if os.path.isfile(plan_file):
        with open(plan_file) as fh:
            run_plan = json.load(fh)
        parts, M, order = run_plan["parts"], run_plan["micro_batches"], order_of_json(run_plan)
    else:  # P = 1 (no plan written): the whole model on each of ``world`` data-parallel ranks
        parts, M, order = None, cfg.train.batch_size // (int(cfg.parallel.micro_batch_size) * world), default_order()
    if os.path.isdir(os.path.join(run_dir, "tokenizer")):  # the run's own vocabulary
        from dataclasses import replace as dc_replace
        cfg = replace(cfg, data=dc_replace(cfg.data, tokenizer=os.path.join(run_dir, "tokenizer")))
    P = len(parts) - 1 if parts else 1
    # bytes only: one untimed-quality pass is exact, and it is not cached (a plan must not time with it)
    if meta:
        rcfg, family = resolve_for_plan(cfg)
        _, frozen, forward_only = frozen_layout(family, resolve_groups(rcfg.optim, type(family)))
        prof = meta_profile(rcfg, family, int(cfg.parallel.micro_batch_size), forward_only, frozen)
    else:
        family, prof = _profile_for(cfg, P, world // P, log=log or (lambda m: None), use_cache=False,
                                    measure_comm=False, passes=1, repeats=1)
    ds_file = os.path.join(run_dir, "ds_config.json")
    if os.path.isfile(ds_file):  # the AdamW kernel the run took (``optim.fused``), wherever it is read
        with open(ds_file) as fh:
            if ((json.load(fh).get("optimizer") or {}).get("params") or {}).get("fused"):
                prof["adamw_temp"] = adamw_temp_bytes("fused")
    parts = parts or [0, len(prof["layers"])]
    return stage_breakdown(layer_costs(prof), parts, M, cfg.train.precision, cfg.parallel.zero_stage, world // P,
                           run_shape(prof, order))


# ---- mmpipe plan ----------------------------------------------------------------------------------
PLACEMENTS = ("modality", "balanced", "auto", "parameters", "uniform")


def resolve_for_plan(cfg):
    """(resolved config, family) without a training run: vocabulary from the run's tokenizer where
    it exists already (``data.tokenizer``, the cache's, the text weights'), else the configured size (only the embedding table
    depends on it)."""
    fam = family_of(cfg)
    # the tokenizer a training run would use (so its profile is the run's)
    tok_dir, what = tokenizer_choice(cfg.data, *fam.tokenizer_weights(cfg.model), run_dir=None)
    if tok_dir and (what != "data.cache tokenizer" or os.path.isdir(tok_dir)):
        tok = fam.prepare_tokenizer(load_tokenizer(tok_dir, what))
    else:  # the WordPiece tokenizer mmpipe would train, by its size
        text = getattr(cfg.model, "text", None) or getattr(cfg.model, "llm", None) or cfg.model
        size = getattr(text, "vocab_size", None)  # the model's table holds the special tokens too
        size = size - len(fam.special_tokens) if size else cfg.data.tokenizer_vocab_size
        tok = StandInTokenizer(size, fam.special_tokens)
    return resolve_family(cfg, tok)


def _profile_for(cfg, stages: int, data_parallel: int = 1, threads: Optional[int] = None, log=print,
                 **profile_kw) -> tuple:
    """(family, profile) for a run of ``stages`` x ``data_parallel`` ranks on this machine."""
    mbs = cfg.parallel.micro_batch_size
    if mbs == "auto":
        raise ConfigError("mmpipe plan: parallel.micro_batch_size=auto; give the size a run chose (its config.yaml)")
    cfg, family = resolve_for_plan(cfg)
    _, frozen, forward_only = frozen_layout(family, resolve_groups(cfg.optim, type(family)))
    threads = threads or threads_per_rank(stages * data_parallel)
    return family, get_profile(cfg, family, mbs, forward_only, frozen, threads=threads, log=log, **profile_kw)


def median_profile(profiles: list) -> dict:
    """One profile from several of the same model and shape: each layer's forward, backward and
    optimizer time is its median over them (the first one's transfer model and key)."""
    costs = median_costs([layer_costs(p) for p in profiles])
    return {**profiles[0], "layers": [c.to_dict() for c in costs], "samples": len(profiles)}


def plan_all(cfg, stages: int, data_parallel: int = 1, threads: Optional[int] = None, use_cache: bool = True,
             log=print, refresh: bool = False, repeats: int = 5, profile: Optional[dict] = None) -> dict:
    """Profile (or take ``profile``), then place (``mmpipe.planning.place.place``) and simulate every
    placement for ``stages`` stages."""
    if profile is None:
        family, prof = _profile_for(cfg, stages, data_parallel, threads, log, use_cache=use_cache, refresh=refresh,
                                    repeats=repeats)
    else:
        family, prof = resolve_for_plan(cfg)[1], profile
    mbs = cfg.parallel.micro_batch_size
    M = cfg.train.batch_size // (mbs * data_parallel)
    threads = prof["key"]["threads"]
    names, segments = family.layer_names(), family.segments()
    costs = layer_costs(prof)
    out = {"names": names, "micro_batches": M, "micro_batch_size": mbs, "threads": threads, "profile": prof,
           "placements": {}, "plans": {}}
    cap = int(cfg.parallel.memory_budget_gb * 2**30) if cfg.parallel.memory_budget_gb else None
    for pl in PLACEMENTS + ((cfg.parallel.placement,) if cfg.parallel.placement.startswith("type:") else ()):
        plan = place(names, segments, stages, pl, M, schedule=cfg.parallel.schedule, prof=prof, micro_batch_size=mbs,
                     memory_cap=cap, precision=cfg.train.precision, zero_stage=cfg.parallel.zero_stage,
                     data_parallel=data_parallel)
        parts = plan.parts
        sim = predict(prof, parts, M, plan.order)
        mem = stage_memory(costs, parts, M, cfg.train.precision, cfg.parallel.zero_stage, data_parallel,
                           run_shape(prof, plan.order))
        out["plans"][pl] = plan
        out["placements"][pl] = {"parts": parts, "stages": plan.stages, "sim": sim.to_dict(), "order": plan.order,
                                 "stage_times": stage_times(prof, parts), "memory": mem}
    return out


def single_process_time(prof: dict, micro_batches: int) -> float:
    """Predicted step of the whole model on one process (one thread per rank's share)."""
    costs = layer_costs(prof)
    return micro_batches * sum(c.fwd_ms + c.bwd_ms for c in costs) / 1e3 + sum(c.opt_ms for c in costs) / 1e3


def format_plan(plan: dict, chosen: str, batch: int) -> str:
    lines = [f"micro-batch {plan['micro_batch_size']} x {plan['micro_batches']} per step, "
             f"{plan['threads']} thread(s) per rank; predicted (DeepSpeed 1F1B, simulated):",
             "| placement | step ms | samples/s | bubble | stage layers |", "|---|---|---|---|---|"]
    for name, p in plan["placements"].items():
        sizes = "+".join(str(len(s)) for s in p["stages"])
        lines.append(f"| {name}{' (configured)' if name == chosen else ''} | {1e3 * p['sim']['step_time']:.1f} | "
                     f"{batch / p['sim']['step_time']:.1f} | {p['sim']['bubble']:.0%} | {sizes} |")
    p = plan["placements"][chosen]
    lines += ["", f"{chosen}, per stage:", "| stage | layers | fwd+bwd ms per micro-batch | memory MB | idle |",
              "|---|---|---|---|---|"]
    t = p["stage_times"]
    for s, names in enumerate(p["stages"]):
        lines.append(f"| {s} | {names[0]} .. {names[-1]} ({len(names)}) | {1e3 * (t['F'][s] + t['B'][s]):.2f} | "
                     f"{p['memory'][s] / 2**20:.1f} | {p['sim']['idle_frac'][s]:.0%} |")
    return "\n".join(lines)


