"""TODO docstring."""
from __future__ import annotations
import os
import torch
from mmpipe.config.schema import RunConfig
from mmpipe.errors import ConfigError
from mmpipe.train.faults import _rank0_decides
from mmpipe.planning.micro_batch import auto_micro_batch


def prepare_tokenizer(cfg: RunConfig, family, rank: int, source=None):
    """The run's tokenizer: ``data.tokenizer``, else the cache's, else the text weights' own (a
    pretrained directory's tokenizer files), else one trained on rank 0 from the captions (saved in
    the run directory); then given the family's special tokens (``Family.prepare_tokenizer``)."""
    from mmpipe.data.source import check_cache_tokenizer, check_cache_tokenizer_fits_weights, tokenizer_dir
    from mmpipe.data.tokenizer import has_tokenizer, load_tokenizer, train_tokenizer
    weights_key, weights_dir = family.tokenizer_weights(cfg.model)
    if cfg.data.tokenizer:
        tok = load_tokenizer(cfg.data.tokenizer)
        check_cache_tokenizer(cfg, tok)
    elif tokenizer_dir(cfg):
        tok = load_tokenizer(tokenizer_dir(cfg), "data.cache tokenizer")
        if weights_dir:
            check_cache_tokenizer_fits_weights(cfg.data.cache, weights_key, weights_dir)
    elif weights_dir:
        if not has_tokenizer(weights_dir):
            raise ConfigError(f"{weights_key}={weights_dir} holds pretrained text weights but no tokenizer, and "
                              "data.tokenizer is unset: a tokenizer trained on the captions would feed those weights "
                              "ids they never saw; set data.tokenizer to the tokenizer the weights were trained with")
        tok = load_tokenizer(weights_dir, f"{weights_key} tokenizer")
    else:
        tok_dir = os.path.join(cfg.train.output_dir, "tokenizer")

        def train():
            tok = family.prepare_tokenizer(train_tokenizer(source.captions(family=family),
                                                           cfg.data.tokenizer_vocab_size, tok_dir))
            tok.save_pretrained(tok_dir)
            return True
        _rank0_decides(rank, lambda: None if os.path.isfile(os.path.join(tok_dir, "tokenizer.json")) else train())
        tok = load_tokenizer(tok_dir, "tokenizer in the run directory")
    return family.prepare_tokenizer(tok)


def make_plan(cfg, family, topo, frozen, forward_only, saved=None, measure: bool = True):
    """The run's ``Plan`` (``mmpipe.planning.place.place``), computed once, on rank 0: on a resume of a
    measured placement, the checkpoint's plan (a new profile could differ); else from measured costs
    (``parallel.profile``, unless ``measure`` is False), else from trainable parameters."""
    from mmpipe.planning.measure import get_profile
    from mmpipe.parallel.plan import Plan
    from mmpipe.planning.place import place
    names, segments, P = family.layer_names(), family.segments(), topo.pipeline_stages
    M, mbs = topo.accumulation_steps, topo.micro_batch_size
    p = cfg.parallel
    measured = measure and P > 1 and p.profile and not p.plan and p.placement in ("modality", "balanced", "auto")
    stages = (saved or {}).get("stages")
    if measured and stages and len(stages) == P and [n for s in stages for n in s] == names:
        if "parts" in saved:
            return Plan.from_json(saved)
        from mmpipe.parallel.plan import parts_from_lists  # a record older than plans: its stages
        return Plan(names, segments, parts_from_lists(names, stages), p.placement, M, mbs, "checkpoint")
    # (a different model: the layout check says what the checkpoint holds)
    params = family.meta_params()
    prof = None
    if measured:
        prof = get_profile(cfg, family, mbs, forward_only, frozen, threads=torch.get_num_threads(),
                           measure_comm=p.placement == "auto", log=lambda s: print(f"[mmpipe] {s}", flush=True))
    costs = ([sum(v.values()) for v in params.values()] if p.placement == "parameters" else
             [1 + sum(n for name, n in v.items() if name not in frozen) for v in params.values()])
    cap = int(p.memory_budget_gb * 2**30) if p.memory_budget_gb else None
    return place(names, segments, P, p.placement, M, prof=prof, param_costs=costs, plan_file=p.plan,
                 micro_batch_size=mbs, memory_cap=cap, precision=cfg.train.precision, zero_stage=p.zero_stage,
                 data_parallel=topo.data_parallel)


def _probe_micro_batch(cfg, family, source, tok, image_size, topo, forward_only, frozen) -> int:
    """Probe real batches for the largest micro-batch that fits (``mmpipe.planning.measure.auto_micro_batch``),
    against the stage boundaries of the plan without measured costs (a plan file, ``type:``,
    DeepSpeed's methods: the run's own; measured placements: their parameter-cost estimate)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    budget = int((cfg.parallel.memory_budget_gb or acc.total_memory() / 2**30) * 2**30)
    parts = make_plan(cfg, family, topo, frozen, forward_only, measure=False).parts
    m, _ = auto_micro_batch(cfg, family, source, tok, image_size, topo.pipeline_stages, topo.data_parallel,
                            parts, forward_only, frozen, budget, torch.device(acc.device_name()),
                            log=lambda s: print(f"[mmpipe] {s}", flush=True))
    return m
