"""The DeepSpeed engine of a resolved run: the strategy's module (frozen groups applied), torch
parameter groups, the learning-rate schedule, DeepSpeed's monitors, grouped clipping hooked into
the innermost optimizer, and the records a checkpoint carries."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mmpipe.config.groups import apply_freeze, lr_lambda, mark_embedding_tables, param_groups
from mmpipe.errors import ConfigError
from mmpipe.families.expert_dispatch import ExpertShard, shard_experts
from mmpipe.parallel.ds_compat import (
    create_expert_groups,
    expert_param_groups,
    fix_fp16_backward_scaling,
    moe_engine,
    foreach_unfused_step,
    no_initial_unfused_step,
    no_single_rank_allreduce,
    one_read_overflow_check,
    optimizer_kind,
)
from mmpipe.parallel.layers import set_activation_checkpointing
from mmpipe.parallel.runtime import initialize
from mmpipe.parallel.strategies import strategy_for
from mmpipe.train.checkpoint_record import layout_record, run_record
from mmpipe.train.clipping import GradClipper, innermost_optimizer
from mmpipe.train.grad_dump import save_grads


@dataclass
class Engine:
    engine: Any  # DeepSpeed's engine
    runner: Any  # the strategy's step runner
    clipper: GradClipper
    inner: Any  # the innermost torch optimizer
    named_params: list  # plain names (layout-free checkpoints)
    trainable: list  # the groups that train
    layer_names: Optional[list]  # pipelined: the plan's layers and boundaries
    parts: Optional[list]
    layout: dict  # the checkpoint's layout record
    record: dict  # the checkpoint's run record
    monitor: Any  # DeepSpeed's monitors (tensorboard, csv, wandb blocks of its JSON) or None
    stage_ranks: list  # ranks per stage (per-stage means of the step gather)


def mark_embeddings(model, strategy, family) -> None:
    """Embedding tables take no weight decay, by type (``mark_embedding_tables``); a parameter tied to
    one (a VLM's LM head) is marked with it, also where the tie crosses stages and this stage holds
    only the head's copy: both copies must step alike."""
    mark_embedding_tables(model)
    named = dict(strategy.named_parameters(model))
    for a, b in family.tied_weights():
        layer = max((n for n in family.layer_names() if a.startswith(n + ".")), key=len)
        with torch.device("meta"):
            part = family.build_unseeded(layer)
        owner = part.get_submodule(a[len(layer) + 1:].rsplit(".", 1)[0])
        if isinstance(owner, torch.nn.Embedding):
            for n in (a, b):
                if n in named:
                    named[n]._mmpipe_embedding = True


def expert_shard(topo, rank: int) -> ExpertShard:
    """``parallel.expert_parallel`` = E: DeepSpeed's expert groups made (a collective: every rank), and this rank's
    place in its group (``families.expert_dispatch``)."""
    group, ep_rank, name = create_expert_groups(topo.expert_parallel, topo.pipeline_stages)
    if ep_rank != topo.expert_rank(rank):  # mmpipe's rank arithmetic and DeepSpeed's groups must agree
        raise RuntimeError(f"rank {rank}: DeepSpeed's expert-parallel rank {ep_rank} is not the topology's "
                           f"{topo.expert_rank(rank)}")
    return ExpertShard(group, ep_rank, topo.expert_parallel, name)


def build_module(strategy, family, shard, dynamic_shape: bool):
    """The strategy's module; with expert parallelism each MoE block keeps this rank's slice of its experts as it is
    built (a family that cuts its layers as it builds them: ``expert_shard`` set meanwhile), or after."""
    if shard is None:
        return strategy.build_module(dynamic_shape=dynamic_shape)
    family.expert_shard = shard
    try:
        model = strategy.build_module(dynamic_shape=dynamic_shape)
    finally:
        family.expert_shard = None  # (a later profile builds whole layers)
    shard_experts(model, shard)
    return model


def build_engine(run) -> Engine:
    cfg, topo, family = run.cfg, run.topo, run.family
    forward_only = run.frozen.forward_only
    strategy = strategy_for(topo)(family, run.plan, topo, forward_only)
    shard = expert_shard(topo, run.rank) if topo.expert_parallel > 1 else None
    model = build_module(strategy, family, shard, cfg.data.padding == "batch" or family.dynamic_shapes)
    if cfg.parallel.activation_checkpointing == "all":
        set_activation_checkpointing(model)
    apply_freeze(strategy.named_parameters(model), run.groups, lora=family.lora is not None)
    mark_embeddings(model, strategy, family)
    torch_groups = param_groups(strategy.named_parameters(model), run.groups)
    if not torch_groups:  # every layer of this stage is frozen: it still runs, forward only
        torch_groups = [{"name": "none", "params": []}]
    if shard is not None:
        torch_groups = expert_param_groups(torch_groups)
    scheduler = None
    if "scheduler" not in run.where.ds_cfg:
        f = lr_lambda(cfg.optim, cfg.train.steps)
        scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f)  # noqa: E731
    if cfg.train.precision == "fp16":  # DeepSpeed 0.19.8 leaves ZeRO-0's fp16 gradients unscaled
        fix_fp16_backward_scaling()
    if cfg.train.precision != "fp32":  # its overflow check: one host read per step, not one per parameter
        one_read_overflow_check()
        foreach_unfused_step()  # and its step: a few multi-tensor kernels, not five per parameter
    moe = moe_engine() if shard is not None else contextlib.nullcontext()
    with no_initial_unfused_step(), moe:  # bf16 at P = 1 without ZeRO: Adam's first step is the first training step
        engine, _, _, _ = initialize(model=model, model_parameters=torch_groups, config=run.where.ds_cfg,
                                               lr_scheduler=scheduler)
    no_single_rank_allreduce(engine)  # ZeRO-0 on one rank: no identity all-reduce after each backward
    if shard is not None and optimizer_kind(engine.optimizer) == "other":
        raise ConfigError(f"parallel.expert_parallel={topo.expert_parallel} with {type(engine.optimizer).__name__}: a "
                          "run with expert parallelism saves and resumes its optimizer state by parameter (every expert "
                          "gathered), which this optimizer cannot be read by; use mmpipe's default optimizer (no "
                          "optimizer block in train.deepspeed_config) or expert_parallel 1")
    monitor = getattr(engine, "monitor", None)
    pipelined = topo.pipeline_stages > 1
    layer_names = run.plan.layers if pipelined else None
    parts = run.plan.parts if pipelined else None
    layout = layout_record(topo, cfg, layer_names, parts, run.plan.order)
    stage_of = [topo.coords(r)[0] for r in range(run.world)]
    eng = Engine(
        engine=engine, runner=strategy.runner(engine, cfg.log.stage_timing),
        # under ZeRO-2/3 DeepSpeed clips (its gradient buckets are not read here); the clipper logs its norm
        clipper=GradClipper(engine, run.groups, cfg.optim.max_grad_norm),
        inner=innermost_optimizer(engine.optimizer), named_params=list(strategy.named_parameters(model)),
        trainable=[g for g in run.groups if not g.frozen], layer_names=layer_names, parts=parts, layout=layout,
        record=run_record(cfg, layout, run.plan.to_json()),
        monitor=monitor if monitor is not None and monitor.enabled else None,
        stage_ranks=[[r for r in range(run.world) if stage_of[r] == s] for s in range(topo.pipeline_stages)])
    if cfg.log.grads:  # the gradients of these steps, by plain name, before clipping (train.grad_dump)
        steps, out = set(cfg.log.grads), os.path.join(cfg.train.output_dir, "grads")
        eng.clipper.before_clip = lambda step: save_grads(engine, eng.named_params, out, step, run.where.stage,
                                                          run.where.dp_rank) if step in steps else None
    return eng
