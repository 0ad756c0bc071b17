"""Which samples each rank reads, step after step.

``MicroBatchSampler`` cuts each global batch into micro-batches *the same way in every layout*
(P, DP, accumulation): data-parallel rank r takes micro-batches r*A .. r*A+A-1 of each global
batch. Because a per-micro-batch loss depends on the micro-batch, this is what makes losses
identical across layouts. It is deterministic in (seed, epoch), so every stage that reads data gets
the identical stream, and it can start at any step (resume). ``eval_batches`` cuts the val set."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Sampler

from mmpipe.data.manifest import Sample
from mmpipe.errors import DataError


def _item_key(item) -> tuple[int, int]:
    """Sampler items are ``index`` or ``(index, epoch)``; the epoch seeds augmentation."""
    return (item, 0) if isinstance(item, int) else (int(item[0]), int(item[1]))


@dataclass(frozen=True)
class StepPlan:
    """``data.balance: cost``'s record of one optimizer step, as the trainer reads it: ``features``, per
    (data-parallel rank, micro-batch) slot its vision units and token slots [D x A, 2]; ``predicted``, the
    regrouping's spread and step times before and after (``StepBalancer.last``)."""
    step: int
    features: np.ndarray
    predicted: dict


class MicroBatchSampler(Sampler):
    """Yields this data-parallel rank's micro-batches (lists of ``(index, epoch)``), step after
    step, forever (epochs reshuffle with ``seed + epoch``), starting at global step ``start_step``.

    Each epoch is one stream of micro-batches, defined by the micro-batch size alone: a seeded
    permutation cut into micro-batches; with ``lengths`` (caption token counts) every window of
    ``group_window`` micro-batches is sorted by length before it is cut, and the window's
    micro-batches are shuffled (HF's ``LengthGroupedSampler`` idea). Global step k takes the next
    ``accumulation x dp`` micro-batches and data-parallel rank r the r-th run of ``accumulation``
    of them, so every layout (P, DP, accumulation) sees the same micro-batches.

    ``start_at``, a ``position()`` saved by a run of another batch size, continues that run's
    epoch at the next unseen sample: its epoch's remaining micro-batches are taken ``accumulation
    x dp`` at a time (a micro-batch size change re-cuts the rest of the permutation), and the
    following epochs are cut as usual."""

    def __init__(self, num_samples: int, micro_batch_size: int, accumulation: int, dp_size: int, dp_rank: int,
                 seed: int, start_step: int = 0, shuffle: bool = True, max_steps: Optional[int] = None,
                 lengths=None, group_window: int = 64, start_at: Optional[dict] = None, balancer=None):
        self.balancer = balancer  # data.balance=cost: ``mmpipe.data.balance.StepBalancer`` regroups each step
        self.balanced: dict = {}  # step -> its regrouped micro-batches (the two last)
        self.balance_log: dict = {}  # step -> predicted spread before / after (the last 64 steps)
        self.n, self.mb, self.acc, self.dp, self.rank = num_samples, micro_batch_size, accumulation, dp_size, dp_rank
        self.seed, self.start_step, self.shuffle, self.max_steps = seed, start_step, shuffle, max_steps
        self.lengths = None if lengths is None else np.asarray(lengths)
        self.group_window = group_window
        self.global_batch = micro_batch_size * accumulation * dp_size
        self.per_step = accumulation * dp_size
        self._cache: dict = {}  # (epoch, offset) -> micro-batches; the two last used
        self.steps_per_epoch = len(self.epoch_micro_batches(0)) // self.per_step
        if self.steps_per_epoch < 1:
            raise DataError(f"the data set has {num_samples} samples, fewer than one global batch "
                            f"({self.global_batch}): lower train.batch_size or add data")
        # the anchor: global step ``start_step`` begins at micro-batch ``pos`` of ``epoch``, whose
        # micro-batches are the permutation from sample ``offset`` on
        epoch, k = divmod(start_step, self.steps_per_epoch)
        self.anchor = (start_step, epoch, 0, k * self.per_step)
        if start_at is not None:
            self.anchor = (start_step,) + self._continue(start_at)
        _, epoch, offset, pos = self.anchor
        if balancer is not None and start_at and start_at.get("balance_prices"):  # a refit run's prices go on
            balancer.restore_schedule(start_at["balance_prices"])
        self.first_steps = (len(self.epoch_micro_batches(epoch, offset)) - pos) // self.per_step  # left in it

    def _continue(self, at: dict) -> tuple:
        epoch, pos, mb = int(at["epoch"]), int(at["micro_batch"]), int(at["micro_batch_size"])
        if mb == self.mb:
            return epoch, int(at.get("offset", 0)), pos
        if self.lengths is not None:
            raise DataError(f"--resume: the checkpoint's micro-batch size is {mb}, this run's {self.mb}, and "
                            "data.group_by_length cuts each epoch by the micro-batch size: resume with "
                            f"parallel.micro_batch_size={mb} (train.batch_size may change), or finish the epoch first")
        return epoch, int(at.get("offset", 0)) + pos * mb, 0

    def _perm(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.n, generator=g)

    def epoch_micro_batches(self, epoch: int, offset: int = 0) -> list[list[int]]:
        """The micro-batches of ``epoch``; ``offset``: of its permutation from that sample on."""
        if (epoch, offset) in self._cache:
            return self._cache[(epoch, offset)]
        perm = self._perm(epoch).numpy()[offset:]
        mbs = []
        if self.lengths is None:
            mbs = [perm[i:i + self.mb].tolist() for i in range(0, len(perm) - self.mb + 1, self.mb)]
        else:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch + 7_777)
            w = self.group_window * self.mb
            for start in range(0, len(perm), w):
                win = perm[start:start + w]
                win = win[np.argsort(-self.lengths[win], kind="stable")]
                chunk = [win[i:i + self.mb].tolist() for i in range(0, len(win) - self.mb + 1, self.mb)]
                order = torch.randperm(len(chunk), generator=g).tolist() if self.shuffle else range(len(chunk))
                mbs.extend(chunk[i] for i in order)
        self._cache = {k: v for k, v in list(self._cache.items())[-1:]}
        self._cache[(epoch, offset)] = mbs
        return mbs

    def _locate(self, step: int) -> tuple:
        """(epoch, offset, first micro-batch) of global step ``step`` (>= the start step)."""
        step0, epoch, offset, pos = self.anchor
        d = step - step0
        if d < self.first_steps:
            return epoch, offset, pos + d * self.per_step
        e, k = divmod(d - self.first_steps, self.steps_per_epoch)
        return epoch + 1 + e, 0, k * self.per_step

    def position(self, steps_done: int) -> dict:
        """Where the stream stands after ``steps_done`` global steps: saved with a checkpoint, so a
        resume with another batch size continues at the next unseen sample (``start_at``)."""
        epoch, offset, pos = self._locate(steps_done)
        out = {"epoch": epoch, "offset": offset, "micro_batch": pos, "micro_batch_size": self.mb,
               "sample": offset + pos * self.mb}
        if self.balancer is not None and self.balancer.schedule:  # refit prices: in force then, and to come
            out["balance_prices"] = self.balancer.schedule_from(steps_done)
        return out

    def global_batch_indices(self, step: int) -> list[int]:
        return [i for mb in self.micro_batches(step, all_ranks=True) for i in mb]

    def micro_batches(self, step: int, all_ranks: bool = False) -> list[list[int]]:
        epoch, offset, pos = self._locate(step)
        mbs = self.epoch_micro_batches(epoch, offset)[pos:pos + self.per_step]
        if self.balancer is not None:  # the same samples, regrouped among the step's micro-batches and ranks
            if step not in self.balanced:
                following = None  # the next step's groups, for a regrouping worker to start on now
                if self.balancer.ahead is not None and (self.max_steps is None or step + 1 < self.max_steps):
                    e, o, p = self._locate(step + 1)
                    following = self.epoch_micro_batches(e, o)[p:p + self.per_step]
                self.balanced = {k: v for k, v in self.balanced.items() if k == step - 1}
                self.balanced[step] = self.balancer.regroup_step(step, mbs, following)
                self.balance_log[step] = {**self.balancer.last,
                                          "features": self.balancer.features(self.balanced[step])}
                self.balance_log.pop(step - 64, None)
            mbs = self.balanced[step]
        return mbs if all_ranks else mbs[self.rank * self.acc:(self.rank + 1) * self.acc]

    def step_plan(self, step: int) -> Optional[StepPlan]:
        """``data.balance: cost``'s record of optimizer step ``step`` (counted from 1, as the trainer does), or
        None (no balancer, or a step not regrouped here)."""
        rec = self.balance_log.get(step - 1)
        if rec is None:
            return None
        return StepPlan(step, np.asarray(rec["features"], dtype=np.float64),
                        {k: v for k, v in rec.items() if k != "features"})

    def reprice(self, prices, from_step: int) -> None:
        """``data.balance: cost`` refit (``mmpipe.train.price_refit``): regroup optimizer steps ``from_step``
        (counted from 1) on with ``prices``. Every data-reading rank is told the same step, one its loader has
        not reached."""
        first = from_step - 1  # (this sampler counts from 0)
        if self.balanced and max(self.balanced) >= first:
            raise RuntimeError(f"internal: step {from_step} was regrouped before its refit prices came "
                               f"(the loader reads {max(self.balanced) - first + 1} steps further ahead)")
        self.balancer.reprice(prices, first)

    def close(self) -> None:
        """Stop ``data.balance: cost``'s worker process, if any."""
        if self.balancer is not None:
            self.balancer.close()

    def __iter__(self) -> Iterator[list]:
        step = self.start_step
        while self.max_steps is None or step < self.max_steps:
            epoch = self._locate(step)[0]
            for mb in self.micro_batches(step):
                yield [(i, epoch) for i in mb]
            step += 1

    def __len__(self):
        if self.max_steps is None:
            return 2 ** 62
        return max(0, self.max_steps - self.start_step) * self.acc


def eval_batches(samples: list[Sample], micro_batch_size: int, multiple: int = 1,
                 pad: bool = True) -> tuple[list[list[int]], int]:
    """Sequential micro-batches over ``samples`` padded (by repeating the last sample) so their count
    is a multiple of ``multiple`` and every micro-batch is full: the pipeline needs fixed shapes
    (``pad=False``, for families whose shapes change anyway: the last micro-batch may be short).
    Returns (micro-batches, number of real samples)."""
    n = len(samples)
    if not pad:
        return [list(range(i, min(n, i + micro_batch_size))) for i in range(0, n, micro_batch_size)], n
    count = math.ceil(n / micro_batch_size)
    count = math.ceil(count / multiple) * multiple
    idx = list(range(n)) + [n - 1] * (count * micro_batch_size - n)
    return [idx[i * micro_batch_size:(i + 1) * micro_batch_size] for i in range(count)], n
