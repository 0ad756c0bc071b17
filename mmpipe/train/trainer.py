"""One training loop for every model family and layout: P = 1 (plain DeepSpeed engine, one process
or data parallel) and P >= 2 (DeepSpeed pipeline engine, optionally x data parallel). The family
(``model.type``) supplies layers, batches, loss and evaluation; the strategy
(``mmpipe.parallel.strategies``) builds the module and the runner; the planner places the stages.

Launch (see launch/train.py for copy-paste commands):
    deepspeed --num_gpus 2 launch/train.py --config configs/demo.yaml
    accelerate launch --config_file launch/accelerate/cpu_2proc.yaml launch/train.py --config configs/demo.yaml
    python launch/train.py --config configs/demo.yaml --set parallel.pipeline_stages=1
"""
from __future__ import annotations

import itertools
import json
import os
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from mmpipe.train import checkpoint
from mmpipe.config.schema import RunConfig, save_yaml
from mmpipe.errors import ConfigError, DataError, MmpipeError
from mmpipe.train.metrics import MetricsWriter, NullWriter
from mmpipe.parallel.strategies import LABEL_PLACEHOLDER, strategy_for
from mmpipe.parallel.startup import init_distributed
from mmpipe.train.setup import _probe_micro_batch
from mmpipe.planning.micro_batch import check_auto_micro_batch
from mmpipe.train.faults import _everywhere, _rank0_decides, _warn, agree, counts_as_bad
from mmpipe.train.run_dir import check_run_dir, clear_run_dir
from mmpipe.train.setup import make_plan, prepare_tokenizer
from mmpipe.train.step_stats import DataStats, _as_pipe_batches, eval_due, lr_fields, lr_record, memory_summary


SAME_REQUEST_SECONDS = 3.0  # signals this close to the first one are one stop request (launchers relay)


def run(cfg: RunConfig, resume: bool = False, stop_at: Optional[int] = None, overwrite: bool = False) -> dict:
    """Train; ``stop_at`` ends this invocation after that step with a checkpoint (time-limited jobs);
    ``overwrite`` replaces a run already in ``train.output_dir`` (without it, or ``resume``, that is
    refused)."""
    return Trainer(cfg, resume, stop_at, overwrite).train()


class Trainer:
    """One training run on this rank: ``setup`` (validate, join the process group, tokenizer and
    model, placement, engine, restore, data), then ``train``: ``step`` / ``evaluate`` / ``save``."""

    def __init__(self, cfg: RunConfig, resume: bool = False, stop_at: Optional[int] = None, overwrite: bool = False):
        # ``cfg`` is never changed: the run resolves a config of its own (tokenizer fields, the
        # auto micro-batch), freezes it, and saves it as-is
        self.cfg, self.resume, self.stop_at, self.overwrite = cfg, resume, stop_at, overwrite
        self.last_eval = None
        self.stop_requested = None  # this rank's signal name
        self.stop_signal = self.stop_signal_rank = None  # agreed by every rank at a step boundary
        self.timed_save = False
        self.bad_run = self.skipped_total = 0
        self.last_loss_scale = None  # fp16's dynamic loss scale after the previous step
        self.data_position = self.sampler = None  # the stream position a resume continues at; its source

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> dict:
        self.setup()
        cfg, step = self.cfg, self.start_step
        end = min(cfg.train.steps, self.stop_at) if self.stop_at else cfg.train.steps
        saved_at = step
        while step < end:
            step += 1
            record = self.step(step, tracing=bool(cfg.log.trace) and cfg.log.trace[0] <= step <= cfg.log.trace[1])
            self.writer.log_step(record)
            if self.ds_monitor is not None:
                self.monitor_step(step, record)
            self.check_bad_steps(step, record)
            if cfg.log.trace is not None and step == min(cfg.log.trace[1], end):
                self.write_trace()
            msg = self.ledger.error()
            if msg:
                raise _everywhere(DataError, msg)  # every rank knows it: printed once
            if step == self.start_step + 1:
                self.log_memory()
            if eval_due(step, cfg.train.eval_every, cfg.train.steps):  # before the save: a resume continues after it
                self.last_eval = self.evaluate(step) or self.last_eval
            if step == end or (cfg.train.save_every and step % cfg.train.save_every == 0) or self.timed_save:
                self.save(step)
                saved_at = step
            if self.stop_signal and step < end:  # preempted: every rank stops here, after a checkpoint
                if saved_at != step:
                    self.save(step)
                self.writer.info(f"stopped at step {step} by {self.stop_signal} ({self.stop_signal_rank}): checkpoint "
                                 f"saved; continue with --resume")
                break
        self.writer.close()
        dist.barrier()
        return {"step": step, "eval": self.last_eval, "bad_samples": self.ledger.count}

    def monitor_step(self, step: int, record: Optional[dict], prefix: str = "mmpipe/") -> None:
        """The step's metrics.jsonl scalars to DeepSpeed's own monitors (``tensorboard``,
        ``csv_monitor``, ``wandb``, ``comet`` blocks of the DeepSpeed JSON), as ``mmpipe/<key>``.
        DeepSpeed writes them from rank 0; the record is the reporting rank's."""
        src = self.topo.reporting_rank
        if src != 0:
            box = [record if self.rank == src else None]
            dist.broadcast_object_list(box, src=src)
            record = box[0]
        if self.rank == 0:
            events = [(f"{prefix}{k}", float(v), step) for k, v in (record or {}).items()
                      if k != "step" and isinstance(v, (int, float)) and v is not None]
            self.ds_monitor.write_events(events)

    def check_bad_steps(self, step: int, record: dict) -> None:
        """A skipped step (non-finite gradients on some rank) is counted; ``train.max_bad_steps``
        consecutive ones stop the run with one line."""
        self.bad_run = self.bad_run + 1 if counts_as_bad(record, self.last_loss_scale) else 0
        self.last_loss_scale = record.get("loss_scale", self.last_loss_scale)
        limit = self.cfg.train.max_bad_steps
        if limit and self.bad_run >= limit:
            norms = ", ".join(f"{k}={v:.4g}" for k, v in record.items() if k.startswith("grad_norm.") and v is not None)
            raise _everywhere(MmpipeError, f"step {step}: {self.bad_run} consecutive steps skipped for non-finite "
                              f"gradients ({norms or 'grad_norm=' + str(record.get('grad_norm'))}); "
                              "train.max_bad_steps stops the run here: lower optim.lr, clip gradients "
                              "(optim.max_grad_norm) or check the data")

    def on_signal(self, signum, frame) -> None:
        """SIGTERM / SIGINT: stop at the next step boundary with a checkpoint (all ranks agree
        through the step's gather); a second signal stops at once. A signal within
        ``SAME_REQUEST_SECONDS`` of the first is the same request: a Ctrl-C under the ``deepspeed``
        launcher reaches every rank as SIGINT and, from DeepSpeed's ``launch.py`` at once, SIGTERM."""
        import signal
        now = time.monotonic()
        if self.stop_requested:
            if now - self.stop_requested_at <= SAME_REQUEST_SECONDS:
                return
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.stop_requested, self.stop_requested_at = signal.Signals(signum).name, now

    # ---- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        import signal
        auto_layout = self.cfg.parallel.layout == "auto"
        requested = self.cfg
        if auto_layout:  # everything but the layout is checked first, with a stand-in (data parallel)
            from mmpipe.config.schema import replace
            self.cfg = replace(requested, parallel__pipeline_stages=1, parallel__zero_stage=0)
        self.validate()
        self.rank, self.world = init_distributed(self.cfg.train.collective_timeout_minutes)
        if self.world > 1:
            from mmpipe.parallel import roster
            roster.gather()  # so that a rank losing contact can name the one that is gone
        if auto_layout:
            self.choose_layout(requested)
        import threading
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                signal.signal(s, self.on_signal)
        self.last_save_time = time.time()
        self.out_dir = self.cfg.train.output_dir
        self.ckpt_dir = os.path.join(self.out_dir, "checkpoints")
        if self.rank == 0:
            if self.overwrite:
                c = self.cfg
                clear_run_dir(self.out_dir, keep=(c.data.tokenizer, c.parallel.plan, c.data.cache,
                                                  c.train.deepspeed_config))
            os.makedirs(self.out_dir, exist_ok=True)
            if self.resume:  # a run killed while saving: its partial checkpoint is never loaded
                for tag in checkpoint.remove_partial(self.ckpt_dir):
                    _warn(f"removed the incomplete checkpoint {self.ckpt_dir}/{tag} (the run stopped while saving it)")
        dist.barrier()
        self.build_family()
        self.place()
        self.build_engine()
        self.restore()
        self.write_run_files()
        self.build_data()

    def choose_layout(self, requested) -> None:
        """``parallel.layout: auto``: rank 0 predicts every layout of this world (``mmpipe.planning.layouts``)
        and every rank takes the fastest that fits; a resume keeps the layout its run chose."""
        from mmpipe.config.schema import replace
        out = requested.train.output_dir
        saved = os.path.join(out, "layout.json")

        def decide():
            if self.resume and os.path.isfile(saved):
                with open(saved) as fh:
                    doc = json.load(fh)
                if doc.get("world") == self.world:
                    c = doc["chosen"]
                    return {"chosen": c, "why": f"kept from {saved} ({doc['why']})", "doc": None}
            from mmpipe.planning.layouts import layouts_json, plan_layouts
            res = plan_layouts(requested, self.world, log=lambda m: _warn(f"layout: {m}"))
            doc = layouts_json(res)
            return {"chosen": doc["chosen"], "why": res["why"], "doc": doc}
        choice = _rank0_decides(self.rank, decide)
        c = choice["chosen"]
        # a pipeline row's placement ("auto:balanced": auto, which chose balanced); a data-parallel
        # row has none, and the requested one (type:REGEX included) stays as it is
        placement = c["placement"].split(":")[0] if c["placement"] else requested.parallel.placement
        self.cfg = replace(requested, parallel__pipeline_stages=c["pipeline_stages"],
                           parallel__zero_stage=c["zero_stage"], parallel__placement=placement)
        if self.rank == 0:
            _warn(f"parallel.layout=auto -> {c['name']}: pipeline_stages={c['pipeline_stages']} data_parallel="
                  f"{c['data_parallel']} zero_stage={c['zero_stage']}" + (f" placement={placement}"
                                                                          if c["pipeline_stages"] > 1 else "")
                  + f" ({choice['why']})")
            if choice["doc"] is not None:
                self.layout_doc = choice["doc"]
        try:  # the rest of the config was validated with the stand-in: only the layout's part again
            self.resolve_layout()
        except MmpipeError as e:
            e.everywhere = True
            raise

    def validate(self) -> None:
        """Everything that needs no process group, first: config mistakes end as one line, raised
        alike on every rank (printed once)."""
        from deepspeed.accelerator import get_accelerator

        from mmpipe.config.schema import family_of, replace
        from mmpipe.config.groups import resolve_groups
        # the run's own copy: adopting DeepSpeed-JSON / Accelerate values is part of its resolution
        cfg = self.cfg = replace(self.cfg)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.auto_mbs = cfg.parallel.micro_batch_size == "auto"
        try:
            if self.stop_at is not None and self.stop_at < 1:
                raise ConfigError(f"--stop-at {self.stop_at}: give a step >= 1 (the run stops after that step with a "
                                  "checkpoint)")
            check_run_dir(cfg.train.output_dir, self.resume, self.overwrite)
            self.family_cls = family_of(cfg)
            if self.family_cls.training_unsupported:
                raise ConfigError(f"model.type={cfg.model.type}: {self.family_cls.training_unsupported}")
            if self.auto_mbs:  # validate the rest with a stand-in (the per-rank batch); the size is probed later
                check_auto_micro_batch(cfg)
                stand_in = max(1, cfg.train.batch_size // max(1, world // cfg.parallel.pipeline_stages))
                cfg = self.cfg = replace(cfg, parallel__micro_batch_size=stand_in)
            self.device_name = get_accelerator().device_name()
            if cfg.train.precision == "fp16" and self.device_name == "cpu":
                raise ConfigError("train.precision=fp16 needs a GPU: DeepSpeed refuses fp16 on the CPU accelerator; "
                                  "use bf16 or fp32 here")
            self.image_size = self.family_cls.image_size(cfg.model)
            self.groups = resolve_groups(cfg.optim, self.family_cls)
            self.resolve_layout()
            # (parallel.layout: auto has not chosen yet: every rank opens the data, once)
            self.open_data(cfg, read=self.reads_data or int(os.environ.get("RANK", "0")) == 0
                           or cfg.parallel.layout == "auto")
        except MmpipeError as e:
            e.everywhere = True
            raise

    def resolve_layout(self) -> None:
        """The part of the resolution that depends on the layout: DeepSpeed's config, the topology,
        this rank's stage and what it reads, ZeRO-2/3 against per-group clipping. ``parallel.layout:
        auto`` runs it again, alone, for the layout it chose."""
        from mmpipe.config.deepspeed import resolve
        cfg, world, rank = self.cfg, int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        self.ds_cfg, self.topo = resolve(cfg, world)
        self.stage, self.dp_rank = self.topo.coords(rank)
        # the first stage reads the inputs; the last stage reads the batches too when the family
        # has label fields (they reach it from the loader, not through the stages)
        self.reads_inputs = self.stage == 0
        self.reads_data = self.reads_inputs or (bool(self.family_cls.labels) and self.topo.is_last_stage(rank))
        if cfg.parallel.zero_stage >= 2 and any(g.max_grad_norm is not None for g in self.groups):
            raise ConfigError(f"per-group clipping (optim.groups.*.max_grad_norm) supports ZeRO 0/1, not "
                              f"parallel.zero_stage={cfg.parallel.zero_stage}: use zero_stage 1, or only "
                              "optim.max_grad_norm (DeepSpeed clips globally under ZeRO-2/3)")

    def open_data(self, cfg, read: bool) -> None:
        """The training source and the val records (every rank reads those: all stages need the eval
        micro-batch count)."""
        from mmpipe.data.source import open_source
        self.source = open_source(cfg, self.image_size, read=read, family=self.family_cls)
        self.val_samples = (self.family_cls.read_records(cfg.data.val, cfg.data, "data.val") if cfg.data.val
                            else None)

    def build_family(self) -> None:
        """The tokenizer, the resolved model config (fields left to the tokenizer filled) and the family."""
        from mmpipe.config.schema import replace
        from mmpipe.config.groups import frozen_layout
        rank = self.rank
        self.tok = agree(rank, lambda: prepare_tokenizer(self.cfg, self.family_cls, rank, self.source))
        model = agree(rank, lambda: self.family_cls.resolve(self.cfg.model, self.tok, self.cfg.data))
        self.cfg = replace(self.cfg, model=model)
        self.family = agree(rank, lambda: self.family_cls(self.cfg.model, self.cfg.train.seed))
        self.is_reporter = rank == self.topo.reporting_rank
        self.part_params, self.frozen_names, self.forward_only = frozen_layout(self.family, self.groups)

    def place(self) -> None:
        """``micro_batch_size: auto`` (probed on rank 0), then the plan (rank 0, once); the config is
        resolved after this and frozen."""
        from mmpipe.config.schema import replace
        cfg, rank = self.cfg, self.rank
        if self.auto_mbs:
            from mmpipe.config.deepspeed import resolve
            m = _rank0_decides(rank, lambda: _probe_micro_batch(cfg, self.family, self.source, self.tok,
                                                                 self.image_size, self.topo, self.forward_only,
                                                                 self.frozen_names))
            cfg = self.cfg = replace(cfg, parallel__micro_batch_size=m)
            self.ds_cfg, self.topo = resolve(cfg, self.world)
            if rank == 0:
                _warn(f"parallel.micro_batch_size=auto -> {m} (accumulation {self.topo.accumulation_steps})")
        self.cfg.seal()
        saved = checkpoint.saved_plan(self.ckpt_dir) if self.resume else None
        self.plan = _rank0_decides(rank, lambda: make_plan(cfg, self.family, self.topo, self.frozen_names,
                                                           self.forward_only, saved))
        if self.plan.chosen and rank == 0:
            _warn(f"parallel.placement=auto -> {self.plan.chosen} ({self.plan.why})")
        self.check_frozen_stages()

    def check_frozen_stages(self) -> None:
        cfg, plan = self.cfg, self.plan
        if plan.num_stages == 1 or (cfg.parallel.zero_stage == 0 and cfg.train.precision == "fp32"):
            return
        for s_, names in enumerate(plan.stages):
            if all(pn in self.frozen_names for part in names for pn in self.part_params[part]):
                raise _everywhere(ConfigError,
                    f"pipeline stage {s_} ({names[0]} .. {names[-1]}) holds only frozen parameters, which "
                    f"DeepSpeed's ZeRO-{cfg.parallel.zero_stage}/{cfg.train.precision} optimizer cannot hold; "
                    "use zero_stage 0 with fp32, or a parallel.plan that gives every stage a trainable layer")

    def build_engine(self) -> None:
        import deepspeed

        from mmpipe.train.clipping import GradClipper, innermost_optimizer
        from mmpipe.config.groups import apply_freeze, lr_lambda, param_groups
        cfg = self.cfg
        strategy = strategy_for(self.topo)(self.family, self.plan, self.topo, self.forward_only)
        model = strategy.build_module(dynamic_shape=cfg.data.padding == "batch" or self.family.dynamic_shapes)
        apply_freeze(strategy.named_parameters(model), self.groups)
        torch_groups = param_groups(strategy.named_parameters(model), self.groups)
        if not torch_groups:  # every layer of this stage is frozen: it still runs, forward only
            torch_groups = [{"name": "none", "params": []}]
        scheduler = None
        if "scheduler" not in self.ds_cfg:
            f = lr_lambda(cfg.optim, cfg.train.steps)
            scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f)  # noqa: E731
        if cfg.train.precision == "fp16":  # DeepSpeed 0.19.8 leaves ZeRO-0's fp16 gradients unscaled
            from mmpipe.parallel.ds_compat import fix_fp16_backward_scaling
            fix_fp16_backward_scaling()
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=torch_groups, config=self.ds_cfg,
                                                    lr_scheduler=scheduler)
        self.runner = strategy.runner(self.engine, cfg.log.stage_timing)
        monitor = getattr(self.engine, "monitor", None)
        self.ds_monitor = monitor if monitor is not None and monitor.enabled else None
        self.named_params = list(strategy.named_parameters(model))  # plain names (layout-free checkpoints)
        pipelined = self.topo.pipeline_stages > 1
        self.layer_names = self.plan.layers if pipelined else None
        self.parts = self.plan.parts if pipelined else None
        # under ZeRO-2/3 DeepSpeed clips (its gradient buckets are not read here); the clipper logs its norm
        self.clipper = GradClipper(self.engine, self.groups, cfg.optim.max_grad_norm)
        from mmpipe.parallel.ds_compat import dynamic_loss_scale
        self.last_loss_scale = dynamic_loss_scale(self.engine.optimizer)
        self.layout = checkpoint.layout_record(self.topo, cfg, self.layer_names, self.parts)
        self.record = checkpoint.run_record(cfg, self.layout, self.plan.to_json())
        self.trainable = [g for g in self.groups if not g.frozen]
        self.inner = innermost_optimizer(self.engine.optimizer)
        stage_of = [self.topo.coords(r)[0] for r in range(self.world)]
        self.stage_ranks = [[r for r in range(self.world) if stage_of[r] == s]
                            for s in range(self.topo.pipeline_stages)]  # per-stage means of the step gather

    def restore(self) -> None:
        """The bad-sample record (and, with --resume, weights, optimizer, RNG, step, data position)."""
        from mmpipe.data.badsamples import BadSampleLedger
        n_train = torch.tensor([self.source.size or 0 if self.reads_data else 0], dtype=torch.int64,
                               device=self.engine.device)
        dist.all_reduce(n_train, op=dist.ReduceOp.MAX)  # every rank needs it for the bad-fraction check
        self.ledger = BadSampleLedger(self.cfg.data.max_bad_fraction, int(n_train))
        self.start_step = 0
        if self.resume:
            ties = {a: b for pair in self.family.tied_weights() for a, b in (pair, pair[::-1])}
            model = self.cfg.to_dict()["model"]
            client = agree(self.rank, lambda: checkpoint.load(self.engine, self.ckpt_dir, self.layout, self.inner,
                                                              self.named_params, ties, model))
            self.start_step = int(client.get("step", 0))
            self.skipped_total = int(client.get("skipped_steps", 0))
            self.ledger.load_state_dict(client.get("data") or {})
            self.data_position = client.get("data_position")
            saved_batch = client.get("batch_size")
            if saved_batch and saved_batch != self.topo.batch_size and self.rank == 0:
                _warn(f"train.batch_size {saved_batch} at the checkpoint, {self.topo.batch_size} now: the epoch "
                      f"continues at its next unseen sample ({(self.data_position or {}).get('sample', '?')})")

    def write_run_files(self) -> None:
        """config.yaml, ds_config.json, plan.json (rank 0); the metrics writer (reporting rank)."""
        from mmpipe.parallel.plan import stage_lists
        cfg, out = self.cfg, self.out_dir
        self.writer = (MetricsWriter(out, cfg.train.steps, self.start_step, progress=cfg.log.progress,
                                     tensorboard=cfg.log.tensorboard, every=cfg.log.every)
                       if self.is_reporter else NullWriter())
        if self.rank == 0:
            save_yaml(cfg, os.path.join(out, "config.yaml"))
            with open(os.path.join(out, "ds_config.json"), "w") as fh:
                json.dump(self.ds_cfg, fh, indent=2)
            if getattr(self, "layout_doc", None) is not None:  # parallel.layout=auto: what it chose and why
                with open(os.path.join(out, "layout.json"), "w") as fh:
                    json.dump(self.layout_doc, fh, indent=1)
            plan_file = os.path.join(out, "plan.json")
            # a resume keeps the plan (and its predictions) it continues
            if self.layer_names is not None and not (self.resume and os.path.isfile(plan_file)):
                self.plan.write(plan_file)
        self.writer.info(f"{self.topo.describe()} precision={cfg.train.precision} zero={cfg.parallel.zero_stage} "
                         f"device={self.device_name}" + (f" resume@{self.start_step}" if self.resume else ""))
        if self.layer_names is not None:
            for s, names in enumerate(stage_lists(self.layer_names, self.parts)):
                fo = ", forward-only" if all(n in self.forward_only for n in names) else ""
                self.writer.info(f"stage {s}: {names[0]} .. {names[-1]} ({len(names)} layers{fo})")

    def build_data(self) -> None:
        from mmpipe.data.source import build_train_loader
        cfg, rank = self.cfg, self.rank
        sample_log = None
        if cfg.data.log_samples and self.reads_inputs:
            os.makedirs(os.path.join(self.out_dir, "samples"), exist_ok=True)
            sample_log = os.path.join(self.out_dir, "samples", f"rank{rank}.jsonl")
        self.data_stats = DataStats(sample_log, rank, self.stage)
        self.collate = self.family.collate(self.tok, cfg.data)
        if self.reads_data:
            loader = agree(rank, lambda: build_train_loader(cfg, self.source, self.tok, self.collate, self.topo,
                                                            self.dp_rank, self.start_step, self.image_size,
                                                            self.device_name == "cpu", self.family,
                                                            start_at=self.data_position))
            self.sampler = getattr(loader, "batch_sampler", None)
            self.train_iter = _as_pipe_batches(loader, self.data_stats, self.family, count=self.reads_inputs)
        else:
            agree(rank, lambda: None)  # the data-reading ranks' loader errors reach every rank
            self.train_iter = (itertools.repeat((None, LABEL_PLACEHOLDER)) if self.topo.is_last_stage(rank)
                               else None)
        self.trace_offset = time.time() - time.perf_counter()

    # ---- one step --------------------------------------------------------------------------------
    def step(self, step: int, tracing: bool = False) -> dict:
        """One optimizer step, then one small gather: data counters (summed over the reading ranks),
        every group's lr (wherever it lives) and stage timings. Returns the metrics record."""
        lrs = lr_fields(self.inner, self.trainable)  # the lr this step uses (the scheduler moves it in the step)
        self.clipper.step_no = self.data_stats.step = step
        t0 = time.perf_counter()
        loss = self.runner.train_step(self.step_batches(), step, tracing)
        dt = time.perf_counter() - t0
        stats, reports = self.gather_step_stats(lrs)
        for path, why in self.ledger.add(reports, int(stats[:, 2].sum())):
            if self.is_reporter:
                _warn(f"skipped bad sample {path}: {why}")
        n_lr = len(self.trainable)
        wait = float(stats[:, 1].sum()) / self.topo.data_parallel  # mean over the first-stage ranks
        lr_now = [float(np.nanmax(col)) if not np.isnan(col).all() else float("nan")
                  for col in stats[:, 5:5 + n_lr].T.numpy()]
        self.timed_save = bool(stats[:, 4].max() > 0)
        if stats[:, 3].max() > 0 and self.stop_signal is None:
            r = int(stats[:, 3].max()) - 1
            names = [None] * self.world
            dist.all_gather_object(names, self.stop_requested)
            self.stop_signal, self.stop_signal_rank = names[r], f"rank {r}"
        stage_fields = {}
        if self.runner.clock is not None:
            from mmpipe.parallel.stage_clock import stage_record
            per_stage = {s: stats[ranks, 5 + n_lr:].mean(0).tolist() for s, ranks in enumerate(self.stage_ranks)}
            stage_fields = stage_record(per_stage, self.topo.pipeline_stages)
        lrs = lr_record(lr_now, self.trainable, self.cfg.optim.lr, ds_scheduler="scheduler" in self.ds_cfg)
        clip = self.clipper.record()
        self.skipped_total += int(clip.get("skipped", False))
        return {"step": step, "loss": loss, **lrs, "skipped_steps": self.skipped_total,
                "samples_per_sec": self.topo.batch_size / dt, **clip, "step_time": dt,
                "loader_wait": wait, "loader_wait_frac": wait / dt, "bad_samples": self.ledger.count,
                "samples_seen": self.ledger.drawn, **stage_fields}

    def step_batches(self):
        """This step's micro-batches. For a ``token_mean`` family every rank first learns the global
        batch's loss units (label tokens, counted on the last stage of each data-parallel replica),
        and each micro-batch's labels carry ``units / (micro-batches x data-parallel ranks)``: the
        engine's mean over micro-batches and ranks of ``sum / that`` is the mean over every label
        token of the step, whatever the tokens per micro-batch (not the mean of per-micro-batch
        means that ``loss / accumulation_steps`` gives)."""
        if not self.family.token_mean:
            return self.train_iter
        A, D = self.topo.accumulation_steps, self.topo.data_parallel
        batches = [next(self.train_iter) for _ in range(A)] if self.train_iter is not None else None
        units = 0
        if batches is not None and self.topo.is_last_stage(self.rank):
            units = sum(self.family.loss_units(*labels) for _, labels in batches)
        t = torch.tensor([float(units)], dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(t)
        norm = torch.tensor(max(float(t.item()), 1.0) / (A * D), dtype=torch.float32)
        return iter([(inputs, tuple(labels) + (norm,)) for inputs, labels in batches]) if batches else None

    def gather_step_stats(self, lrs: list) -> tuple:
        """(world x fields tensor of every rank's step counters, the bad-file reports new to the run)."""
        from mmpipe.parallel.stage_clock import FIELDS
        timings = []
        if self.runner.clock is not None:  # the norm all-reduce in the optimizer step waits for other stages: idle
            timings = list(self.runner.timings)
            w = min(self.clipper.wait_seconds, timings[FIELDS.index("opt")])
            timings[FIELDS.index("opt")] -= w
            timings[FIELDS.index("comm")] += w
        bad = self.data_stats
        reports = self.ledger.unknown(bad.reports)
        # a stop signal on any rank, rank 0's save clock: every rank acts on them at this step boundary
        stop = 1.0 + self.rank if self.stop_requested else 0.0
        minutes = self.cfg.train.save_every_minutes
        timed = float(bool(minutes) and self.rank == 0 and time.time() - self.last_save_time >= 60 * minutes)
        mine = torch.tensor([len(reports), bad.wait, bad.drawn, stop, timed] + lrs + timings, dtype=torch.float64,
                            device=self.engine.device)  # NCCL gathers device tensors only
        everyone = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine)
        stats = torch.stack(everyone).cpu()
        if stats[:, 0].sum() > 0:  # new bad files somewhere: merge every rank's, in rank order
            per_rank = [None] * self.world
            dist.all_gather_object(per_rank, reports)
            reports = [r for rr in per_rank for r in rr]
        bad.reset()
        return stats, reports

    def write_trace(self) -> None:
        if self.runner.clock is None:
            return
        from mmpipe.parallel.stage_clock import write_timeline_png, write_trace
        events = [None] * self.world
        dist.all_gather_object(events, (self.runner.clock.events, self.trace_offset))
        self.runner.clock.events = []
        if self.is_reporter:
            coords = [self.topo.coords(r) for r in range(self.world)]
            first, last = self.cfg.log.trace
            write_trace(os.path.join(self.out_dir, "trace.json"), events, coords)
            write_timeline_png(os.path.join(self.out_dir, "timeline.png"), events, coords,
                               f"steps {first}-{last}, {self.topo.describe()}")
            self.writer.info(f"wrote {self.out_dir}/trace.json (open in ui.perfetto.dev) and "
                             f"{self.out_dir}/timeline.png")

    def log_memory(self) -> None:
        """What each rank holds (frozen groups show here), printed by the reporter after the first step."""
        lines = [None] * self.world
        dist.all_gather_object(lines, memory_summary(self.engine, self.clipper.inner, self.rank, self.stage))
        for line in lines:
            self.writer.info(line)

    # ---- evaluate and save -----------------------------------------------------------------------
    def evaluate(self, step: int) -> Optional[dict]:
        """The family's evaluation on ``data.val``, from the last layer's eval-mode outputs."""
        from mmpipe.data.loader import eval_batches
        cfg, val = self.cfg, self.val_samples
        if not val:
            return None
        idx, n_real = eval_batches(val, self.topo.micro_batch_size, pad=not self.family.dynamic_shapes)

        stats = DataStats()  # the val set's own: not the training set's bad fraction, nor its loader wait

        def val_batches():
            if self.reads_data:
                ds = self.family.dataset(val, self.tok, cfg.data, self.image_size, decode_size=cfg.data.decode_size)
                return list(_as_pipe_batches((self.collate([ds[i] for i in mb]) for mb in idx), stats, self.family))
            return [(None, LABEL_PLACEHOLDER)] * len(idx) if self.topo.is_last_stage(self.rank) else None

        # every rank decodes (or waits) here, before any stage enters the pipeline: an error on one
        # rank (a val set with no usable sample, an unreadable file) stops every rank at once
        batches = agree(self.rank, val_batches)
        bad = self.val_bad_samples(stats.reports)
        outputs = self.runner.eval_outputs(batches, len(idx))
        record = None
        if outputs is not None and self.is_reporter:
            record = {"step": step, **self.family.evaluate(outputs, [b[1] for b in batches], val[:n_real]),
                      "val_bad_samples": bad}
            self.writer.log_eval(record, self.family.eval_line(record))
        if self.ds_monitor is not None:  # every rank joins (the record travels from the reporting rank)
            self.monitor_step(step, record, "mmpipe/eval/")
        return record

    def val_bad_samples(self, reports: list) -> int:
        """Unusable val samples (replaced by the next usable one, as in training): every reading
        rank's reports merged; the reporter names each file once per run. Returns how many."""
        per_rank = [None] * self.world
        dist.all_gather_object(per_rank, reports)
        files = dict(r for rr in per_rank for r in rr)
        seen = getattr(self, "_val_bad_named", set())
        for path, why in files.items():
            if self.is_reporter and path not in seen:
                _warn(f"skipped bad val sample {path}: {why}")
        self._val_bad_named = seen | set(files)
        return len(files)

    def save(self, step: int) -> None:
        position = self.sampler.position(step) if hasattr(self.sampler, "position") else None
        checkpoint.save(self.engine, self.ckpt_dir, step, {"bad_samples": self.ledger.count,
                                                           "data": self.ledger.state_dict(),
                                                           "skipped_steps": self.skipped_total,
                                                           "batch_size": self.topo.batch_size,
                                                           "data_position": position},
                        self.layer_names, self.parts, keep=self.cfg.train.keep_checkpoints, record=self.record,
                        plain_optimizer=(self.inner, self.named_params, self.stage, self.dp_rank))
        self.last_save_time, self.timed_save = time.time(), False
