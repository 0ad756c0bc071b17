"""Resolve a run before it trains: validate the config (everything that needs no process group
first), join the process group, choose the layout (``parallel.layout: auto``), open the data, build
the tokenizer and the family, size the micro-batch and place the stages. ``resolve_run`` returns
one frozen ``ResolvedRun``; the caller's config is never changed (the run derives its own with
``config.replace`` and seals it)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Union

import torch

from mmpipe.config.deepspeed import resolve
from mmpipe.config.groups import FrozenLayout, check_frozen_lrs, freeze_key, frozen_layout, resolve_groups
from mmpipe.config.resolve import resolve_family
from mmpipe.config.schema import RunConfig, family_of, replace
from mmpipe.data.source import (
    check_cache_tokenizer,
    check_cache_tokenizer_fits_weights,
    open_source,
)
from mmpipe.data.tokenizer import (
    has_tokenizer,
    load_tokenizer,
    tokenizer_choice,
    train_tokenizer,
)
from mmpipe.errors import ConfigError, MmpipeError
from mmpipe.families.lora import require_peft
from mmpipe.parallel import roster
from mmpipe.parallel.launchers import adopt
from mmpipe.parallel.plan import (
    Plan,
    parts_from_lists,  # a record older than plans: its stages
)
from mmpipe.parallel.startup import init_distributed
from mmpipe.parallel.topology import Topology
from mmpipe.planning.layouts import layouts_json, plan_layouts
from mmpipe.planning.measure import get_profile
from mmpipe.planning.micro_batch import auto_micro_batch, check_auto_micro_batch
from mmpipe.planning.place import pick_schedule, with_exchanges
from mmpipe.planning.place import place as place_stages
from mmpipe.planning.prices import layer_prices
from mmpipe.train.checkpoint_record import saved_plan
from mmpipe.train.faults import _everywhere, _rank0_decides, _warn, agree
from mmpipe.train.run_dir import check_run_dir, prepare_run_dir, resume_point


@dataclass(frozen=True)
class Placement:
    """This rank's place in the layout: DeepSpeed's config, the topology, its stage and replica,
    and whether it reads the training data (the first stage; the last too when the family has
    label fields, which reach it from the loader, not through the stages)."""
    ds_cfg: dict
    topo: Topology
    stage: int
    dp_rank: int
    reads_inputs: bool
    reads_data: bool


@dataclass(frozen=True)
class ResolvedRun:
    """Everything a run decided before its first step, frozen."""
    cfg: RunConfig
    family: Any
    groups: list
    where: Placement
    source: Any
    val_samples: Optional[list]
    tok: Any
    plan: Plan
    frozen: FrozenLayout  # parameters per layer, frozen parameter names, forward-only layer names
    rank: int
    world: int
    device_name: str
    resume: bool
    layout_doc: Optional[dict] = None

    @property
    def topo(self) -> Topology:
        return self.where.topo

    @property
    def out_dir(self) -> str:
        return self.cfg.train.output_dir

    @property
    def is_reporter(self) -> bool:
        return self.rank == self.topo.reporting_rank


def resolve_run(cfg: RunConfig, resume: Union[bool, str, None] = None, stop_at: Optional[int] = None,
                overwrite: bool = False) -> ResolvedRun:
    """Validate, join the process group, then resolve the run (see the module docstring).
    ``resume``: true, false or ``"auto"`` (None: ``train.resume``)."""
    adopt()  # a scheduler's variables (Slurm, MPI) become torch's before anything reads RANK
    requested = cfg
    auto_layout = cfg.parallel.layout == "auto"
    if auto_layout:  # everything but the layout is checked first, with a stand-in (data parallel)
        cfg = replace(requested, parallel__pipeline_stages=1, parallel__zero_stage=0)
    resume, auto = resume_mode(cfg, cfg.train.resume if resume is None else resume, overwrite)
    fresh = auto is not None and auto[0] is None  # (auto, nothing to continue: replaces a run without a checkpoint)
    cfg, family_cls, groups, where, data = validate(cfg, resume, stop_at, overwrite or fresh)
    rank, world = init_distributed(cfg.train.collective_timeout_minutes)
    if world > 1:
        roster.gather()  # so that a rank losing contact can name the one that is gone
    if auto is not None:
        agree_resume_point(auto[0], world, cfg.train.output_dir)
    layout_doc = None
    if auto_layout:
        cfg, where, layout_doc = choose_layout(requested, family_cls, groups, rank, world, resume)
    prepare_run_dir(cfg, rank, resume, overwrite or fresh, auto)
    import torch.distributed as dist
    dist.barrier()
    cfg, tok, family, frozen = build_family(cfg, family_cls, groups, rank, data.source)
    cfg, where, plan = place(cfg, family, where, tok, data.source, frozen, rank, world, resume,
                             auto_mbs=requested.parallel.micro_batch_size == "auto")
    return ResolvedRun(cfg, family, groups, where, data.source, data.val, tok, plan, frozen, rank, world,
                       _device_name(), resume, layout_doc)


def resume_mode(cfg: RunConfig, mode, overwrite: bool) -> tuple:
    """(whether to resume, ``(checkpoint or None,)`` for ``auto``, else None)."""
    if mode != "auto":
        return bool(mode), None
    if overwrite:
        raise _everywhere(ConfigError, "--resume auto and --overwrite contradict each other: auto continues the run "
                          f"in train.output_dir={cfg.train.output_dir} when it holds a checkpoint, --overwrite "
                          "deletes it")
    try:
        point = resume_point(cfg.train.output_dir)
    except ConfigError as e:
        raise _everywhere(ConfigError, str(e)) from None
    return point is not None, (point,)


def agree_resume_point(point: Optional[str], world: int, out_dir: str) -> None:
    """Every rank found the same checkpoint (a partly written one is passed over alike)."""
    import torch.distributed as dist
    points = [None] * world
    dist.all_gather_object(points, point)
    other = next((r for r, p in enumerate(points) if p != points[0]), None)
    if other is not None:
        raise _everywhere(ConfigError, f"train.resume=auto: rank 0 finds {points[0] or 'no checkpoint'} in "
                          f"{out_dir}/checkpoints, rank {other} {points[other] or 'none'}: train.output_dir must be "
                          "one directory every node sees (a shared filesystem)")


LORA_KEYS = ("optim.lora_rank", "optim.lora_alpha", "optim.lora_dropout", "optim.target_modules")


def check_lora_keys(cfg: RunConfig) -> None:
    """LoRA settings without ``optim.train_type: lora`` would train every weight: refused when the
    train type was left at its default (ms-swift's default is lora, mmpipe's full), said when chosen."""
    import dataclasses
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(cfg.optim)}
    # set, and to another value than the default (a saved config.yaml names every key)
    given = [k for k in LORA_KEYS if k in cfg.explicit and cfg.get(k) != defaults[k.split(".", 1)[1]]]
    if cfg.optim.train_type != "full" or not given:
        return
    if "optim.train_type" not in cfg.explicit:
        raise ConfigError(f"{', '.join(given)} set but optim.train_type is full (mmpipe's default; ms-swift's is lora), "
                          "which trains every weight: set optim.train_type=lora, or drop the LoRA keys")
    if int(os.environ.get("RANK", "0")) == 0:
        _warn(f"optim.train_type=full trains every weight; {', '.join(given)} are not used")


def _device_name() -> str:
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name()


class Validated(NamedTuple):
    """What ``validate`` decided without a process group."""
    cfg: RunConfig  # the run's own config
    family_cls: type
    groups: list
    where: "Placement"
    data: "RunData"


def validate(cfg: RunConfig, resume: bool, stop_at: Optional[int], overwrite: bool) -> Validated:
    """Everything that needs no process group, first: config mistakes end as one line, raised
    alike on every rank (printed once)."""
    # the run's own copy: adopting DeepSpeed-JSON / Accelerate values is part of its resolution
    cfg = replace(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if stop_at is not None and stop_at < 1:
            raise ConfigError(f"--stop-at {stop_at}: give a step >= 1 (the run stops after that step with a "
                              "checkpoint)")
        check_run_dir(cfg.train.output_dir, resume, overwrite)
        if cfg.optim.train_type == "lora":  # optional imports before anything is written to train.output_dir
            require_peft()
        check_lora_keys(cfg)
        family_cls = family_of(cfg)
        if cfg.parallel.micro_batch_size == "auto":  # validated with a stand-in (the per-rank batch); probed later
            check_auto_micro_batch(cfg)
            stand_in = max(1, cfg.train.batch_size // max(1, world // cfg.parallel.pipeline_stages))
            cfg = replace(cfg, parallel__micro_batch_size=stand_in)
        if cfg.train.precision == "fp16" and _device_name() == "cpu":
            raise ConfigError("train.precision=fp16 needs a GPU: DeepSpeed refuses fp16 on the CPU accelerator; "
                              "use bf16 or fp32 here")
        groups = resolve_groups(cfg.optim, family_cls)
        check_frozen_lrs(cfg.optim, family_cls, groups)
        where = locate(cfg, family_cls, groups)
        # (parallel.layout: auto has not chosen yet: every rank opens the data, once)
        data = open_data(cfg, family_cls, read=where.reads_data or int(os.environ.get("RANK", "0")) == 0
                         or cfg.parallel.layout == "auto")
    except MmpipeError as e:
        e.everywhere = True
        raise
    return Validated(cfg, family_cls, groups, where, data)


def locate(cfg: RunConfig, family_cls, groups: list) -> Placement:
    """The part of the resolution that depends on the layout: DeepSpeed's config, the topology,
    this rank's stage and what it reads, ZeRO-2/3 against per-group clipping. ``parallel.layout:
    auto`` runs it again, alone, for the layout it chose."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    ds_cfg, topo = resolve(cfg, world)
    stage, dp_rank = topo.coords(rank)
    if cfg.parallel.zero_stage >= 2 and any(g.max_grad_norm is not None for g in groups):
        raise ConfigError(f"per-group clipping (optim.groups.*.max_grad_norm) supports ZeRO 0/1, not "
                          f"parallel.zero_stage={cfg.parallel.zero_stage}: use zero_stage 1, or only "
                          "optim.max_grad_norm (DeepSpeed clips globally under ZeRO-2/3)")
    reads_inputs = stage == 0
    reads_data = reads_inputs or (bool(family_cls.labels) and topo.is_last_stage(rank))
    return Placement(ds_cfg, topo, stage, dp_rank, reads_inputs, reads_data)


class RunData(NamedTuple):
    source: object  # data.source.TrainSource
    val: Optional[list]  # the val records, or None


def open_data(cfg: RunConfig, family_cls, read: bool) -> RunData:
    """(the training source, the val records): every rank reads the val records (all stages need
    the eval micro-batch count)."""
    source = open_source(cfg, read=read, family=family_cls)
    val = family_cls.read_records(cfg.data.val, cfg.data, "data.val") if cfg.data.val else None
    return RunData(source, val)


def choose_layout(requested: RunConfig, family_cls, groups: list, rank: int, world: int, resume: bool) -> tuple:
    """``parallel.layout: auto``: rank 0 predicts every layout of this world (``mmpipe.planning.layouts``)
    and every rank takes the fastest that fits; a resume keeps the layout its run chose. Returns
    (config, placement, the layouts document to save or None)."""
    saved = os.path.join(requested.train.output_dir, "layout.json")

    def decide():
        if resume and os.path.isfile(saved):
            with open(saved) as fh:
                doc = json.load(fh)
            if doc.get("world") == world:
                return {"chosen": doc["chosen"], "why": f"kept from {saved} ({doc['why']})", "doc": None}
        res = plan_layouts(requested, world, log=lambda m: _warn(f"layout: {m}"))
        doc = layouts_json(res)
        return {"chosen": doc["chosen"], "why": res["why"], "doc": doc}
    choice = _rank0_decides(rank, decide)
    c = choice["chosen"]
    # a pipeline row's placement ("auto:balanced": auto, which chose balanced); a data-parallel
    # row has none, and the requested one (type:REGEX included) stays as it is
    placement = c["placement"].split(":")[0] if c["placement"] else requested.parallel.placement
    cfg = replace(requested, parallel__pipeline_stages=c["pipeline_stages"], parallel__zero_stage=c["zero_stage"],
                  parallel__placement=placement, parallel__expert_parallel=c.get("expert_parallel", 1),
                  parallel__activation_checkpointing="all" if c.get(
                      "checkpointing", requested.parallel.activation_checkpointing == "all") else "none")
    if rank == 0:
        _warn(f"parallel.layout=auto -> {c['name']}: pipeline_stages={c['pipeline_stages']} data_parallel="
              f"{c['data_parallel']} zero_stage={c['zero_stage']}"
              + (f" expert_parallel={c['expert_parallel']}" if c.get("expert_parallel", 1) > 1 else "")
              + (f" placement={placement}"
                                                                      if c["pipeline_stages"] > 1 else "")
              + (" activation_checkpointing=all" if cfg.parallel.activation_checkpointing == "all" else "") + f" ({choice['why']})")
    try:  # the rest of the config was validated with the stand-in: only the layout's part again
        where = locate(cfg, family_cls, groups)
    except MmpipeError as e:
        e.everywhere = True
        raise
    return cfg, where, choice["doc"] if rank == 0 else None


def build_family(cfg: RunConfig, family_cls, groups: list, rank: int, source) -> tuple:
    """(config with the fields left to the tokenizer resolved, tokenizer, family, frozen layout)."""
    tok = agree(rank, lambda: prepare_tokenizer(cfg, family_cls, rank, source))
    cfg, family = agree(rank, lambda: _experts_split(*_balance_keeps_the_loss(*resolve_family(cfg, tok))))
    return cfg, tok, family, frozen_layout(family, groups)


def _experts_split(cfg: RunConfig, family) -> tuple:
    """``parallel.expert_parallel`` divides the routed experts (known once a checkpoint's config is read)."""
    E = cfg.parallel.expert_parallel
    if E > 1 and family.num_experts % E:
        raise ConfigError(f"parallel.expert_parallel={E} does not divide model.llm.num_experts={family.num_experts}: "
                          f"each rank of an expert-parallel group holds num_experts / E experts; use a divisor of "
                          f"{family.num_experts}")
    return cfg, family


def _balance_keeps_the_loss(cfg: RunConfig, family) -> tuple:
    """``data.balance: cost`` regroups each step's samples among its micro-batches: the loss stays the
    same only where it is the step's token mean or one loss over the step (not a mean of micro-batch losses)."""
    if cfg.data.balance == "cost" and not (family.token_mean or family.step_loss):
        raise ConfigError("data.balance=cost regroups each step's samples among its micro-batches, and this model's "
                          "loss is a mean of per-micro-batch losses (model.negatives=micro_batch: each caption "
                          "against its micro-batch's images), which the grouping would change: use "
                          "model.negatives=global, or data.balance=none")
    return cfg, family


def place(cfg: RunConfig, family, where: Placement, tok, source, frozen: FrozenLayout, rank: int, world: int,
          resume: bool, auto_mbs: bool) -> tuple:
    """``micro_batch_size: auto`` (probed on rank 0), then the plan (rank 0, once); the config is
    resolved after this and sealed. Returns (config, placement, plan)."""
    part_params, frozen_names, forward_only = frozen
    if auto_mbs:
        m = _rank0_decides(rank, lambda: probe_micro_batch(cfg, family, source, tok, where.topo, forward_only,
                                                           frozen_names))
        cfg = replace(cfg, parallel__micro_batch_size=m)
        ds_cfg, topo = resolve(cfg, world)
        where = Placement(ds_cfg, topo, *topo.coords(rank), where.reads_inputs, where.reads_data)
        if rank == 0:
            _warn(f"parallel.micro_batch_size=auto -> {m} (accumulation {topo.accumulation_steps})")
    cfg.seal()
    saved = saved_plan(os.path.join(cfg.train.output_dir, "checkpoints")) if resume else None
    plan = _rank0_decides(rank, lambda: make_plan(cfg, family, where.topo, frozen_names, forward_only, saved))
    if plan.chosen and rank == 0:
        _warn(f"parallel.placement=auto -> {plan.chosen} ({plan.why})")
    if cfg.parallel.schedule == "auto" and plan.num_stages > 1 and rank == 0:
        print(f"[mmpipe] parallel.schedule=auto -> {plan.order.name}" + (" (predicted " + ", ".join(
            f"{k} {1e3 * v:.1f} ms" for k, v in plan.schedules.items()) + ")" if plan.schedules else ""), flush=True)
    check_frozen_stages(cfg, plan, part_params, frozen_names)
    return cfg, where, plan


def check_frozen_stages(cfg: RunConfig, plan: Plan, part_params: dict, frozen_names) -> None:
    if plan.num_stages == 1 or (cfg.parallel.zero_stage == 0 and cfg.train.precision == "fp32"):
        return
    for s_, names in enumerate(plan.stages):
        if all(pn in frozen_names for part in names for pn in part_params[part]):
            raise _everywhere(ConfigError,
                f"pipeline stage {s_} ({names[0]} .. {names[-1]}) holds only frozen parameters, which "
                f"DeepSpeed's ZeRO-{cfg.parallel.zero_stage}/{cfg.train.precision} optimizer cannot hold; "
                "use zero_stage 0 with fp32, parallel.placement=auto, or a parallel.plan that gives every stage a "
                "trainable layer")


def prepare_tokenizer(cfg: RunConfig, family, rank: int, source=None):
    """The run's tokenizer: ``data.tokenizer``, else the cache's, else the text weights' own (a
    pretrained directory's tokenizer files), else one trained on rank 0 from the captions (saved in
    the run directory); then given the family's special tokens (``Family.prepare_tokenizer``)."""
    weights_key, weights_dir = family.tokenizer_weights(cfg.model)
    if weights_dir and not cfg.data.tokenizer and not cfg.data.cache and not has_tokenizer(weights_dir):
        raise ConfigError(f"{weights_key}={weights_dir} holds pretrained text weights but no tokenizer, and "
                          "data.tokenizer is unset: a tokenizer trained on the captions would feed those weights "
                          "ids they never saw; set data.tokenizer to the tokenizer the weights were trained with")
    tok_dir, what = tokenizer_choice(cfg.data, weights_key, weights_dir, cfg.train.output_dir)
    if what == "tokenizer in the run directory":  # trained on rank 0 from the captions, once

        def train():
            tok = family.prepare_tokenizer(train_tokenizer(source.captions(family=family),
                                                           cfg.data.tokenizer_vocab_size, tok_dir))
            tok.save_pretrained(tok_dir)
            return True
        _rank0_decides(rank, lambda: None if os.path.isfile(os.path.join(tok_dir, "tokenizer.json")) else train())
    tok = load_tokenizer(tok_dir, what)
    if cfg.data.tokenizer:
        check_cache_tokenizer(cfg, tok)
    elif cfg.data.cache and weights_dir:
        check_cache_tokenizer_fits_weights(cfg.data.cache, weights_key, weights_dir)
    return family.prepare_tokenizer(tok)


def make_plan(cfg, family, topo, frozen, forward_only, saved=None, measure: bool = True):
    """The run's ``Plan`` (``mmpipe.planning.place.place``), computed once, on rank 0: on a resume of a
    measured placement, the checkpoint's plan (a new profile could differ); else from measured costs
    (``parallel.profile``, unless ``measure`` is False), else from trainable parameters."""
    names, segments, P = family.layer_names(), family.segments(), topo.pipeline_stages
    M, mbs = topo.accumulation_steps, topo.micro_batch_size
    p = cfg.parallel
    hint = lambda layer: freeze_key(cfg.optim, family, layer)  # noqa: E731 - what frozen_first's refusal names
    measured = measure and P > 1 and p.profile and not p.plan and p.placement in ("modality", "balanced", "auto")
    stages = (saved or {}).get("stages")
    balance = measure and cfg.data.balance == "cost"
    if measured and stages and len(stages) == P and [n for s in stages for n in s] == names:
        if "parts" in saved:
            plan = Plan.from_json(saved)
            if balance and not plan.prices:
                plan.prices = _prices(cfg, family, mbs, forward_only, frozen, None)
        else:
            plan = Plan(names, segments, parts_from_lists(names, stages), p.placement, M, mbs, "checkpoint")
        # the order holds no state: a resume runs the schedule this config names (auto: the saved one)
        return pick_schedule(p.schedule, plan, None, forward_only, hint) if p.schedule not in ("auto", plan.schedule) \
            else plan
    # (a different model: the layout check says what the checkpoint holds)
    params = family.meta_params()
    prof = None
    if measured:
        prof = get_profile(cfg, family, mbs, forward_only, frozen, threads=torch.get_num_threads(),
                           measure_comm=p.placement == "auto", log=lambda s: print(f"[mmpipe] {s}", flush=True),
                           run_micro_batches=cfg.train.steps * M / P)
        prof = with_exchanges(prof, topo.expert_parallel)  # (expert parallelism: MoE layers priced with their
        # token exchanges; the memory model told the degree)
    costs = ([sum(v.values()) for v in params.values()] if p.placement == "parameters" else
             [1 + sum(n for name, n in v.items() if name not in frozen) for v in params.values()])
    plan = place_stages(names, segments, P, p.placement, M, schedule=p.schedule, prof=prof, param_costs=costs,
                        plan_file=p.plan, micro_batch_size=mbs, precision=cfg.train.precision, zero_stage=p.zero_stage,
                        data_parallel=topo.data_parallel, forward_only=forward_only, freeze_hint=hint,
                        **cut_limits(cfg, params, frozen))
    if plan.why and "moved onto the stage before" in plan.why and not plan.chosen:
        print(f"[mmpipe] parallel.placement={p.placement}: {plan.why}; stage boundaries {plan.parts}", flush=True)
    if balance:  # a resume keeps the saved prices: its steps are regrouped as the first run's were
        plan.prices = (saved or {}).get("prices") or _prices(cfg, family, mbs, forward_only, frozen, prof)
    return plan


def cut_limits(cfg, params: dict, frozen) -> dict:
    """What bounds any cut of this run (its plan's and a re-plan's): ``memory_cap`` (``parallel.memory_budget_gb``)
    and ``trains`` (per layer: holds a trained parameter; ``params``: ``Family.meta_params()``)."""
    gb = cfg.parallel.memory_budget_gb
    return {"memory_cap": int(gb * 2**30) if gb else None,
            "trains": [any(n not in frozen for n in v) for v in params.values()]}


def _prices(cfg, family, mbs: int, forward_only, frozen, prof) -> dict:
    """``data.balance: cost``'s per-layer prices, from ``prof`` or a profile taken (or read from the cache) now."""
    if prof is None:
        prof = get_profile(cfg, family, mbs, forward_only, frozen, threads=torch.get_num_threads(),
                           measure_comm=False, log=lambda s: print(f"[mmpipe] {s}", flush=True))
    return layer_prices(prof, family, cfg, mbs)


def probe_micro_batch(cfg, family, source, tok, topo, forward_only, frozen) -> int:
    """Probe real batches for the largest micro-batch that fits (``mmpipe.planning.measure.auto_micro_batch``),
    against the stage boundaries of the plan without measured costs (a plan file, ``type:``,
    DeepSpeed's methods: the run's own; measured placements: their parameter-cost estimate)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    budget = int((cfg.parallel.memory_budget_gb or acc.total_memory() / 2**30) * 2**30)
    parts = make_plan(cfg, family, topo, frozen, forward_only, measure=False).parts
    m, _ = auto_micro_batch(cfg, family, source, tok, topo.pipeline_stages,
                            topo.data_parallel, parts, forward_only, frozen, budget, torch.device(acc.device_name()),
                            log=lambda s: print(f"[mmpipe] {s}", flush=True))
    return m
