"""What each rank feeds the pipeline: the training stream (first stage: inputs; last stage:
labels, read from the loader or a placeholder), its per-step counters (``DataStats``), and, for a
``token_mean`` family, micro-batches that carry the step's loss normaliser."""
from __future__ import annotations

import json
import time
from typing import Optional

import torch

from mmpipe.data.sampler import MicroBatchSampler
from mmpipe.data.source import build_train_loader
from mmpipe.parallel.sample_rng import KEY_FIELDS
from mmpipe.parallel.strategies import LABEL_PLACEHOLDER
from mmpipe.planning.flops import step_counter
from mmpipe.planning.prices import stage_prices
from mmpipe.train.faults import agree
from mmpipe.train.price_refit import PriceRefit


# --------------------------------------------------------------------------------------------
# data streams per stage
# --------------------------------------------------------------------------------------------
class DataStats:
    """Per-rank data counters for the current step: the bad-file reports of the micro-batches this
    rank consumed (merged over all ranks by the trainer into the run's ``BadSampleLedger``),
    samples drawn, seconds the training loop waited for the loader, and the analytic model and
    hardware FLOPs of the micro-batches (``counter``: ``planning.flops.StepCounter``, from their shapes
    and host image grids)."""

    def __init__(self, sample_log: Optional[str] = None, rank: int = 0, stage: int = 0, counter=None):
        self.sample_log = open(sample_log, "a") if sample_log else None
        self.rank, self.stage, self.step = rank, stage, 0  # ``step``: set by the trainer before each step
        self.counter = counter
        self.reset()

    def reset(self) -> None:
        self.reports, self.wait, self.drawn, self.tokens, self.real_tokens, self.samples = [], 0.0, 0, 0, 0, 0
        self.flops = self.hw_flops = 0.0
        self.balance = {}  # data.balance=cost: the step's prediction (``TrainData.balance_fields``)

    def add(self, batch) -> None:
        self.drawn += len(batch["keys"]) + len(batch["bad"])
        self.samples += len(batch["keys"])
        if self.counter is not None:
            model, hardware = self.counter(batch)
            self.flops, self.hw_flops = self.flops + model, self.hw_flops + hardware
        mask = batch.get("attention_mask")
        if torch.is_tensor(mask):  # padding fraction (a packed row's mask holds segment ids: > 0 is a token)
            self.tokens += mask.numel()
            self.real_tokens += (mask > 0).sum()  # a host tensor, read once per step (gather_step)
        if self.sample_log is not None:  # one JSON object per micro-batch (its padded token length, if any)
            rec = {"rank": self.rank, "step": self.step, "stage": self.stage, "keys": [str(k) for k in batch["keys"]]}
            if torch.is_tensor(mask):
                rec["length"] = int(mask.shape[-1])
            self.sample_log.write(json.dumps(rec) + "\n")
            self.sample_log.flush()
        self.reports.extend((str(path), str(why)) for path, why in batch["bad"])


def _as_pipe_batches(loader, stats: DataStats, family, count: bool = True, keyed: bool = False):
    """(first-stage fields, last-stage fields) per micro-batch; ``count``: this rank's draws and bad
    files count for the run (the first stage's; a last stage that reads only for labels does not);
    ``keyed``: the first-stage fields end in the sample keys (a model that draws dropout: ``sample_rng``)."""
    fields = tuple(family.inputs) + (KEY_FIELDS if keyed else ())
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            return
        if count:
            stats.wait += time.perf_counter() - t0
            stats.add(b)
        yield tuple(b[f] for f in fields), tuple(b[f] for f in family.labels) or LABEL_PLACEHOLDER


class TrainData:
    """This rank's training stream and its counters (``None`` stream: a middle stage)."""

    def __init__(self, run, start_step: int, data_position: Optional[dict], clock=None, keyed: bool = False):
        import itertools
        import os


        cfg, rank, where = run.cfg, run.rank, run.where
        sample_log = None
        if cfg.data.log_samples and where.reads_inputs:
            os.makedirs(os.path.join(run.out_dir, "samples"), exist_ok=True)
            sample_log = os.path.join(run.out_dir, "samples", f"rank{rank}.jsonl")
        self.stats = DataStats(sample_log, rank, where.stage, step_counter(run) if where.reads_inputs else None)
        self.collate = run.family.collate(run.tok, cfg.data)
        self.sampler = None  # its position is what a resume continues at
        self.parts = list(run.plan.parts)
        if data_position and data_position.get("balance_parts") != self.parts:  # refit prices of another cut
            data_position = {k: v for k, v in data_position.items() if k != "balance_prices"}
        if where.reads_data:
            loader = agree(rank, lambda: build_train_loader(cfg, run.source, run.tok, self.collate, run.topo,
                                                            where.dp_rank, start_step,
                                                            run.device_name == "cpu", run.family,
                                                            start_at=data_position,
                                                            prices=stage_prices(run.plan)))
            sampler = loader.batch_sampler  # torch's DataLoader holds the run's sampler there
            self.sampler = sampler if isinstance(sampler, MicroBatchSampler) else None
            self.stream = _as_pipe_batches(loader, self.stats, run.family, count=where.reads_inputs, keyed=keyed)
        else:
            agree(rank, lambda: None)  # the data-reading ranks' loader errors reach every rank
            self.stream = (itertools.repeat((None, LABEL_PLACEHOLDER)) if run.topo.is_last_stage(rank) else None)
        self.refit = PriceRefit(run, self.sampler, clock, start_step)

    def balance_fields(self, step: int) -> dict:
        """``data.balance: cost``: the sampler's prediction for step ``step`` (its spread and step times
        before and after the regrouping, and the slots' features), on a rank that reads data; else {}."""
        plan = self.sampler.step_plan(step) if self.sampler is not None else None
        return {**plan.predicted, "features": plan.features.tolist()} if plan is not None else {}

    def close(self) -> None:
        """The loader's workers exit with its iterator; ``data.balance: cost``'s worker process too."""
        if hasattr(self.stream, "close"):
            self.stream.close()
        if self.sampler is not None:
            self.sampler.close()

    def position(self, step: int) -> Optional[dict]:
        if self.sampler is None:
            return None
        pos = self.sampler.position(step)
        return {**pos, "balance_parts": self.parts} if "balance_prices" in pos else pos

    def step_batches(self, run, device):
        """This step's micro-batches. For a ``token_mean`` family every rank first learns the global
        batch's loss units (label tokens, counted on the last stage of each data-parallel replica),
        and each micro-batch's labels carry ``units / (micro-batches x data-parallel ranks)``: the
        engine's mean over micro-batches and ranks of ``sum / that`` is the mean over every label
        token of the step, whatever the tokens per micro-batch (not the mean of per-micro-batch
        means that ``loss / accumulation_steps`` gives)."""
        import torch.distributed as dist
        family, topo = run.family, run.topo
        if not family.token_mean:
            return self.stream
        A, D = topo.accumulation_steps, topo.data_parallel
        # a stage past the first reads only the labels: the inputs (a native-resolution family's patches) go
        # as each micro-batch is read
        first = topo.is_first_stage(run.rank)
        batches = ([(b[0] if first else None, b[1]) for b in (next(self.stream) for _ in range(A))]
                   if self.stream is not None else None)
        units = 0
        if batches is not None and topo.is_last_stage(run.rank):
            units = sum(family.loss_units(*labels) for _, labels in batches)
        t = torch.tensor([float(units)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        norm = torch.tensor(max(float(t.item()), 1.0) / (A * D), dtype=torch.float32)
        if not batches:
            return None
        return _handed_out([(inputs, tuple(labels) + (norm,)) for inputs, labels in batches])


def _handed_out(batches: list):
    """The step's micro-batches, each let go as the engine takes it: the engine keeps the iterator until
    the next step, and a list behind it would hold this step's batches while the next step's are read."""
    while batches:
        yield batches.pop(0)
