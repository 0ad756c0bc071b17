"""The runtime seam: where DeepSpeed's engine is made (``initialize``, the one call of
``deepspeed.initialize``) and where a pipeline stage is given the run's order (``install_schedule``: the
stage's stream from ``parallel.schedules``, installed as the engine's schedule, handed to the stage clock,
and the stage's executor told what the order implies)."""
from __future__ import annotations

from mmpipe.parallel.ds_compat import set_train_schedule
from mmpipe.parallel.schedules import stream


def initialize(**kwargs):
    """``deepspeed.initialize(**kwargs)``: (engine, optimizer, data loader, scheduler)."""
    import deepspeed
    return deepspeed.initialize(**kwargs)


def install_schedule(engine, plan, micro_batches: int, step_loss: bool, clock=None) -> list:
    """Stage ``engine.stage_id``'s stream under ``plan.schedule`` (a step loss's features pass first, which
    DeepSpeed's ``eval_batch`` runs in the same order); its training part becomes
    the engine's schedule. The first stage that trains after ``frozen_first``'s forward-only stages takes its
    inputs as constants (no gradient goes back). Returns the whole stream."""
    P, s = engine.num_stages, engine.stage_id
    kw = {"frozen": plan.frozen_stages}
    set_train_schedule(engine, stream(plan.schedule, P, micro_batches, s, **kw))
    whole = stream(plan.schedule, P, micro_batches, s, step_loss=step_loss, **kw)
    if clock is not None:
        clock.stream = whole
    if plan.schedule == "frozen_first" and 0 < plan.frozen_stages == s:
        engine.module.executor.detach = plan.layers[plan.parts[s]]
    return whole
